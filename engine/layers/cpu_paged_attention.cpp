// Decode attention on the CPU over the paged K/V cache, read in place (engine/layers/cpu_paged_attention.py).
// One query token per sequence; each (sequence, KV head) is one unit of work: the query heads sharing that KV
// head score every key of the sequence's window, take a softmax in float32, and sum the values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

inline float widen(at::BFloat16 x) {  // a bf16 is the top half of a float32
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// n values widened to float32; bf16 eight at a time with AVX2
inline void widen_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void widen_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; d + 8 <= n; d += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
  }
#endif
  for (; d < n; ++d) dst[d] = widen(src[d]);
}

// Four keys' dot products with one query at once. With AVX2: four 8-wide accumulators, which hide the latency of
// each other's multiply-adds; else eight partial sums each, a loop the compiler may vectorize.
inline void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t n,
                 float* out) {
  int64_t d = 0;
  float a[4][8] = {};
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
    s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + d), s0);
    s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + d), s1);
    s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + d), s2);
    s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + d), s3);
  }
  _mm256_storeu_ps(a[0], s0);
  _mm256_storeu_ps(a[1], s1);
  _mm256_storeu_ps(a[2], s2);
  _mm256_storeu_ps(a[3], s3);
#else
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) {
      a[0][j] += q[d + j] * k0[d + j];
      a[1][j] += q[d + j] * k1[d + j];
      a[2][j] += q[d + j] * k2[d + j];
      a[3][j] += q[d + j] * k3[d + j];
    }
#endif
  const float* keys[4] = {k0, k1, k2, k3};
  for (int i = 0; i < 4; ++i) {
    float total = ((a[i][0] + a[i][1]) + (a[i][2] + a[i][3])) + ((a[i][4] + a[i][5]) + (a[i][6] + a[i][7]));
    for (int64_t e = d; e < n; ++e) total += q[e] * keys[i][e];
    out[i] = total;
  }
}

// s[i] = exp(s[i] - top) for i < n; returns their sum. Eight at a time with AVX2 (Cephes' single-precision
// polynomial, within 2 ulp of expf): a scalar expf per score was half of a batch-64 decode step.
inline float exp_shifted(float* s, int64_t n, float top) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(top), low = _mm256_set1_ps(-87.0f), high = _mm256_set1_ps(88.0f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + i), shift);
    x = _mm256_min_ps(_mm256_max_ps(x, low), high);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, ln2_hi, x);
    r = _mm256_fnmadd_ps(k, ln2_lo, r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
    _mm256_storeu_ps(s + i, y);
    sum = _mm256_add_ps(sum, y);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - top);
    total += s[i];
  }
  return total;
}

// Element strides of a cache [blocks, block_size, Hkv, D] whose D is contiguous: the engine's pool lays the
// heads outermost within a block, so a block's tokens of one head and layer lie together.
struct Strides {
  int64_t block, token, head;
};

template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, Strides ks, Strides vs, const int32_t* block_tables,
            const int32_t* seq_lens, float* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t table_width, float scale, int64_t window) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, sums, rows(4 * head_dim);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / num_kv_heads, h = unit % num_kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t first = (window > 0 && len > window) ? len - window : 0;
      const int64_t span = len - first;
      float* result = out + (b * num_heads + h * group) * head_dim;
      if (span <= 0) {  // no context: nothing to attend (a decode row always has its own token)
        std::fill(result, result + group * head_dim, 0.0f);
        continue;
      }
      scores.assign(group * span, 0.0f);
      sums.assign(group * head_dim, 0.0f);
      const float* queries = q + (b * num_heads + h * group) * head_dim;
      const int32_t* table = block_tables + b * table_width;
      // Walks the window block by block, four tokens at a time: widens their keys (or values) into float32 rows
      // (past a block's last token a row repeats it; fn gets how many are real) and calls fn(t, count). A block
      // holds its tokens of one head and layer together, and the sequence's next block lies anywhere in the pool:
      // it is fetched while this one is computed, else every block starts with a wait on memory.
      auto each_four = [&](const T* cache, const Strides& st, auto&& fn) {
        for (int64_t block = first / block_size; block * block_size < len; ++block) {
          const int64_t lo = std::max(first, block * block_size), hi = std::min(len, (block + 1) * block_size);
          const T* base = cache + table[block] * st.block + h * st.head - block * block_size * st.token;
          if (hi < len) {
            const char* next = reinterpret_cast<const char*>(cache + table[block + 1] * st.block + h * st.head);
            const int64_t bytes = std::min(block_size, len - hi) * st.token * static_cast<int64_t>(sizeof(T));
            for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(next + offset);
          }
          for (int64_t t = lo; t < hi; t += 4) {
            const int64_t count = std::min<int64_t>(4, hi - t);
            for (int64_t i = 0; i < 4; ++i)
              widen_row(base + (t + std::min(i, count - 1)) * st.token, rows.data() + i * head_dim, head_dim);
            fn(t, count);
          }
        }
      };
      const float* r = rows.data();
      each_four(k_cache, ks, [&](int64_t t, int64_t count) {
        for (int64_t g = 0; g < group; ++g) {
          float four[4];
          dot4(queries + g * head_dim, r, r + head_dim, r + 2 * head_dim, r + 3 * head_dim, head_dim, four);
          for (int64_t i = 0; i < count; ++i) scores[g * span + (t - first) + i] = four[i] * scale;
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * span;
        const float inverse = 1.0f / exp_shifted(s, span, *std::max_element(s, s + span));
        for (int64_t i = 0; i < span; ++i) s[i] *= inverse;
      }
      each_four(v_cache, vs, [&](int64_t t, int64_t count) {
        for (int64_t g = 0; g < group; ++g) {
          const float* p = scores.data() + g * span + (t - first);
          const float p0 = p[0], p1 = count > 1 ? p[1] : 0.0f, p2 = count > 2 ? p[2] : 0.0f,
                      p3 = count > 3 ? p[3] : 0.0f;
          float* sum = sums.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d)
            sum[d] += (p0 * r[d] + p1 * r[head_dim + d]) + (p2 * r[2 * head_dim + d] + p3 * r[3 * head_dim + d]);
        }
      });
      std::memcpy(result, sums.data(), sizeof(float) * group * head_dim);
    }
  });
}

}  // namespace

// q [B, Hq, D] float32; caches [blocks, block_size, Hkv, D] float32 or bfloat16, D contiguous; block_tables [B, W] and
// seq_lens [B] int32; window 0 = none. Returns [B, Hq, D] float32.
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
    const Strides ks{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
    const Strides vs{v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
    attend(q.data_ptr<float>(), k, v, ks, vs, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(),
           batch, num_heads, num_kv_heads, head_dim, block_size, tables.size(1), static_cast<float>(scale), window);
  };
  if (k_cache.scalar_type() == at::kBFloat16) {
    run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "caches: float32 or bfloat16");
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  return out;
}
