// A hand-written Hopper GEMM for the decode step's shapes (out[M, N] = x[M, K] @ W[N, K]^T, bf16, fp32 accumulate,
// M = the decode batch, <= 256) against cuBLAS as torch calls it (cublasGemmEx), timed side by side with the
// weights rotating over copies larger than L2. Answers issue 12's open question: does a kernel of our own beat
// cuBLAS at M = 256, where cuBLAS runs at ~590 (H100) / ~650 (H200) TFLOP/s against the ~790 of a large product?
//
// Design: persistent, warp-specialized. One producer warpgroup issues TMA loads (128-byte swizzle) of a 128-token
// x tile and a BN-feature W tile per 64-wide K block into a STAGES-deep ring guarded by mbarriers; two consumer
// warpgroups each multiply 64 tokens by the BN features with wgmma m64nBNk16 (both operands K-major in shared
// memory), keeping one wgmma group in flight, and store bf16 straight from the accumulators. Tiles are numbered
// token tile fastest, so the CTAs sharing a W tile run at the same time and W comes from HBM once. With SPLIT > 1
// each tile's K range is split in SPLIT parts that add fp32 partials into a workspace (then one conversion pass):
// for the narrow shapes (qkv, o_proj, down) whose tiles alone do not fill 132 multiprocessors. (The engine's own
// split-K-over-a-cluster down projection, once linked in here, lost to cuBLAS on an H100 and was removed.)
//
//   python3 bench/h200/wgmma_gen.py > bench/h200/wgmma_ops.h   (committed; regenerate after editing the generator)
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_probe bench/h200/wgmma_probe.cu \
//        -I<cublas include> -L<cublas lib> -lcublas && /tmp/wgmma_probe [M]
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../engine/kernels/hopper_ptx.cuh"
#include "wgmma_ops.h"

#define CHECK_CUDA(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    std::printf("cuda error %s at %d\n", cudaGetErrorString(e), __LINE__); std::exit(1); } } while (0)

namespace {

constexpr int BM = 128;  // tokens per tile: two consumer warpgroups of 64
constexpr int BK = 64;   // one 128-byte swizzle row of bf16
constexpr int THREADS = 384;

// arrive on the barrier at the same shared-memory offset in CTA `rank` of the cluster (this one included)
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(rank));
  // release at CTA scope, as for a local arrival: the wgmma reads of the stage are complete (wait_group) and
  // nothing else needs ordering; a cluster-scope release costs about a microsecond an arrival (measured)
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// the same box into the same offset of every CTA in `mask`, each CTA's barrier at `bar`'s offset counting its bytes
__device__ __forceinline__ void tma_load_multicast(const CUtensorMap* map, void* dst, uint64_t* bar, int inner,
                                                   int outer, uint16_t mask, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5, %6;" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(inner), "r"(outer), "h"(mask), "l"(policy)
      : "memory");
}

template <int BN, int STAGES>
struct Smem {
  alignas(1024) __nv_bfloat16 x[STAGES][BM * BK];
  alignas(1024) __nv_bfloat16 w[STAGES][BN * BK];
  uint64_t full[STAGES];
  uint64_t empty[STAGES];
};

// CLUSTER = 2: the two token tiles of a W tile run as a cluster, and each CTA loads half of the W tile and
// multicasts it to both, halving W's traffic from L2 to the multiprocessors (needs M <= 2 * BM)
// SILU: W is a fused [gate; up] projection of 2I rows; a tile takes BN/2 gate rows and the same BN/2 up rows, and
// the epilogue writes silu(gate) * up, [M, I], so the [M, 2I] product never goes to memory
template <int BN, int STAGES, int SPLIT, int CLUSTER, bool SILU>
__global__ void __launch_bounds__(THREADS, 1)
gemm_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
            __nv_bfloat16* __restrict__ out, float* __restrict__ partial, int M, int N, int K) {
  extern __shared__ uint8_t raw_smem[];
  auto& s = *reinterpret_cast<Smem<BN, STAGES>*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
  const int m_tiles = CLUSTER == 1 ? (M + BM - 1) / BM : CLUSTER;
  const int n_tiles = SILU ? (N / 2) / (BN / 2) : (N + BN - 1) / BN;  // the host checks divisibility for SILU
  const int k_blocks = K / BK / SPLIT;  // the host checks divisibility
  const int warpgroup = threadIdx.x / 128;
  const uint32_t rank = CLUSTER == 1 ? 0 : cluster_rank();
  // work items: (token tile, W tile, K part); a cluster takes its CTAs' token tiles of one (W tile, K part)
  const int items = n_tiles * SPLIT * (CLUSTER == 1 ? m_tiles : 1);
  const int first_item = blockIdx.x / CLUSTER, item_stride = gridDim.x / CLUSTER;

  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 8 * CLUSTER);  // one arrival per consumer warp of every CTA reading the stage
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (CLUSTER > 1) cluster_sync();  // no multicast may reach a barrier before it is initialised

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      uint64_t keep, stream;  // x is read by every tile, W once
      asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(stream));
      int step = 0;
      for (int item = first_item; item < items; item += item_stride) {
        const int m_tile = CLUSTER == 1 ? item % m_tiles : int(rank);
        const int nk = CLUSTER == 1 ? item / m_tiles : item;
        const int n_tile = nk % n_tiles, split = nk / n_tiles;
        for (int kb = split * k_blocks; kb < (split + 1) * k_blocks; ++kb, ++step) {
          const int stage = step % STAGES;
          if (step >= STAGES) mbar_wait(&s.empty[stage], ((step / STAGES) - 1) & 1);
          mbar_expect_tx(&s.full[stage], (BM + BN) * BK * 2);
          tma_load(&x_map, s.x[stage], &s.full[stage], kb * BK, m_tile * BM, keep);
          if (SILU && CLUSTER == 1) {
            tma_load(&w_map, s.w[stage], &s.full[stage], kb * BK, n_tile * (BN / 2), stream);
            tma_load(&w_map, &s.w[stage][(BN / 2) * BK], &s.full[stage], kb * BK, N / 2 + n_tile * (BN / 2), stream);
          } else if (SILU) {  // CTA 0 brings the gate rows to both, CTA 1 the up rows
            tma_load_multicast(&w_map, &s.w[stage][rank * (BN / 2) * BK], &s.full[stage], kb * BK,
                               int(rank) * (N / 2) + n_tile * (BN / 2), 3, stream);
          } else if (CLUSTER == 1) {
            tma_load(&w_map, s.w[stage], &s.full[stage], kb * BK, n_tile * BN, stream);
          } else {
            constexpr int rows = BN / CLUSTER;
            tma_load_multicast(&w_map, &s.w[stage][rank * rows * BK], &s.full[stage], kb * BK,
                               n_tile * BN + rank * rows, (1 << CLUSTER) - 1, stream);
          }
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int consumer = warpgroup - 1;
    const int lane = threadIdx.x % 32;
    const int warp = (threadIdx.x % 128) / 32;
    float acc[BN / 2];
    int step = 0;
    auto release = [&](int stage) {
      if (lane != 0) return;
      if (CLUSTER == 1) {
        mbar_arrive(&s.empty[stage]);
      } else {
#pragma unroll
        for (int r = 0; r < CLUSTER; ++r) mbar_arrive_cluster(&s.empty[stage], r);
      }
    };
    for (int item = first_item; item < items; item += item_stride) {
      const int m_tile = CLUSTER == 1 ? item % m_tiles : int(rank);
      const int nk = CLUSTER == 1 ? item / m_tiles : item;
      const int n_tile = nk % n_tiles;
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
      for (int kb = 0; kb < k_blocks; ++kb, ++step) {
        const int stage = step % STAGES;
        mbar_wait(&s.full[stage], (step / STAGES) & 1);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        const uint64_t a = smem_desc(&s.x[stage][consumer * 64 * BK]);
        const uint64_t b = smem_desc(&s.w[stage][0]);
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) Wgmma<BN>::run(acc, a + 2 * kk, b + 2 * kk);  // +32 bytes a step
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        // keep this block's products in flight; the previous block's are done, so its stage can be refilled
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (kb > 0) release((step - 1) % STAGES);
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      release((step - 1) % STAGES);

      // accumulator layout of m64nN: thread (warp, lane) holds rows warp*16 + lane/4 (+8), columns 8j + 2(lane%4)
      const int row0 = m_tile * BM + consumer * 64 + warp * 16 + lane / 4;
      if (SILU) {
        const int out_cols = N / 2;
        const int silu_col0 = n_tile * (BN / 2) + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = row0 + 8 * half;
            if (row < M) {
              float v[2];
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float gate = acc[4 * j + 2 * half + e], up = acc[4 * (j + BN / 16) + 2 * half + e];
                v[e] = gate / (1.f + __expf(-gate)) * up;
              }
              *reinterpret_cast<__nv_bfloat162*>(out + size_t(row) * out_cols + silu_col0 + 8 * j) =
                  __floats2bfloat162_rn(v[0], v[1]);
            }
          }
        }
        continue;
      }
      const int col0 = n_tile * BN + 2 * (lane % 4);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = col0 + 8 * j;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = row0 + 8 * half;
          if (row < M && col < N) {
            const float v0 = acc[4 * j + 2 * half], v1 = acc[4 * j + 2 * half + 1];
            if (SPLIT == 1) {
              *reinterpret_cast<__nv_bfloat162*>(out + size_t(row) * N + col) = __floats2bfloat162_rn(v0, v1);
            } else {
              float* p = partial + size_t(row) * N + col;
              asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v0), "f"(v1) : "memory");
            }
          }
        }
      }
    }
  }
  // a CTA's shared memory must outlive the peer's last multicast into it and last arrival on its barriers
  if (CLUSTER > 1) {
    __syncwarp();
    cluster_sync();
  }
}

// the unfused baseline's second kernel: [M, 2I] -> silu(gate) * up, [M, I], bf16 in and out, fp32 math
__global__ void silu_and_mul(const __nv_bfloat16* __restrict__ in, __nv_bfloat16* __restrict__ out, int m, int inter) {
  const size_t pairs = size_t(m) * inter / 2;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < pairs; i += size_t(gridDim.x) * blockDim.x) {
    const size_t row = i * 2 / inter, col = i * 2 % inter;
    const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(in + row * 2 * inter + col));
    const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(in + row * 2 * inter + inter + col));
    *reinterpret_cast<__nv_bfloat162*>(out + row * inter + col) =
        __floats2bfloat162_rn(g.x / (1.f + __expf(-g.x)) * u.x, g.y / (1.f + __expf(-g.y)) * u.y);
  }
}

__global__ void to_bf16(const float* __restrict__ in, __nv_bfloat16* __restrict__ out, size_t count) {
  for (size_t i = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) * 4; i < count;
       i += size_t(gridDim.x) * blockDim.x * 4) {
    const float4 v = *reinterpret_cast<const float4*>(in + i);
    *reinterpret_cast<__nv_bfloat162*>(out + i) = __floats2bfloat162_rn(v.x, v.y);
    *reinterpret_cast<__nv_bfloat162*>(out + i + 2) = __floats2bfloat162_rn(v.z, v.w);
  }
}

__global__ void fill(__nv_bfloat16* p, size_t count, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i * 2654435761u) ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.04f);
  }
}

// a row-major [rows, K] bf16 matrix read in boxes of box_rows x 64
CUtensorMap tensor_map(const __nv_bfloat16* base, int rows, int k, int box_rows) {
  CUtensorMap map;
  if (!tensor_map(&map, base, rows, k, box_rows)) {
    std::printf("cuTensorMapEncodeTiled failed\n");
    std::exit(1);
  }
  return map;
}

struct Problem {
  int m, n, k;
  __nv_bfloat16* x;
  std::vector<__nv_bfloat16*> weights;
  __nv_bfloat16* out;
  float* partial;
  CUtensorMap x_map;
  std::vector<CUtensorMap> w_maps;
};

template <int BN, int STAGES, int SPLIT, int CLUSTER, bool SILU>
void launch(const Problem& p, int copy, int num_sms, cudaStream_t stream) {
  auto kernel = gemm_kernel<BN, STAGES, SPLIT, CLUSTER, SILU>;
  const size_t smem = sizeof(Smem<BN, STAGES>) + 1024;
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = CLUSTER;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  static int max_ctas = 0;
  if (!max_ctas) {
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    if (CLUSTER > 1) CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    int clusters = 0;
    config.gridDim = dim3(num_sms / CLUSTER * CLUSTER);
    CHECK_CUDA(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
    max_ctas = std::min(clusters * CLUSTER, num_sms / CLUSTER * CLUSTER);
    std::printf("    (tile %d x %d, %d stages, split %d, cluster %d: %d CTAs resident, %zu bytes of shared memory)\n",
                BM, BN, STAGES, SPLIT, CLUSTER, max_ctas, smem);
  }
  const int m_tiles = (p.m + BM - 1) / BM;
  const int n_tiles = SILU ? (p.n / 2) / (BN / 2) : (p.n + BN - 1) / BN;
  const int items = n_tiles * SPLIT * (CLUSTER == 1 ? m_tiles : 1);
  config.gridDim = dim3(std::min(items * CLUSTER, max_ctas));
  config.numAttrs = CLUSTER > 1;  // is a cluster attribute of 1 what made the plain kernel ~20% slower?
  if (SPLIT > 1) CHECK_CUDA(cudaMemsetAsync(p.partial, 0, size_t(p.m) * p.n * 4, stream));
  CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, p.x_map, p.w_maps[copy], p.out, p.partial, p.m, p.n, p.k));
  if (SPLIT > 1) to_bf16<<<num_sms * 4, 256, 0, stream>>>(p.partial, p.out, size_t(p.m) * p.n);
}

template <typename Fn>
float time_us(Fn&& fn, int copies, int reps, cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) fn(i % copies);
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaEventRecord(start, stream);
  for (int i = 0; i < reps; ++i) fn(i % copies);
  cudaEventRecord(end, stream);
  CHECK_CUDA(cudaEventSynchronize(end));
  float ms = 0;
  cudaEventElapsedTime(&ms, start, end);
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  return ms * 1e3f / reps;
}

float max_rel_err(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t count) {
  std::vector<__nv_bfloat16> ha(count), hb(count);
  CHECK_CUDA(cudaMemcpy(ha.data(), a, count * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hb.data(), b, count * 2, cudaMemcpyDeviceToHost));
  double worst = 0, scale = 0;
  for (size_t i = 0; i < count; ++i) scale = std::max(scale, double(std::fabs(__bfloat162float(hb[i]))));
  for (size_t i = 0; i < count; ++i)
    worst = std::max(worst, double(std::fabs(__bfloat162float(ha[i]) - __bfloat162float(hb[i]))));
  return float(worst / std::max(scale, 1e-30));
}

struct Variant {
  const char* label;
  void (*run)(const Problem&, int, int, cudaStream_t);
  int bn, split, cluster;
  bool silu;
};

#define VARIANT(BN, ST, SP, CL) \
  Variant{#BN " " #ST "st split" #SP " cluster" #CL, launch<BN, ST, SP, CL, false>, BN, SP, CL, false}
#define SILU_VARIANT(BN, ST, CL) \
  Variant{#BN " " #ST "st cluster" #CL " +silu", launch<BN, ST, 1, CL, true>, BN, 1, CL, true}

}  // namespace

int main(int argc, char** argv) {
  const int m = argc > 1 ? std::atoi(argv[1]) : 256;
  const int reps = m > 1024 ? 20 : 200;
  int num_sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, M = %d\n", prop.name, num_sms, m);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cublasHandle_t handle;
  cublasCreate(&handle);
  cublasSetStream(handle, stream);
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, 32 << 20));
  cublasSetWorkspace(handle, workspace, 32 << 20);

  struct Shape { const char* name; int n, k; std::vector<Variant> variants; bool silu = false; };
  const std::vector<Shape> shapes = {
      {"gate_up+silu_and_mul", 28672, 4096, {SILU_VARIANT(224, 5, 1), SILU_VARIANT(224, 5, 2), SILU_VARIANT(224, 4, 2),
                                             SILU_VARIANT(256, 4, 1), SILU_VARIANT(128, 6, 2)}, true},
      {"gate_up", 28672, 4096, {VARIANT(224, 5, 1, 1), VARIANT(224, 5, 1, 2), VARIANT(224, 4, 1, 2),
                                VARIANT(256, 4, 1, 2), VARIANT(128, 6, 1, 2)}},
      {"lm_head", 128256, 4096, {VARIANT(224, 4, 1, 1), VARIANT(256, 4, 1, 2), VARIANT(224, 5, 1, 2),
                                 VARIANT(128, 6, 1, 2)}},
      {"down", 4096, 14336, {VARIANT(64, 8, 1, 2)}},
      {"qkv", 6144, 4096, {VARIANT(96, 7, 1, 1), VARIANT(96, 7, 1, 2)}},
      {"o_proj", 4096, 4096, {VARIANT(64, 8, 1, 1), VARIANT(64, 8, 1, 2)}},
  };
  const char* only = argc > 2 ? argv[2] : nullptr;  // a shape name: only that shape
  for (const Shape& shape : shapes) {
    if (only && std::string(shape.name) != only) continue;
    Problem p{m, shape.n, shape.k};
    const size_t w_elems = size_t(p.n) * p.k;
    const int copies = std::max<int>(2, int((600ull << 20) / (w_elems * 2)) + 1);
    CHECK_CUDA(cudaMalloc(&p.x, size_t(p.m) * p.k * 2));
    fill<<<1024, 256>>>(p.x, size_t(p.m) * p.k, 7);
    for (int c = 0; c < copies; ++c) {
      __nv_bfloat16* w;
      CHECK_CUDA(cudaMalloc(&w, w_elems * 2));
      fill<<<1024, 256>>>(w, w_elems, 100 + c);
      p.weights.push_back(w);
    }
    __nv_bfloat16* reference;
    CHECK_CUDA(cudaMalloc(&reference, size_t(p.m) * p.n * 2));
    CHECK_CUDA(cudaMalloc(&p.out, size_t(p.m) * p.n * 2));
    CHECK_CUDA(cudaMalloc(&p.partial, size_t(p.m) * p.n * 4));
    p.x_map = tensor_map(p.x, p.m, p.k, BM);
    const float alpha = 1.f, beta = 0.f;
    auto cublas = [&](int c, __nv_bfloat16* dst) {
      // out^T (N x M, column-major) = W (K x N, transposed) x^T (K x M)
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, p.n, p.m, p.k, &alpha, p.weights[c], CUDA_R_16BF, p.k, p.x,
                   CUDA_R_16BF, p.k, &beta, dst, CUDA_R_16BF, p.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    };
    const double flop = 2.0 * p.m * p.n * p.k;
    const int inter = p.n / 2;
    auto baseline = [&](int c, __nv_bfloat16* dst) {
      if (!shape.silu) return cublas(c, dst);
      cublas(c, p.out);  // out has room for [M, 2I]; the result goes to dst, [M, I]
      silu_and_mul<<<num_sms * 8, 256, 0, stream>>>(p.out, dst, p.m, inter);
    };
    __nv_bfloat16* silu_out = nullptr;
    if (shape.silu) CHECK_CUDA(cudaMalloc(&silu_out, size_t(p.m) * inter * 2));
    const float base_us = time_us([&](int c) { baseline(c, shape.silu ? silu_out : p.out); }, copies, reps, stream);
    std::printf("M=%d %s N=%d K=%d: cuBLAS %.1f us %.0f TFLOP/s\n", p.m, shape.name, p.n, p.k, base_us,
                flop / base_us / 1e6);
    baseline(0, reference);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    for (const Variant& v : shape.variants) {
      if ((p.k / BK) % v.split) continue;
      p.w_maps.clear();
      if (v.cluster > 1 && (p.m + BM - 1) / BM > v.cluster) continue;
      const int box_rows = v.silu ? v.bn / 2 : v.bn / v.cluster;
      for (int c = 0; c < copies; ++c) p.w_maps.push_back(tensor_map(p.weights[c], p.n, p.k, box_rows));
      CHECK_CUDA(cudaMemsetAsync(p.out, 0, size_t(p.m) * p.n * 2, stream));
      v.run(p, 0, num_sms, stream);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const float err = max_rel_err(p.out, reference, size_t(p.m) * (v.silu ? inter : p.n));
      const float us = time_us([&](int c) { v.run(p, c, num_sms, stream); }, copies, reps, stream);
      std::printf("  %-20s %.1f us %.0f TFLOP/s (%.3fx cuBLAS), max err %.1e of max |out|\n", v.label, us,
                  flop / us / 1e6, base_us / us, err);
    }
    // cuBLAS again, to see the clock drift over the shape's runs
    const float again_us = time_us([&](int c) { baseline(c, shape.silu ? silu_out : p.out); }, copies, reps, stream);
    cudaFree(silu_out);
    std::printf("  cuBLAS again %.1f us\n", again_us);
    for (auto* w : p.weights) cudaFree(w);
    cudaFree(p.x);
    cudaFree(reference);
    cudaFree(p.out);
    cudaFree(p.partial);
  }
  return 0;
}
