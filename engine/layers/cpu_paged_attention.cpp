// Decode attention on the CPU over the paged K/V cache, read in place (engine/layers/cpu_paged_attention.py).
// One query token per sequence; each (sequence, KV head) is one unit of work: the query heads sharing that KV
// head score every key of the sequence's window, take a softmax in float32, and sum the values.
//
// The window is walked block by block, once, with an online softmax (each block's keys and then its values, which
// the engine's pool keeps next to each other: one run of memory a block, head and layer). A 16-bit block is widened
// to float32 once, in L1, and then every query head of the group reads it: its scores four keys at a time (four
// accumulators summed across lanes by horizontal adds), its value sums held in registers across the block's tokens.
// A bf16 cache of head size 64 or 128 on a CPU with AVX512-BF16 takes attend_bf16 instead: the keys' products are
// VDPBF16PS on the cache's own values, and blocks are fetched two ahead (SmolLM2 at batch 8: 1.75x the AVX2 walk).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace paged_attention {

using namespace tandem_vec;

// Element strides of a cache [blocks, block_size, Hkv, D] whose D is contiguous.
struct Strides {
  int64_t block, token, head;
};

// `count` rows of a block (`token_stride` apart) as float32: a float32 cache's own rows, else widened into `scratch`.
// Returns the first row; *stride says how far apart the rows lie.
template <typename T>
inline const float* float_rows(const T* rows, int64_t token_stride, int64_t count, int64_t head_dim, float* scratch,
                               int64_t* stride) {
  if constexpr (std::is_same_v<T, float>) {
    *stride = token_stride;
    return rows;
  } else {
    for (int64_t i = 0; i < count; ++i) {
      const T* src = rows + i * token_stride;
      float* dst = scratch + i * head_dim;
      int64_t d = 0;
#ifdef TANDEM_AVX2
      for (; d + 8 <= head_dim; d += 8) _mm256_storeu_ps(dst + d, load(src + d));
#endif
      for (; d < head_dim; ++d) dst[d] = up(src[d]);
    }
    *stride = head_dim;
    return scratch;
  }
}

// scores[i] = q . rows[i] * scale for the count (<= 4) rows at `rows`, `stride` apart
inline void score_four(const float* q, const float* rows, int64_t stride, int64_t count, int64_t head_dim,
                       float scale, float* scores) {
  const float* r[4];
  for (int64_t i = 0; i < 4; ++i) r[i] = rows + std::min(i, count - 1) * stride;  // past the last, repeat it
  float out[4];
  int64_t d = 0;
#ifdef TANDEM_AVX2
  V a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; d + 8 <= head_dim; d += 8) {
    const V x = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r[0] + d), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r[1] + d), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r[2] + d), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(r[3] + d), a3);
  }
  // [a0, a1, a2, a3] each summed over its lanes, in one vector
  const V pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
#else
  std::fill(out, out + 4, 0.0f);
#endif
  for (int64_t i = 0; i < count; ++i) {
    float total = out[i];
    for (int64_t e = d; e < head_dim; ++e) total += q[e] * r[i][e];
    scores[i] = total * scale;
  }
}

// sums[d] = alpha * sums[d] + sum over the block's count rows of p[i] * rows[i][d], the sums held in registers 64
// values at a time
inline void add_weighted_rows(float alpha, const float* p, const float* rows, int64_t stride, int64_t count,
                              int64_t head_dim, float* sums) {
  int64_t d = 0;
#ifdef TANDEM_AVX2
  const V rescale = _mm256_set1_ps(alpha);
  for (; d + 64 <= head_dim; d += 64) {
    V acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(_mm256_loadu_ps(sums + d + 8 * j), rescale);
    for (int64_t i = 0; i < count; ++i) {
      const V weight = _mm256_set1_ps(p[i]);
      const float* row = rows + i * stride + d;
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(row + 8 * j), acc[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(sums + d + 8 * j, acc[j]);
  }
  for (; d + 8 <= head_dim; d += 8) {
    V acc = _mm256_mul_ps(_mm256_loadu_ps(sums + d), rescale);
    for (int64_t i = 0; i < count; ++i) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(rows + i * stride + d), acc);
    _mm256_storeu_ps(sums + d, acc);
  }
#endif
  for (; d < head_dim; ++d) {
    sums[d] *= alpha;
    for (int64_t i = 0; i < count; ++i) sums[d] += p[i] * rows[i * stride + d];
  }
}

// s[i] = exp(s[i] - top) for i < n; returns their sum
inline float exp_shifted(float* s, int64_t n, float top) {
  int64_t i = 0;
  float total = 0.0f;
#ifdef TANDEM_AVX2
  const V shift = _mm256_set1_ps(top);
  V sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const V y = tandem_vec::exp(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
    _mm256_storeu_ps(s + i, y);
    sum = _mm256_add_ps(sum, y);
  }
  total = tandem_vec::sum(sum);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - top);
    total += s[i];
  }
  return total;
}

// One block of an online softmax: s[0..count) become exp(s - the new running max), `top` (the running max) and
// `total` (the running sum of exp) move to it; returns the factor the value sums so far are to be rescaled by.
inline float softmax_step(float* s, int64_t count, float& top, float& total) {
  const float new_top = std::max(top, *std::max_element(s, s + count));
  const float alpha = std::exp(top - new_top);
  top = new_top;
  total = total * alpha + exp_shifted(s, count, new_top);
  return alpha;
}

// Asks for one block's rows of a head (count tokens, token_stride elements apart, head_dim values each) ahead of
// their use: a sequence's blocks lie anywhere in the pool, so without it every block starts with a wait on memory.
// Locality as __builtin_prefetch's (3: into L1, 2: into L2).
template <int Locality, typename T>
inline void fetch_rows(const T* first_row, int64_t count, int64_t token_stride, int64_t head_dim) {
  const char* start = reinterpret_cast<const char*>(first_row);
  const int64_t bytes = ((count - 1) * token_stride + head_dim) * static_cast<int64_t>(sizeof(T));
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset, 0, Locality);
}

template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, Strides ks, Strides vs, const int32_t* block_tables,
            const int32_t* seq_lens, float* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t table_width, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // per query head of the group: its scores of one block, the running max and sum of exp, the value sums
    std::vector<float> scores(group * block_size), top(group), total(group), sums(group * head_dim);
    std::vector<float> keys(block_size * head_dim), values(block_size * head_dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / num_kv_heads, h = unit % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t first = (window > 0 && len > window) ? len - window : 0;
      float* result = out + (b * num_heads + h * group) * head_dim;
      if (len - first <= 0) {  // no context: nothing to attend (a decode row always has its own token)
        std::fill(result, result + group * head_dim, 0.0f);
        continue;
      }
      std::fill(top.begin(), top.end(), -INFINITY);
      std::fill(total.begin(), total.end(), 0.0f);
      std::fill(sums.begin(), sums.end(), 0.0f);
      const float* queries = q + (b * num_heads + h * group) * head_dim;
      const int32_t* table = block_tables + b * table_width;
      // the window's tokens [lo, hi) of one block: where they start in a cache
      auto rows_of = [&](const T* cache, const Strides& st, int64_t block, int64_t lo) {
        return cache + table[block] * st.block + h * st.head + (lo - block * block_size) * st.token;
      };
      const int64_t last_block = (len - 1) / block_size;
      for (int64_t block = first / block_size; block <= last_block; ++block) {
        const int64_t lo = std::max(first, block * block_size), hi = std::min(len, (block + 1) * block_size);
        const int64_t count = hi - lo;
        if (block < last_block) {  // the next block, fetched while this one is computed
          const int64_t next = block + 1, next_count = std::min(len, (next + 1) * block_size) - next * block_size;
          fetch_rows<3>(rows_of(k_cache, ks, next, next * block_size), next_count, ks.token, head_dim);
          fetch_rows<3>(rows_of(v_cache, vs, next, next * block_size), next_count, vs.token, head_dim);
        }
        int64_t k_stride = 0, v_stride = 0;
        const float* k_rows = float_rows(rows_of(k_cache, ks, block, lo), ks.token, count, head_dim, keys.data(), &k_stride);
        const float* v_rows = float_rows(rows_of(v_cache, vs, block, lo), vs.token, count, head_dim, values.data(), &v_stride);
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * block_size;
          for (int64_t i = 0; i < count; i += 4)
            score_four(queries + g * head_dim, k_rows + i * k_stride, k_stride, std::min<int64_t>(4, count - i),
                       head_dim, scale, s + i);
          const float alpha = softmax_step(s, count, top[g], total[g]);
          add_weighted_rows(alpha, s, v_rows, v_stride, count, head_dim, sums.data() + g * head_dim);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inverse = 1.0f / total[g];
        for (int64_t d = 0; d < head_dim; ++d) result[g * head_dim + d] = sums[g * head_dim + d] * inverse;
      }
    }
  });
}

#ifdef TANDEM_AVX512_BF16

// The same walk for a bf16 cache on CPUs with AVX512-BF16, for head sizes D = 16 * C with C even: a key's scores
// take D / 32 VDPBF16PS per query head straight from the cache's bf16 values (the query rounded to bf16 is the
// query itself: it came from bf16), four keys' lanes summed at once; the value sums are float32 FMAs sixteen wide,
// held in registers across a block. The query heads of a group go through a block S at a time: each key and value
// row is loaded (and a value widened) once for the S heads, not once per head (SmolLM2's S = 3: a block takes about
// two thirds of the instructions of one head at a time).
// Blocks are fetched two ahead into L2: fetching the next one into L1, as the AVX2 walk does, left most of each
// block's wait on memory (SmolLM2 at batch 64: 1157 -> 966 us a layer).
constexpr int64_t kFetchAhead = 2;
// units [begin, end) of one thread (a lambda does not take the function's target, so the work is its own function);
// S query heads at a time, S dividing the group and S * C <= 16 (the value sums of S heads stay in registers)
template <int C, int S>
TANDEM_AVX512_BF16 void attend_bf16_units(int64_t begin, int64_t end, const float* q, const uint16_t* keys_base,
                                          const uint16_t* values_base, Strides ks, Strides vs,
                                          const int32_t* block_tables, const int32_t* seq_lens, float* out,
                                          int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                                          int64_t table_width, float scale, int64_t window) {
  constexpr int64_t D = 16 * C;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t padded = (block_size + 3) / 4 * 4;  // scores are stored four at a time
  std::vector<float> scores(S * padded), top(group), total(group), sums(group * D);
  std::vector<uint16_t> query(group * D);
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t b = unit / num_kv_heads, h = unit % num_kv_heads;
    const int64_t len = seq_lens[b];
    const int64_t first = (window > 0 && len > window) ? len - window : 0;
    float* result = out + (b * num_heads + h * group) * D;
    if (len - first <= 0) {
      std::fill(result, result + group * D, 0.0f);
      continue;
    }
    const float* queries = q + (b * num_heads + h * group) * D;
    for (int64_t i = 0; i < group * D; i += 32) {
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(queries + i + 16), _mm512_loadu_ps(queries + i));
      _mm512_storeu_si512(query.data() + i, (__m512i)pair);
    }
    std::fill(top.begin(), top.end(), -INFINITY);
    std::fill(total.begin(), total.end(), 0.0f);
    std::fill(sums.begin(), sums.end(), 0.0f);
    const int32_t* table = block_tables + b * table_width;
    const int64_t last_block = (len - 1) / block_size;
    for (int64_t block = first / block_size; block <= last_block; ++block) {
      const int64_t lo = std::max(first, block * block_size), hi = std::min(len, (block + 1) * block_size);
      const int64_t count = hi - lo, offset = lo - block * block_size;
      if (block + kFetchAhead <= last_block) {  // a block ahead, fetched while this one is computed
        const int64_t next = block + kFetchAhead;
        const int64_t next_count = std::min(len, (next + 1) * block_size) - next * block_size;
        fetch_rows<2>(keys_base + table[next] * ks.block + h * ks.head, next_count, ks.token, D);
        fetch_rows<2>(values_base + table[next] * vs.block + h * vs.head, next_count, vs.token, D);
      }
      const uint16_t* key_rows = keys_base + table[block] * ks.block + h * ks.head + offset * ks.token;
      const uint16_t* value_rows = values_base + table[block] * vs.block + h * vs.head + offset * vs.token;
      for (int64_t g0 = 0; g0 < group; g0 += S) {
        __m512bh qv[S][C / 2];
#pragma GCC unroll 4
        for (int g = 0; g < S; ++g)
#pragma GCC unroll 8
          for (int c = 0; c < C / 2; ++c)
            qv[g][c] = (__m512bh)_mm512_loadu_si512(query.data() + (g0 + g) * D + 32 * c);
        for (int64_t i = 0; i < count; i += 4) {
          __m512 a[S][4];
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const uint16_t* row = key_rows + std::min<int64_t>(i + j, count - 1) * ks.token;
#pragma GCC unroll 4
            for (int g = 0; g < S; ++g) a[g][j] = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int c = 0; c < C / 2; ++c) {
              const __m512bh key = (__m512bh)_mm512_loadu_si512(row + 32 * c);
#pragma GCC unroll 4
              for (int g = 0; g < S; ++g) a[g][j] = _mm512_dpbf16_ps(a[g][j], key, qv[g][c]);
            }
          }
#pragma GCC unroll 4
          for (int g = 0; g < S; ++g) {
            // each key's 16 lanes to 8, then the four keys' sums in one 128-bit vector
            __m256 half[4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j)
              half[j] = _mm256_add_ps(_mm512_castps512_ps256(a[g][j]), _mm512_extractf32x8_ps(a[g][j], 1));
            const __m256 pairs =
                _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
            _mm_storeu_ps(scores.data() + g * padded + i,
                          _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)),
                                     _mm_set1_ps(scale)));
          }
        }
        __m512 acc[S][C];
#pragma GCC unroll 4
        for (int g = 0; g < S; ++g) {
          const __m512 rescale =
              _mm512_set1_ps(softmax_step(scores.data() + g * padded, count, top[g0 + g], total[g0 + g]));
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c)
            acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(sums.data() + (g0 + g) * D + 16 * c), rescale);
        }
        for (int64_t i = 0; i < count; ++i) {
          const uint16_t* row = value_rows + i * vs.token;
          __m512 p[S];
#pragma GCC unroll 4
          for (int g = 0; g < S; ++g) p[g] = _mm512_set1_ps(scores[g * padded + i]);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) {
            const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c));
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#pragma GCC unroll 4
            for (int g = 0; g < S; ++g) acc[g][c] = _mm512_fmadd_ps(p[g], v, acc[g][c]);
          }
        }
#pragma GCC unroll 4
        for (int g = 0; g < S; ++g)
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(sums.data() + (g0 + g) * D + 16 * c, acc[g][c]);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float inverse = 1.0f / total[g];
      for (int64_t d = 0; d < D; ++d) result[g * D + d] = sums[g * D + d] * inverse;
    }
  }
}

template <int C, int S>
void attend_bf16(const float* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache, Strides ks, Strides vs,
                 const int32_t* block_tables, const int32_t* seq_lens, float* out, int64_t batch, int64_t num_heads,
                 int64_t num_kv_heads, int64_t block_size, int64_t table_width, float scale, int64_t window) {
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    attend_bf16_units<C, S>(begin, end, q, reinterpret_cast<const uint16_t*>(k_cache),
                            reinterpret_cast<const uint16_t*>(v_cache), ks, vs, block_tables, seq_lens, out,
                            num_heads, num_kv_heads, block_size, table_width, scale, window);
  });
}

using AttendBf16 = void (*)(const float*, const at::BFloat16*, const at::BFloat16*, Strides, Strides, const int32_t*,
                            const int32_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t);

// The walk for head size 16 * C and a group of `group` query heads: the most heads at a time that divide the group
// and keep S * C <= 16 (up to 4 for C = 4, up to 2 for C = 8)
template <int C>
AttendBf16 attend_bf16_for(int64_t group) {
  if constexpr (C * 4 <= 16) {
    if (group % 4 == 0) return attend_bf16<C, 4>;
  }
  if constexpr (C * 3 <= 16) {
    if (group % 3 == 0) return attend_bf16<C, 3>;
  }
  if (group % 2 == 0) return attend_bf16<C, 2>;
  return attend_bf16<C, 1>;
}
#endif

}  // namespace paged_attention

// q [B, Hq, D] float32; caches [blocks, block_size, Hkv, D] float32, bfloat16 or float16, D contiguous; block_tables
// [B, W] and seq_lens [B] int32; window 0 = none. Returns [B, Hq, D] float32.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches: [blocks, block_size, Hkv, D] with D contiguous, K and V alike");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens: int32");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head counts or sizes do not match");
  TORCH_CHECK(block_tables.size(0) == batch && seq_lens.size(0) == batch, "one table and length per sequence");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  const auto run = [&](auto* k, auto* v) {
    const paged_attention::Strides ks{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
    const paged_attention::Strides vs{v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
    paged_attention::attend(q.data_ptr<float>(), k, v, ks, vs, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                            out.data_ptr<float>(), batch, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
                            static_cast<float>(scale), window);
  };
#ifdef TANDEM_AVX512_BF16
  if (k_cache.scalar_type() == at::kBFloat16 && (head_dim == 64 || head_dim == 128) &&
      tandem_vec::has_bf16_dot()) {
    const paged_attention::Strides ks{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
    const paged_attention::Strides vs{v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
    const int64_t group = num_heads / num_kv_heads;
    auto fn = head_dim == 64 ? paged_attention::attend_bf16_for<4>(group) : paged_attention::attend_bf16_for<8>(group);
    fn(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), ks, vs,
       tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(), batch, num_heads, num_kv_heads,
       block_size, tables.size(1), static_cast<float>(scale), window);
    return out;
  }
#endif
  switch (k_cache.scalar_type()) {
    case at::kBFloat16: run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>()); break;
    case at::kFloat: run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>()); break;
    default: TORCH_CHECK(false, "caches: float32, bfloat16 or float16");
  }
  return out;
}
