// A bf16 linear layer for a few rows (a decode step) on CPUs with AVX512-BF16 (engine/layers/cpu_linear.py).
//
// Why: at 8 rows a layer's product is a read of its weights, and oneDNN read SmolLM2's at ~20 GB/s where this box
// streams 30-35. Here the weight is packed once into tiles of 32 output features: for each pair of input features,
// the tile's 32 pairs of weights lie in two 64-byte vectors, so one VDPBF16PS multiplies 16 outputs' pairs by one
// row's pair (broadcast) and adds both products into float32 sums: no sums across lanes, and every tile is one
// contiguous run of memory. Each thread takes whole tiles; up to 8 rows at a time share a tile's load.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu_vec.h"

namespace bf16_tiles {

constexpr int64_t kTile = 32;  // output features a tile
constexpr int64_t kRows = 8;   // rows that share one pass over a tile

#ifdef TANDEM_AVX512_BF16
// out[m][0..32) = x[m] . tile for `Rows` rows; x rows are `x_stride` bf16 apart, `pairs` = K / 2
template <int Rows>
TANDEM_AVX512_BF16 void tile_product(const uint16_t* x, int64_t x_stride, const uint16_t* tile, int64_t pairs,
                                     float* out) {
  __m512 acc[Rows][2];
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + p * 2 * kTile);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + p * 2 * kTile + kTile);
#pragma GCC unroll 8
    for (int m = 0; m < Rows; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * p, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < Rows; ++m) {
    _mm512_storeu_ps(out + m * kTile, acc[m][0]);
    _mm512_storeu_ps(out + m * kTile + 16, acc[m][1]);
  }
}

TANDEM_AVX512_BF16 void rows_product(int64_t rows, const uint16_t* x, int64_t x_stride, const uint16_t* tile,
                                     int64_t pairs, float* out) {
  switch (rows) {
    case 1: tile_product<1>(x, x_stride, tile, pairs, out); break;
    case 2: tile_product<2>(x, x_stride, tile, pairs, out); break;
    case 3: tile_product<3>(x, x_stride, tile, pairs, out); break;
    case 4: tile_product<4>(x, x_stride, tile, pairs, out); break;
    case 5: tile_product<5>(x, x_stride, tile, pairs, out); break;
    case 6: tile_product<6>(x, x_stride, tile, pairs, out); break;
    case 7: tile_product<7>(x, x_stride, tile, pairs, out); break;
    default: tile_product<8>(x, x_stride, tile, pairs, out); break;
  }
}

// float32 sums (+ bias) -> bf16, rounded to nearest even as a float32 -> bf16 cast is
TANDEM_AVX512_BF16 void store_row(const float* sums, const float* bias, int64_t count, uint16_t* out) {
  if (count == kTile) {
    __m512 lo = _mm512_loadu_ps(sums), hi = _mm512_loadu_ps(sums + 16);
    if (bias != nullptr) {
      lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
      hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
    }
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    return;
  }
  for (int64_t n = 0; n < count; ++n) {
    const c10::BFloat16 value(sums[n] + (bias != nullptr ? bias[n] : 0.0f));
    out[n] = value.x;
  }
}
#endif

}  // namespace bf16_tiles

// Whether the AVX512-BF16 kernels run here (this file's, the bf16 decode walk's, the prefill attention's): built for
// that target (an AVX2 build on x86-64) and a CPU that has it.
bool bf16_kernels_usable() { return tandem_vec::has_bf16_dot(); }

// weight [N, K] bf16 (K even) -> tiles [ceil(N / 32), K / 2, 32, 2] bf16, output features past N zero
at::Tensor pack_bf16_linear_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0,
              "weight: [N, K] bf16 with K even");
  const int64_t n = weight.size(0), k = weight.size(1), tiles = (n + bf16_tiles::kTile - 1) / bf16_tiles::kTile;
  auto padded = at::zeros({tiles * bf16_tiles::kTile, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [tiles, 32, K/2, 2] -> [tiles, K/2, 32, 2]
  return padded.view({tiles, bf16_tiles::kTile, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bf16 (rows contiguous); tiles from pack_bf16_linear_weight; bias [N] float32 or none -> [M, N] bf16
at::Tensor bf16_linear(at::Tensor x, at::Tensor tiles, int64_t out_features, c10::optional<at::Tensor> bias) {
#ifdef TANDEM_AVX512_BF16
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: [M, K] bf16, rows contiguous");
  TORCH_CHECK(tiles.dim() == 4 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
              tiles.size(1) * 2 == x.size(1) && tiles.size(2) == bf16_tiles::kTile &&
              tiles.size(0) * bf16_tiles::kTile >= out_features, "tiles: packed for x's K and N");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == out_features &&
                                    bias->is_contiguous()), "bias: [N] float32");
  const int64_t rows = x.size(0), pairs = x.size(1) / 2, num_tiles = tiles.size(0);
  auto out = at::empty({rows, out_features}, x.options());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    float sums[bf16_tiles::kRows * bf16_tiles::kTile];
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* tile = ws + t * pairs * 2 * bf16_tiles::kTile;
      const int64_t first = t * bf16_tiles::kTile, count = std::min(bf16_tiles::kTile, out_features - first);
      for (int64_t m = 0; m < rows; m += bf16_tiles::kRows) {
        const int64_t block = std::min(bf16_tiles::kRows, rows - m);
        bf16_tiles::rows_product(block, xs + m * x.stride(0), x.stride(0), tile, pairs, sums);
        for (int64_t i = 0; i < block; ++i)
          bf16_tiles::store_row(sums + i * bf16_tiles::kTile, b == nullptr ? nullptr : b + first, count,
                                os + (m + i) * out_features + first);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 kernel");
#endif
}
