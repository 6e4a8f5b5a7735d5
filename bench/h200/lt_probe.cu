// cuBLASLt's candidate algorithms for the decode step's GEMMs (Llama-3.1-8B shapes, bf16, fp32 accumulate):
// every algorithm the heuristic offers, each also with split-K 1/2/3/4/6/8 where the algorithm allows it, timed
// with the weights rotating over copies larger than L2 (as in a step, where the other layers evict them).
// Answers whether a cuBLASLt configuration beats the one torch's F.linear gets at M = 256. Written 2026-12-04, not yet
// run: no device was lent in the two sessions since (first run may need fixes).
//
//   nvcc -O2 -std=c++17 -o /tmp/lt_probe bench/h200/lt_probe.cu -lcublasLt && /tmp/lt_probe [--all] 256 8448
// (--all: also every algorithm id x tile x stages x cluster shape x split-K that cublasLtMatmulAlgoCheck accepts)
// (without the CUDA toolkit's cuBLAS headers, take them from the nvidia_cublas wheel: unzip it into /tmp/cublas, link
// libcublasLt.so to its .so.13 and add -I/tmp/cublas/nvidia/cu13/include -L/tmp/cublas/nvidia/cu13/lib; it compiles
// so on the CPU box with nvcc 13.0)
//
// out[M, N] = x[M, K] @ W[N, K]^T, row-major, is out^T = W x^T in cuBLAS's column-major terms:
// A = W (K x N, lda K, transposed), B = x (K x M, ldb K), D = out^T (N x M, ldd N).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK_CUDA(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    std::printf("cuda error %s at %d\n", cudaGetErrorString(e), __LINE__); std::exit(1); } } while (0)
#define CHECK_LT(x) do { cublasStatus_t lt_status = (x); if (lt_status != CUBLAS_STATUS_SUCCESS) { \
    std::printf("cublasLt error %d at %d\n", (int)lt_status, __LINE__); std::exit(1); } } while (0)

struct Shape { const char* name; int n, k; };

static __global__ void fill(__nv_bfloat16* p, size_t count, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)(i * 2654435761u) ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.04f);
  }
}

template <typename T>
static T attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t which) {
  T value{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, which, &value, sizeof(value), &written);
  return value;
}

template <typename T>
static T attr_cap(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t which) {
  T value{};
  size_t written = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, which, &value, sizeof(value), &written);
  return value;
}

int main(int argc, char** argv) {
  std::vector<int> batches;
  bool exhaustive = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--all") exhaustive = true;
    else batches.push_back(std::atoi(argv[i]));
  }
  if (batches.empty()) batches.push_back(256);
  const Shape shapes[] = {{"qkv", 6144, 4096}, {"o_proj", 4096, 4096}, {"gate_up", 28672, 4096},
                          {"down", 4096, 14336}, {"lm_head", 128256, 4096}};
  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  const size_t workspace_bytes = 64ull << 20;
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  const float alpha = 1.0f, beta = 0.0f;
  const int reps = 60;

  for (int m : batches) {
    for (const Shape& s : shapes) {
      const size_t w_elems = (size_t)s.n * s.k;
      const int copies = std::max<int>(2, (int)((600ull << 20) / (w_elems * 2)) + 1);
      std::vector<__nv_bfloat16*> weights(copies);
      for (int c = 0; c < copies; ++c) {
        CHECK_CUDA(cudaMalloc(&weights[c], w_elems * 2));
        fill<<<1024, 256, 0, stream>>>(weights[c], w_elems, 17u + c);
      }
      __nv_bfloat16 *x, *out;
      CHECK_CUDA(cudaMalloc(&x, (size_t)m * s.k * 2));
      CHECK_CUDA(cudaMalloc(&out, (size_t)m * s.n * 2));
      fill<<<1024, 256, 0, stream>>>(x, (size_t)m * s.k, 5u);

      cublasLtMatmulDesc_t desc;
      CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
      CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
      CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
      cublasLtMatrixLayout_t a_layout, b_layout, d_layout;
      CHECK_LT(cublasLtMatrixLayoutCreate(&a_layout, CUDA_R_16BF, s.k, s.n, s.k));
      CHECK_LT(cublasLtMatrixLayoutCreate(&b_layout, CUDA_R_16BF, s.k, m, s.k));
      CHECK_LT(cublasLtMatrixLayoutCreate(&d_layout, CUDA_R_16BF, s.n, m, s.n));
      cublasLtMatmulPreference_t pref;
      CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
      CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                                    sizeof(workspace_bytes)));
      const int wanted = 64;
      std::vector<cublasLtMatmulHeuristicResult_t> found(wanted);
      int returned = 0;
      CHECK_LT(cublasLtMatmulAlgoGetHeuristic(lt, desc, a_layout, b_layout, d_layout, d_layout, pref, wanted,
                                              found.data(), &returned));

      struct Timed { double us; int rank; int splitk; cublasLtMatmulAlgo_t algo; };
      std::vector<Timed> timed;
      auto time_algo = [&](const cublasLtMatmulAlgo_t& algo, int count) -> double {
        cublasLtMatmulHeuristicResult_t check{};
        if (cublasLtMatmulAlgoCheck(lt, desc, a_layout, b_layout, d_layout, d_layout, &algo, &check) !=
            CUBLAS_STATUS_SUCCESS || check.workspaceSize > workspace_bytes)
          return -1.0;
        for (int i = 0; i < 3; ++i)
          if (cublasLtMatmul(lt, desc, &alpha, weights[i % copies], a_layout, x, b_layout, &beta, out, d_layout,
                             out, d_layout, &algo, workspace, workspace_bytes, stream) != CUBLAS_STATUS_SUCCESS)
            return -1.0;
        cudaEventRecord(start, stream);
        for (int i = 0; i < count; ++i)
          cublasLtMatmul(lt, desc, &alpha, weights[i % copies], a_layout, x, b_layout, &beta, out, d_layout, out,
                         d_layout, &algo, workspace, workspace_bytes, stream);
        cudaEventRecord(end, stream);
        cudaEventSynchronize(end);
        float ms = 0;
        cudaEventElapsedTime(&ms, start, end);
        return ms * 1e3 / count;
      };
      for (int r = 0; r < returned; ++r) {
        if (found[r].state != CUBLAS_STATUS_SUCCESS) continue;
        const cublasLtMatmulAlgo_t base = found[r].algo;
        const int base_split = attr<int>(base, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
        for (int split : {0, 1, 2, 3, 4, 6, 8}) {
          cublasLtMatmulAlgo_t algo = base;
          if (split > 0) {
            if (split == base_split) continue;
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split));
            if (split > 1) {
              uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
              cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                   sizeof(scheme));
            }
          }
          const double us = time_algo(algo, reps);
          if (us > 0) timed.push_back({us, r, split > 0 ? split : base_split, algo});
        }
      }
      // Beyond the heuristic: every algorithm id x its tiles x its stages x a few cluster shapes x split-K, each
      // checked by cublasLtMatmulAlgoCheck, timed briefly, and the best few timed again at full length.
      if (exhaustive) {
        std::vector<int> ids(256);
        int num_ids = 0;
        CHECK_LT(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                                          CUDA_R_16BF, (int)ids.size(), ids.data(), &num_ids));
        std::vector<Timed> quick;
        int checked = 0;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(40);
        for (int a = 0; a < num_ids; ++a) {
          cublasLtMatmulAlgo_t algo;
          if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                                     CUDA_R_16BF, ids[a], &algo) != CUBLAS_STATUS_SUCCESS)
            continue;
          auto cap_list = [&](cublasLtMatmulAlgoCapAttributes_t which) {
            size_t bytes = 0;
            cublasLtMatmulAlgoCapGetAttribute(&algo, which, nullptr, 0, &bytes);
            std::vector<uint32_t> values(bytes / sizeof(uint32_t));
            if (!values.empty())
              cublasLtMatmulAlgoCapGetAttribute(&algo, which, values.data(), bytes, &bytes);
            if (values.empty()) values.push_back(0);
            return values;
          };
          const std::vector<uint32_t> tiles = cap_list(CUBLASLT_ALGO_CAP_TILE_IDS);
          const std::vector<uint32_t> stages = cap_list(CUBLASLT_ALGO_CAP_STAGES_IDS);
          const int splitk_ok = attr_cap<int>(algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT);
          for (uint32_t tile : tiles)
            for (uint32_t stage : stages)
              for (uint32_t cluster : {0u, 2u, 3u, 5u})
                for (int split : {1, 2, 3, 4, 6})
                  for (uint32_t swizzle : {0u, 1u}) {
                    if (split > 1 && !splitk_ok) continue;
                    if (std::chrono::steady_clock::now() > deadline) continue;  // a budget per shape
                    cublasLtMatmulAlgo_t c = algo;
                    cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
                    cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stage, sizeof(stage));
                    cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster,
                                                         sizeof(cluster));
                    cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split));
                    uint32_t scheme = split > 1 ? CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE : CUBLASLT_REDUCTION_SCHEME_NONE;
                    cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                         sizeof(scheme));
                    cublasLtMatmulAlgoConfigSetAttribute(&c, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle,
                                                         sizeof(swizzle));
                    ++checked;
                    const double us = time_algo(c, 8);
                    if (us > 0) quick.push_back({us, -1, split, c});
                  }
        }
        cudaGetLastError();  // a rejected launch leaves its error behind; the timings above skip those
        std::sort(quick.begin(), quick.end(), [](const Timed& a, const Timed& b) { return a.us < b.us; });
        std::printf("M=%d %s: exhaustive: %d algorithm ids, %d configurations tried, %zu ran%s\n", m, s.name,
                    num_ids, checked, quick.size(),
                    std::chrono::steady_clock::now() > deadline ? " (stopped at its 40 s budget)" : "");
        for (size_t i = 0; i < quick.size() && i < 12; ++i) {
          Timed t = quick[i];
          t.us = time_algo(t.algo, reps);
          if (t.us > 0) timed.push_back(t);
        }
      }
      CHECK_CUDA(cudaGetLastError());
      const double flop = 2.0 * m * s.n * s.k;
      std::printf("M=%d %s N=%d K=%d: %d heuristic results, %zu timed configurations\n", m, s.name, s.n, s.k,
                  returned, timed.size());
      double first = -1;
      for (const Timed& t : timed)
        if (t.rank == 0) { first = t.us; break; }
      std::sort(timed.begin(), timed.end(), [](const Timed& a, const Timed& b) { return a.us < b.us; });
      for (size_t i = 0; i < timed.size() && i < 8; ++i) {
        const Timed& t = timed[i];
        std::printf("  %7.1f us %4.0f TFLOP/s  heuristic #%d algo %d tile %d stages %d splitK %d reduction %u "
                    "swizzle %u cluster %u inner %u\n",
                    t.us, flop / t.us / 1e6, t.rank, attr<int>(t.algo, CUBLASLT_ALGO_CONFIG_ID),
                    attr<int>(t.algo, CUBLASLT_ALGO_CONFIG_TILE_ID), attr<int>(t.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                    t.splitk, attr<uint32_t>(t.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                    attr<uint32_t>(t.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                    attr<uint32_t>(t.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                    attr<uint32_t>(t.algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID));
      }
      if (first > 0)
        std::printf("  heuristic's first: %.1f us %.0f TFLOP/s\n", first, flop / first / 1e6);
      std::fflush(stdout);
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(a_layout);
      cublasLtMatrixLayoutDestroy(b_layout);
      cublasLtMatrixLayoutDestroy(d_layout);
      cublasLtMatmulDescDestroy(desc);
      for (auto* w : weights) cudaFree(w);
      cudaFree(x);
      cudaFree(out);
    }
  }
  return 0;
}
