// A decoder layer's small ops on the CPU, one pass each (engine/layers/cpu_kernels.py): RMSNorm with the residual
// add, RoPE with the K/V store, SiLU-and-mul. Each rounds where torch's eager ops round (engine/layers/basic.py), so
// a 16-bit model computes what transformers computes, op by op: built with -ffp-contract=off, a * b - c * d stays
// two rounded products and a difference, as in torch. RoPE, the store and the residual add are bit-equal to torch;
// RMSNorm's float32 sum of squares and SiLU's exp are not computed in torch's order, so a value on a rounding
// boundary can come out one rounding apart (tests/unit/test_cpu_layer_ops.py). Eight values at a time with AVX2
// (cpu_vec.h), with scalar tails that compute the same.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace layer_ops {

using namespace tandem_vec;

// about this many elements per thread before a second thread pays for waking it
constexpr int64_t kGrainElements = 32768;

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// summed = x + residual (where a residual is given); out = weight * T(rms_norm(float32(summed))), torch's
// RMSNorm.forward: a float32 mean of squares (here eight lane sums, summed pairwise), one over its square root
template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* residual, int64_t residual_stride, const T* weight, T* out,
              T* summed, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* in = x + r * x_stride;
      const T* res = residual == nullptr ? nullptr : residual + r * residual_stride;
      T* sum_out = summed == nullptr ? nullptr : summed + r * hidden;
      float lanes[8] = {};
      int64_t d = 0;
#ifdef TANDEM_AVX2
      V squares = _mm256_setzero_ps();
      for (; d + 8 <= hidden; d += 8) {
        V value = load(in + d);
        if (res != nullptr) {
          value = round_to<T>(_mm256_add_ps(value, load(res + d)));
          store(sum_out + d, value);
        }
        _mm256_storeu_ps(row.data() + d, value);
        squares = _mm256_add_ps(squares, _mm256_mul_ps(value, value));
      }
      _mm256_storeu_ps(lanes, squares);
#endif
      for (; d < hidden; ++d) {
        float value = up(in[d]);
        if (res != nullptr) {
          value = tandem_vec::round_to<T>(value + up(res[d]));
          sum_out[d] = down<T>(value);
        }
        row[d] = value;
        lanes[d % 8] += value * value;
      }
      const float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      const float inverse = 1.0f / std::sqrt(total / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      d = 0;
#ifdef TANDEM_AVX2
      const V scale = _mm256_set1_ps(inverse);
      for (; d + 8 <= hidden; d += 8)
        store(o + d, _mm256_mul_ps(load(weight + d), round_to<T>(_mm256_mul_ps(_mm256_loadu_ps(row.data() + d), scale))));
#endif
      for (; d < hidden; ++d) o[d] = down<T>(up(weight[d]) * tandem_vec::round_to<T>(row[d] * inverse));
    }
  });
}

// One head's row rotated in place (neox style: its two halves); the float32 cos/sin table is cast to T first, as
// torch casts it to the activations' type
template <typename T>
inline void rotate(T* row, const float* cos_sin, int64_t half) {
  int64_t i = 0;
#ifdef TANDEM_AVX2
  for (; i + 8 <= half; i += 8) {
    const V c = round_to<T>(_mm256_loadu_ps(cos_sin + i)), s = round_to<T>(_mm256_loadu_ps(cos_sin + half + i));
    const V x1 = load(row + i), x2 = load(row + half + i);
    store(row + i, _mm256_sub_ps(round_to<T>(_mm256_mul_ps(x1, c)), round_to<T>(_mm256_mul_ps(x2, s))));
    store(row + half + i, _mm256_add_ps(round_to<T>(_mm256_mul_ps(x2, c)), round_to<T>(_mm256_mul_ps(x1, s))));
  }
#endif
  for (; i < half; ++i) {
    const float c = tandem_vec::round_to<T>(cos_sin[i]), s = tandem_vec::round_to<T>(cos_sin[half + i]);
    const float x1 = up(row[i]), x2 = up(row[half + i]);
    row[i] = down<T>(tandem_vec::round_to<T>(x1 * c) - tandem_vec::round_to<T>(x2 * s));
    row[half + i] = down<T>(tandem_vec::round_to<T>(x2 * c) + tandem_vec::round_to<T>(x1 * s));
  }
}

struct Rows {  // a [T, H, D] view whose D is contiguous
  int64_t token, head, heads;
};

// Rotates q and k in place, then (given the caches) stores k and v at their slots.
template <typename T>
void rotary_and_store_kv(const int64_t* positions, T* q, Rows qs, T* k, Rows ks, const T* v, Rows vs,
                         const float* cos_sin, int64_t cos_sin_stride, int64_t num_positions, T* k_cache, T* v_cache,
                         const int64_t* cache_strides, const int64_t* slots, int64_t num_slots, int64_t tokens,
                         int64_t head_dim, int64_t block_size) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, grain_rows((qs.heads + 2 * ks.heads) * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(positions[t] >= 0 && positions[t] < num_positions, "position ", positions[t],
                  " is outside the rotary table");
      TORCH_CHECK(k_cache == nullptr || (slots[t] >= 0 && slots[t] < num_slots), "slot ", slots[t],
                  " is outside the cache");
      const float* table = cos_sin + positions[t] * cos_sin_stride;
      for (int64_t h = 0; h < qs.heads; ++h) rotate(q + t * qs.token + h * qs.head, table, half);
      if (k_cache == nullptr) {
        for (int64_t h = 0; h < ks.heads; ++h) rotate(k + t * ks.token + h * ks.head, table, half);
        continue;
      }
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      T* k_slot = k_cache + block * cache_strides[0] + offset * cache_strides[1];
      T* v_slot = v_cache + block * cache_strides[3] + offset * cache_strides[4];
      for (int64_t h = 0; h < ks.heads; ++h) {
        T* key = k + t * ks.token + h * ks.head;
        rotate(key, table, half);
        std::copy(key, key + head_dim, k_slot + h * cache_strides[2]);
        const T* value = v + t * vs.token + h * vs.head;
        std::copy(value, value + head_dim, v_slot + h * cache_strides[5]);
      }
    }
  });
}

// out = T(silu(gate)) * up: torch's silu is x / (1 + exp(-x)) in float32 (its exp within 1 ulp, this one within 2:
// a 16-bit result can differ in its last bit where the float32 value lies on a rounding boundary)
template <typename T>
void silu_and_mul(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * stride;
      const T* lin = gate + width;
      T* o = out + r * width;
      int64_t i = 0;
#ifdef TANDEM_AVX2
      const V one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= width; i += 8) {
        const V g = load(gate + i);
        const V silu = _mm256_div_ps(g, _mm256_add_ps(one, tandem_vec::exp(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        store(o + i, _mm256_mul_ps(round_to<T>(silu), load(lin + i)));
      }
#endif
      for (; i < width; ++i) {
        const float g = up(gate[i]);
        o[i] = down<T>(tandem_vec::round_to<T>(g / (1.0f + std::exp(-g))) * up(lin[i]));
      }
    }
  });
}

template <typename F>
void dispatch(at::ScalarType type, F&& fn) {
  switch (type) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    case at::kHalf: fn(at::Half{}); break;
    default: TORCH_CHECK(false, "the CPU layer ops take float32, bfloat16 or float16, not ", type);
  }
}

inline Rows rows_of(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, name, ": [T, H, D] with D contiguous");
  return Rows{x.stride(0), x.stride(1), x.size(1)};
}

}  // namespace layer_ops

// x, residual: [T, H] with H contiguous; weight [H]; all of one dtype. Returns (out, summed): summed = x + residual,
// or x itself without a residual.
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: [T, H] with H contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight: [H] of x's dtype");
  auto w = weight.contiguous();
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor summed = x;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "residual: x's shape and dtype, H contiguous");
    summed = at::empty_like(out);
  }
  layer_ops::dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* res = residual.has_value() ? residual->data_ptr<T>() : nullptr;
    layer_ops::rms_norm(x.data_ptr<T>(), x.stride(0), res, residual.has_value() ? residual->stride(0) : 0,
                        w.data_ptr<T>(), out.data_ptr<T>(), residual.has_value() ? summed.data_ptr<T>() : nullptr,
                        x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {out, summed};
}

// positions [T] int64; q [T, Hq, D], k and v [T, Hkv, D] (views, D contiguous; q and k rotated in place);
// cos_sin [P, D] float32 (cos of the half-dims, then sin). With caches ([blocks, block_size, Hkv, D] views, D
// contiguous) and slots [T] int64, the rotated k and v are stored at their slots.
void rotary_and_store_kv(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos_sin,
                         c10::optional<at::Tensor> k_cache, c10::optional<at::Tensor> v_cache,
                         c10::optional<at::Tensor> slots) {
  const auto qs = layer_ops::rows_of(q, "q"), ks = layer_ops::rows_of(k, "k"), vs = layer_ops::rows_of(v, "v");
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == tokens,
              "positions: [T] int64");
  TORCH_CHECK(k.size(0) == tokens && v.sizes() == k.sizes() && k.size(2) == head_dim && head_dim % 2 == 0,
              "q, k, v: one row per token, an even head size");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v: one dtype");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 && cos_sin.size(1) == head_dim &&
              cos_sin.stride(1) == 1, "cos_sin: [P, D] float32");
  auto pos = positions.contiguous();
  const bool store = k_cache.has_value();
  TORCH_CHECK(store == v_cache.has_value() && store == slots.has_value(), "both caches and the slots, or none");
  int64_t strides[6] = {};
  int64_t block_size = 1;
  at::Tensor slot_ids;
  if (store) {
    TORCH_CHECK(k_cache->dim() == 4 && k_cache->sizes() == v_cache->sizes() && k_cache->stride(3) == 1 &&
                v_cache->stride(3) == 1 && k_cache->size(2) == k.size(1) && k_cache->size(3) == head_dim,
                "caches: [blocks, block_size, Hkv, D] with D contiguous, matching k");
    TORCH_CHECK(k_cache->scalar_type() == q.scalar_type() && v_cache->scalar_type() == q.scalar_type(),
                "caches: q's dtype");
    slot_ids = slots->contiguous();
    TORCH_CHECK(slot_ids.scalar_type() == at::kLong && slot_ids.dim() == 1 && slot_ids.size(0) == tokens,
                "slots: [T] int64");
    block_size = k_cache->size(1);
    for (int i = 0; i < 3; ++i) {
      strides[i] = k_cache->stride(i);
      strides[3 + i] = v_cache->stride(i);
    }
  }
  layer_ops::dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    layer_ops::rotary_and_store_kv(pos.data_ptr<int64_t>(), q.data_ptr<T>(), qs, k.data_ptr<T>(), ks,
                                   v.data_ptr<T>(), vs, cos_sin.data_ptr<float>(), cos_sin.stride(0),
                                   cos_sin.size(0), store ? k_cache->data_ptr<T>() : nullptr,
                                   store ? v_cache->data_ptr<T>() : nullptr, strides,
                                   store ? slot_ids.data_ptr<int64_t>() : nullptr,
                                   store ? k_cache->size(0) * block_size : 0, tokens, head_dim, block_size);
  });
}

// gate_up [T, 2I] (gate then up; rows contiguous) -> [T, I]
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up: [T, 2I] with rows contiguous");
  const int64_t width = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), width}, gate_up.options());
  layer_ops::dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    layer_ops::silu_and_mul(gate_up.data_ptr<T>(), gate_up.stride(0), out.data_ptr<T>(), gate_up.size(0), width);
  });
  return out;
}
