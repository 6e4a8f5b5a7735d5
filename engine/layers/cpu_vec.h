// Eight floats at a time for the CPU kernels (cpu_paged_attention.cpp, cpu_layer_ops.cpp): loads that widen float32,
// bf16 or fp16 values to float32, stores that round back as torch's casts do (to nearest even), and exp. Each has
// a scalar twin for the tails, and the whole is scalar where the build has no AVX2.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

// The AVX512-BF16 kernels (cpu_linear.cpp, cpu_paged_attention.cpp, cpu_prefill_attention.cpp) are compiled for this
// target function by function, in any AVX2 build on x86-64, and run only where has_bf16_dot() says the CPU has it.
#if defined(TANDEM_AVX2) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TANDEM_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace tandem_vec {

// scalar: float32 <-> the tensor's type (c10's BFloat16 and Half round to nearest even, as torch's casts do)
template <typename T>
inline float up(T x) {
  return static_cast<float>(x);
}
template <typename T>
inline T down(float x) {
  return static_cast<T>(x);
}
// a float32 result rounded to T and read back: what the next eager op of a T tensor sees
template <typename T>
inline float round_to(float x) {
  return up(down<T>(x));
}

#ifdef TANDEM_AVX2
using V = __m256;

inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const at::BFloat16* p) {  // a bf16 is the top half of a float32
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline V load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// float32 bits rounded to bf16 (to nearest even; a NaN to the quiet NaN c10 makes), still in the top 16 bits
inline __m256i bf16_bits(V x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))),
                            _mm256_set1_epi32(0x7FC00000), nan);
}

inline void store(float* p, V x) { _mm256_storeu_ps(p, x); }
inline void store(at::BFloat16* p, V x) {
  const __m256i shifted = _mm256_srli_epi32(bf16_bits(x), 16);
  // packus works within 128-bit lanes: the two halves' four values each, then gathered into the low lane
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(shifted, shifted), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store(at::Half* p, V x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename T>
inline V round_to(V x);
template <>
inline V round_to<float>(V x) { return x; }
template <>
inline V round_to<at::BFloat16>(V x) { return _mm256_castsi256_ps(bf16_bits(x)); }
template <>
inline V round_to<at::Half>(V x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp of eight floats: Cephes' single-precision polynomial, within 2 ulp of expf; inputs above 88 are taken as 88,
// inputs below -87 (a masked score's -inf) give exactly 0
inline V exp(V x) {
  const V live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const V k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  V y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(exponent)), live);
}

// the eight lanes' sum, pairwise
inline float sum(V x) {
  const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
#endif

#ifdef TANDEM_AVX512_BF16
// exp of sixteen floats: the eight-wide exp on each half
TANDEM_AVX512_BF16 inline __m512 exp16(__m512 x) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(exp(_mm512_castps512_ps256(x))),
                            exp(_mm512_extractf32x8_ps(x, 1)), 1);
}

// whether this CPU runs the TANDEM_AVX512_BF16 code
inline bool has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#else
inline bool has_bf16_dot() { return false; }
#endif

}  // namespace tandem_vec
