// Prefill attention of one sequence over the paged KV cache on CPUs with AVX512-BF16
// (engine/layers/attention.py: prefill_attention).
//
// Why: the torch path gathers the context, builds a [Tq, T] mask and runs SDPA once per sequence and layer; a step of
// 8 x 256-token SmolLM2 prompts spent ~290 ms of ~1.49 s there. Here both products run on VDPBF16PS, the layout of
// engine/layers/cpu_linear.cpp: one operand packed so that a 64-byte vector holds 16 outputs x 2 consecutive
// reduction elements, the other's pair broadcast, float32 sums, no sums across lanes.
//
//   1. Each KV head's context is packed once a call: keys in tiles of 16 tokens [D/2][16][2] (scores: 16 keys a
//      vector), values in token pairs [D][2] (outputs: 16 dims a vector, the pair of keys reduced).
//   2. The query rows (position-major, then the GQA group's heads, so a run of rows shares its keys) go in blocks of
//      a few rows; a block walks its keys (only up to its last position: causal) in spans of up to 256, computes
//      the span's float32 scores, masks the causal / sliding-window edges, updates an online softmax (running max
//      and sum per row, float32), rounds P to bf16 and adds P.V into float32 outputs held in L1.
//   3. Work units are (KV head, run of row blocks), costliest (latest positions) first, taken from a shared
//      counter, so the causal triangle does not leave one thread idle; packing and units share one parallel region.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace prefill_attention_kernel {

constexpr int64_t kTile = 16;          // keys a score vector
constexpr int64_t kSpanTiles = 16;     // key tiles a span of the online softmax (256 keys)
constexpr int64_t kSpan = kTile * kSpanTiles;
constexpr int64_t kBlocksPerUnit = 8;  // row blocks a work unit
constexpr int64_t kPackTiles = 4;       // key tiles a packing job

#ifdef TANDEM_AVX512_BF16
// scores[m][n*16 + s] = scale * q_m . key s of tile n, for Rows rows and Tiles tiles; tiles: [Tiles][D/2][16] pairs
template <int Rows, int Tiles>
TANDEM_AVX512_BF16 void scores(const uint16_t* const* q_rows, const uint32_t* tiles, int64_t pairs, float scale,
                                  float* out, int64_t out_stride) {
  __m512 acc[Rows][Tiles];
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < Tiles; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh keys[Tiles];
#pragma GCC unroll 4
    for (int n = 0; n < Tiles; ++n) keys[n] = (__m512bh)_mm512_loadu_si512(tiles + (n * pairs + p) * kTile);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      int32_t pair;
      std::memcpy(&pair, q_rows[m] + 2 * p, sizeof(pair));
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int n = 0; n < Tiles; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], keys[n], qb);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m)
#pragma GCC unroll 4
    for (int n = 0; n < Tiles; ++n) _mm512_storeu_ps(out + m * out_stride + n * kTile, _mm512_mul_ps(acc[m][n], s));
}

template <int Rows>
TANDEM_AVX512_BF16 void span_scores(const uint16_t* const* q_rows, const uint32_t* tiles, int64_t num_tiles,
                                       int64_t pairs, float scale, float* out, int64_t out_stride) {
  int64_t t = 0;
  for (; t + 4 <= num_tiles; t += 4)
    scores<Rows, 4>(q_rows, tiles + t * pairs * kTile, pairs, scale, out + t * kTile, out_stride);
  for (; t < num_tiles; ++t)
    scores<Rows, 1>(q_rows, tiles + t * pairs * kTile, pairs, scale, out + t * kTile, out_stride);
}

TANDEM_AVX512_BF16 void span_scores(int rows, const uint16_t* const* q_rows, const uint32_t* tiles,
                                       int64_t num_tiles, int64_t pairs, float scale, float* out, int64_t out_stride) {
  switch (rows) {
    case 1: span_scores<1>(q_rows, tiles, num_tiles, pairs, scale, out, out_stride); break;
    case 2: span_scores<2>(q_rows, tiles, num_tiles, pairs, scale, out, out_stride); break;
    case 3: span_scores<3>(q_rows, tiles, num_tiles, pairs, scale, out, out_stride); break;
    case 4: span_scores<4>(q_rows, tiles, num_tiles, pairs, scale, out, out_stride); break;
    case 5: span_scores<5>(q_rows, tiles, num_tiles, pairs, scale, out, out_stride); break;
    default: span_scores<6>(q_rows, tiles, num_tiles, pairs, scale, out, out_stride); break;
  }
}

// out[m][0..D) += sum over key pairs j of P[m][2j..2j+1] . values[j][..][2], for Rows rows; Dims = D / 16
template <int Dims, int Rows>
TANDEM_AVX512_BF16 void weighted_values(const uint32_t* probs, int64_t probs_stride, const uint16_t* values,
                                           int64_t num_pairs, float* out) {
  constexpr int64_t D = Dims * 16;
  __m512 acc[Rows][Dims];
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < Dims; ++n) acc[m][n] = _mm512_loadu_ps(out + m * D + n * 16);
  for (int64_t j = 0; j < num_pairs; ++j) {
    __m512bh v[Dims];
#pragma GCC unroll 16
    for (int n = 0; n < Dims; ++n) v[n] = (__m512bh)_mm512_loadu_si512(values + j * 2 * D + n * 32);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(probs[m * probs_stride + j]));
#pragma GCC unroll 16
      for (int n = 0; n < Dims; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], v[n], pb);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < Dims; ++n) _mm512_storeu_ps(out + m * D + n * 16, acc[m][n]);
}

// rows a block: the output sums of a block stay in registers through its P.V (at most 24 of the 32 vectors)
template <int Dims>
constexpr int block_rows() {
  return std::min(6, 24 / Dims);
}

template <int Dims>
TANDEM_AVX512_BF16 void weighted_values(int rows, const uint32_t* probs, int64_t probs_stride,
                                           const uint16_t* values, int64_t num_pairs, float* out) {
  constexpr int R = block_rows<Dims>();
  static_assert(R >= 1 && R <= 6, "rows a block");
  switch (rows) {
    case 1: weighted_values<Dims, 1>(probs, probs_stride, values, num_pairs, out); break;
    case 2: if constexpr (R >= 2) weighted_values<Dims, 2>(probs, probs_stride, values, num_pairs, out); break;
    case 3: if constexpr (R >= 3) weighted_values<Dims, 3>(probs, probs_stride, values, num_pairs, out); break;
    case 4: if constexpr (R >= 4) weighted_values<Dims, 4>(probs, probs_stride, values, num_pairs, out); break;
    case 5: if constexpr (R >= 5) weighted_values<Dims, 5>(probs, probs_stride, values, num_pairs, out); break;
    default: if constexpr (R >= 6) weighted_values<Dims, 6>(probs, probs_stride, values, num_pairs, out); break;
  }
}

struct Problem {
  const uint16_t* q;
  int64_t q_token_stride, q_head_stride;
  const uint32_t* key_tiles;  // [Hkv][tiles][D/2][16] bf16 pairs
  const uint16_t* value_pairs;  // [Hkv][tiles * 8][D][2] bf16
  uint16_t* out;  // [Tq, Hq, D] contiguous
  int64_t num_queries, seq_len, window, num_heads, group, head_dim, num_tiles;
  float scale;
};

// one KV head's rows [first_row, end_row) (row r: query r / group, head kv_head * group + r % group)
template <int Dims>
TANDEM_AVX512_BF16 void attend_rows(const Problem& pb, int64_t kv_head, int64_t first_row, int64_t end_row) {
  constexpr int64_t D = Dims * 16;
  constexpr int R = block_rows<Dims>();
  const int64_t pairs = D / 2;
  const uint32_t* key_tiles = pb.key_tiles + kv_head * pb.num_tiles * pairs * kTile;
  const uint16_t* value_pairs = pb.value_pairs + kv_head * pb.num_tiles * kTile * D;
  alignas(64) float score[R * kSpan];
  alignas(64) uint16_t prob[R * kSpan];
  alignas(64) float acc[R * D];
  float row_max[R], row_sum[R];
  int64_t lo[R], hi[R];
  const uint16_t* q_rows[6];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r0 = first_row; r0 < end_row; r0 += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, end_row - r0));
    for (int m = 0; m < rows; ++m) {
      const int64_t r = r0 + m, query = r / pb.group, head = kv_head * pb.group + r % pb.group;
      const int64_t pos = pb.seq_len - pb.num_queries + query;
      q_rows[m] = pb.q + query * pb.q_token_stride + head * pb.q_head_stride;
      hi[m] = pos + 1;
      lo[m] = pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1) : 0;
      row_max[m] = neg_inf;
      row_sum[m] = 0.0f;
    }
    std::fill(acc, acc + rows * D, 0.0f);
    // rows are position-major: the first row has the lowest bounds, the last the highest
    const int64_t first_tile = lo[0] / kTile, end_tile = (hi[rows - 1] + kTile - 1) / kTile;
    for (int64_t t0 = first_tile; t0 < end_tile; t0 += kSpanTiles) {
      const int64_t num_tiles = std::min(kSpanTiles, end_tile - t0), width = num_tiles * kTile;
      const int64_t base = t0 * kTile;
      span_scores(rows, q_rows, key_tiles + t0 * pairs * kTile, num_tiles, pairs, pb.scale, score, kSpan);
      for (int m = 0; m < rows; ++m) {
        float* s = score + m * kSpan;
        uint16_t* p = prob + m * kSpan;
        const int64_t begin = std::clamp<int64_t>(lo[m] - base, 0, width);
        const int64_t end = std::clamp<int64_t>(hi[m] - base, 0, width);
        if (begin >= end) {  // none of this span's keys is visible to the row
          std::memset(p, 0, width * sizeof(uint16_t));
          continue;
        }
        std::fill(s, s + begin, neg_inf);
        std::fill(s + end, s + width, neg_inf);
        __m512 vmax = _mm512_set1_ps(neg_inf);
        for (int64_t k = 0; k < width; k += kTile) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + k));
        const float new_max = std::max(row_max[m], _mm512_reduce_max_ps(vmax));
        const float rescale = std::exp(row_max[m] - new_max);  // 0 for the first visible span
        row_max[m] = new_max;
        const __m512 shift = _mm512_set1_ps(new_max);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t k = 0; k < width; k += kTile) {
          const __m512 e = tandem_vec::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + k), shift));
          vsum = _mm512_add_ps(vsum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + k), (__m256i)_mm512_cvtneps_pbh(e));
        }
        row_sum[m] = row_sum[m] * rescale + _mm512_reduce_add_ps(vsum);
        if (rescale != 1.0f) {
          const __m512 f = _mm512_set1_ps(rescale);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(acc + m * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + m * D + d), f));
        }
      }
      weighted_values<Dims>(rows, reinterpret_cast<const uint32_t*>(prob), kSpan / 2, value_pairs + base * D,
                            width / 2, acc);
    }
    for (int m = 0; m < rows; ++m) {
      const int64_t r = r0 + m, query = r / pb.group, head = kv_head * pb.group + r % pb.group;
      uint16_t* o = pb.out + (query * pb.num_heads + head) * D;
      const __m512 inv = _mm512_set1_ps(1.0f / row_sum[m]);
      for (int64_t d = 0; d < D; d += 32) {
        const __m512 lo16 = _mm512_mul_ps(_mm512_loadu_ps(acc + m * D + d), inv);
        const __m512 hi16 = _mm512_mul_ps(_mm512_loadu_ps(acc + m * D + d + 16), inv);
        _mm512_storeu_si512(o + d, (__m512i)_mm512_cvtne2ps_pbh(hi16, lo16));
      }
    }
  }
}

TANDEM_AVX512_BF16 void attend_rows(const Problem& pb, int64_t kv_head, int64_t first_row, int64_t end_row) {
  switch (pb.head_dim) {
    case 32: attend_rows<2>(pb, kv_head, first_row, end_row); break;
    case 64: attend_rows<4>(pb, kv_head, first_row, end_row); break;
    case 128: attend_rows<8>(pb, kv_head, first_row, end_row); break;
    default: attend_rows<16>(pb, kv_head, first_row, end_row); break;
  }
}

int64_t rows_per_block(int64_t head_dim) {
  switch (head_dim) {
    case 32: return block_rows<2>();
    case 64: return block_rows<4>();
    case 128: return block_rows<8>();
    default: return block_rows<16>();
  }
}

struct CacheView {
  const uint16_t* data;
  int64_t block_stride, token_stride, head_stride;
};

// token t's row of one KV head, or null past the sequence
inline const uint16_t* token_row(const CacheView& cache, const int32_t* block_table, int64_t block_size,
                                 int64_t seq_len, int64_t kv_head, int64_t t) {
  if (t >= seq_len) return nullptr;
  return cache.data + block_table[t / block_size] * cache.block_stride + (t % block_size) * cache.token_stride +
         kv_head * cache.head_stride;
}

// tile `tile` of one KV head: its 16 keys as [D/2][16] bf16 pairs, and its 8 value pairs as [D][2]
TANDEM_AVX512_BF16 void pack_tile(const CacheView& keys, const CacheView& values, const int32_t* block_table,
                                     int64_t block_size, int64_t seq_len, int64_t head_dim, int64_t kv_head,
                                     int64_t tile, uint32_t* key_tile, uint16_t* value_tile) {
  const int64_t pairs = head_dim / 2;
  for (int64_t s = 0; s < kTile; ++s) {
    const uint16_t* row = token_row(keys, block_table, block_size, seq_len, kv_head, tile * kTile + s);
    if (row == nullptr) {
      for (int64_t p = 0; p < pairs; ++p) key_tile[p * kTile + s] = 0;
      continue;
    }
    for (int64_t p = 0; p < pairs; ++p) {
      uint32_t pair;
      std::memcpy(&pair, row + 2 * p, sizeof(pair));
      key_tile[p * kTile + s] = pair;
    }
  }
  // (a_0, b_0, a_1, b_1, ...) of two 32-value runs a and b: the low 16 dims, then the high 16
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_loadu_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < kTile / 2; ++j) {
    const int64_t t = tile * kTile + 2 * j;
    const uint16_t* a = token_row(values, block_table, block_size, seq_len, kv_head, t);
    const uint16_t* b = token_row(values, block_table, block_size, seq_len, kv_head, t + 1);
    uint16_t* out = value_tile + j * 2 * head_dim;
    for (int64_t d = 0; d < head_dim; d += 32) {
      const __m512i va = a == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(a + d);
      const __m512i vb = b == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(b + d);
      _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(va, low, vb));
      _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(va, high, vb));
    }
  }
}
#endif

}  // namespace prefill_attention_kernel

// q [Tq, Hq, D] bf16: the last Tq of seq_len positions; k_cache, v_cache [num_blocks, block_size, Hkv, D] bf16 views
// (D contiguous); block_table [>= ceil(seq_len / block_size)] int32; window > 0: key k visible to position p iff
// p - k < window. Returns softmax(scale q K^T, causal) V as [Tq, Hq, D] bf16, computed in float32.
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                   int64_t seq_len, double scale, int64_t window) {
#ifdef TANDEM_AVX512_BF16
  namespace pa = prefill_attention_kernel;
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q: [Tq, Hq, D] bf16");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "k_cache, v_cache: [num_blocks, block_size, Hkv, D] bf16, D contiguous");
  const int64_t num_queries = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256, "head_dim: 32, 64, 128 or 256");
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "q and the cache: heads and head_dim");
  TORCH_CHECK(num_queries <= seq_len, "q: the last positions of seq_len");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
              block_table.size(0) * block_size >= seq_len, "block_table: int32, covering seq_len");
  auto out = at::empty({num_queries, num_heads, head_dim}, q.options());
  if (num_queries == 0) return out;
  const int64_t num_tiles = (seq_len + pa::kTile - 1) / pa::kTile;
  auto key_tiles = at::empty({num_kv_heads, num_tiles, head_dim / 2, pa::kTile}, q.options().dtype(at::kInt));
  auto value_pairs = at::empty({num_kv_heads, num_tiles * pa::kTile, head_dim}, q.options());
  auto* kt = reinterpret_cast<uint32_t*>(key_tiles.data_ptr<int32_t>());
  auto* vp = reinterpret_cast<uint16_t*>(value_pairs.data_ptr<at::BFloat16>());
  const pa::CacheView keys{reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()), k_cache.stride(0),
                           k_cache.stride(1), k_cache.stride(2)};
  const pa::CacheView values{reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), v_cache.stride(0),
                             v_cache.stride(1), v_cache.stride(2)};
  const int32_t* table = block_table.data_ptr<int32_t>();
  const pa::Problem problem{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0), q.stride(1),
                            kt, vp, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), num_queries, seq_len,
                            window, num_heads, num_heads / num_kv_heads, head_dim, num_tiles,
                            static_cast<float>(scale)};
  // one parallel region (a second one cost ~10-30 us a call): the threads first pack the context, runs of tiles
  // taken off a counter, wait until every run is packed, then take the work units: (KV head, run of row blocks),
  // the latest rows (the most keys) first. A thread waits only on runs another has taken, so fewer threads than
  // asked for (a nested region runs inline) still finish.
  const int64_t pack_runs_per_head = (num_tiles + pa::kPackTiles - 1) / pa::kPackTiles;
  const int64_t num_pack_runs = num_kv_heads * pack_runs_per_head;
  const int64_t num_rows = num_queries * problem.group;
  const int64_t unit_rows = pa::kBlocksPerUnit * pa::rows_per_block(head_dim);
  const int64_t runs = (num_rows + unit_rows - 1) / unit_rows, num_units = runs * num_kv_heads;
  std::atomic<int64_t> next_pack{0}, packed{0}, next_unit{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t run = next_pack++; run < num_pack_runs; run = next_pack++) {
      const int64_t head = run / pack_runs_per_head, first = run % pack_runs_per_head * pa::kPackTiles;
      for (int64_t tile = first; tile < std::min(num_tiles, first + pa::kPackTiles); ++tile)
        pa::pack_tile(keys, values, table, block_size, seq_len, head_dim, head, tile,
                      kt + (head * num_tiles + tile) * (head_dim / 2) * pa::kTile,
                      vp + (head * num_tiles + tile) * pa::kTile * head_dim);
      packed.fetch_add(1, std::memory_order_release);
    }
    while (packed.load(std::memory_order_acquire) < num_pack_runs) _mm_pause();
    for (int64_t unit = next_unit++; unit < num_units; unit = next_unit++) {
      const int64_t run = runs - 1 - unit / num_kv_heads, head = unit % num_kv_heads;
      pa::attend_rows(problem, head, run * unit_rows, std::min(num_rows, (run + 1) * unit_rows));
    }
  });
  return out;
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 kernel");
#endif
}
