// Decode attention on the CPU over the paged K/V cache, read in place (engine/layers/cpu_paged_attention.py).
// One query token per sequence; each (sequence, KV head) is one unit of work: the query heads sharing that KV
// head score every key of the sequence's window, take a softmax in float32, and sum the values.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float widen(float x) { return x; }

inline float widen(at::BFloat16 x) {  // a bf16 is the top half of a float32
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// eight independent partial sums: a loop the compiler vectorizes without reordering any one sum
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += a[d + j] * b[d + j];
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; d < n; ++d) total += a[d] * b[d];
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
    std::vector<float> scores, sums, row(head_dim);
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
      auto at = [&](const T* cache, const Strides& st, int64_t t) {
        return cache + table[t / block_size] * st.block + (t % block_size) * st.token + h * st.head;
      };
      for (int64_t t = first; t < len; ++t) {
        const T* key = at(k_cache, ks, t);
        for (int64_t d = 0; d < head_dim; ++d) row[d] = widen(key[d]);
        for (int64_t g = 0; g < group; ++g)
          scores[g * span + (t - first)] = dot(queries + g * head_dim, row.data(), head_dim) * scale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * span;
        const float top = *std::max_element(s, s + span);
        float total = 0.0f;
        for (int64_t i = 0; i < span; ++i) {
          s[i] = std::exp(s[i] - top);
          total += s[i];
        }
        const float inverse = 1.0f / total;
        for (int64_t i = 0; i < span; ++i) s[i] *= inverse;
      }
      for (int64_t t = first; t < len; ++t) {
        const T* value = at(v_cache, vs, t);
        for (int64_t d = 0; d < head_dim; ++d) row[d] = widen(value[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * span + (t - first)];
          float* sum = sums.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) sum[d] += p * row[d];
        }
      }
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
