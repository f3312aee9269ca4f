// exp(x) in plain arithmetic, as one scalar function and an eight-lane AVX2 twin that computes
// the same operations, so every lane equals the scalar result. Range reduction to 2^n * exp(r),
// |r| <= ln2/2, then a degree-6 polynomial: relative error below 2e-7. Inputs are clamped to
// where fp32 neither overflows nor goes subnormal; shared by the attention softmax and the gated
// activation.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_EXP8 1
#endif

namespace conveyor {

constexpr float kExpLow = -87.f, kExpHigh = 88.f, kLog2e = 1.44269504f;
constexpr float kLn2High = 0.693145752f, kLn2Low = 1.42860677e-6f;
constexpr float kExpPoly[7] = {
    1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.f, 1.f};

inline float exp_clamped(float x) {
  x = std::min(std::max(x, kExpLow), kExpHigh);
  const float n = std::nearbyint(x * kLog2e);
  const float r = std::fma(-n, kLn2Low, std::fma(-n, kLn2High, x));
  float p = kExpPoly[0];
  for (int i = 1; i < 7; ++i) p = std::fma(p, r, kExpPoly[i]);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#ifdef CONVEYOR_EXP8
inline __m256 exp8_clamped(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// silu(x) = x / (1 + exp(-x)), as torch computes it: the scalar form and its eight-lane twin,
// shared by the gated activations and the short convolution.
inline float silu(float x) { return x / (1.f + exp_clamped(-x)); }

#ifdef CONVEYOR_EXP8
inline __m256 silu8(__m256 x) {
  const __m256 e = exp8_clamped(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
#endif

// GELU under tanh's approximation (Gemma's), 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x +
// 0.044715 x^3), computed as x / (1 + exp(-2u)), the same value in silu's operations (1 +
// tanh(u) = 2 / (1 + exp(-2u))), so it never subtracts near-equal values; the scalar form and
// its eight-lane twin. 2u = x (kGeluLinear + kGeluCubic x^2).
constexpr float kGeluLinear = 1.59576912f, kGeluCubic = 0.0713548162f;

inline float gelu_tanh(float x) {
  const float twice_u = x * std::fma(kGeluCubic, x * x, kGeluLinear);
  return x / (1.f + exp_clamped(-twice_u));
}

#ifdef CONVEYOR_EXP8
inline __m256 gelu_tanh8(__m256 x) {
  const __m256 twice_u =
      _mm256_mul_ps(x, _mm256_fmadd_ps(_mm256_set1_ps(kGeluCubic), _mm256_mul_ps(x, x),
                                       _mm256_set1_ps(kGeluLinear)));
  const __m256 e = exp8_clamped(_mm256_sub_ps(_mm256_setzero_ps(), twice_u));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
#endif

// gpt-oss's clamped SwiGLU of a gate and an up value: the gate capped at `limit`, the up
// clamped to [-limit, limit], then (up + 1) * gate / (1 + exp(-alpha * gate)) (gate times
// sigmoid(alpha * gate), in silu's operations; a NaN stays NaN); the scalar form and its
// eight-lane twin.
inline float clamped_swiglu(float gate, float up, float alpha, float limit) {
  const float g = std::min(gate, limit);
  const float u = std::min(std::max(up, -limit), limit);
  return (u + 1.f) * (g / (1.f + exp_clamped(-(alpha * g))));
}

#ifdef CONVEYOR_EXP8
inline __m256 clamped_swiglu8(__m256 gate, __m256 up, float alpha, float limit) {
  // minps and maxps return their second operand where either is NaN: the value goes second.
  const __m256 g = _mm256_min_ps(_mm256_set1_ps(limit), gate);
  const __m256 u = _mm256_min_ps(_mm256_set1_ps(limit), _mm256_max_ps(_mm256_set1_ps(-limit), up));
  const __m256 e =
      exp8_clamped(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(alpha), g)));
  return _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.f)),
                       _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
}
#endif

// s[0, n) replaced by exp(s[i] - shift), eight lanes at a time, and their sum: the lanes' sums
// added in lane order, then the tail's one at a time. Shared by the attention softmaxes.
inline float exp_shifted_sum(float* s, int64_t n, float shift) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef CONVEYOR_EXP8
  if (n >= 8) {
    const __m256 by = _mm256_set1_ps(shift);
    __m256 sums = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8_clamped(_mm256_sub_ps(_mm256_loadu_ps(s + i), by));
      _mm256_storeu_ps(s + i, e);
      sums = _mm256_add_ps(sums, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sums);
    for (const float lane : lanes) sum += lane;
  }
#endif
  for (; i < n; ++i) {
    s[i] = exp_clamped(s[i] - shift);
    sum += s[i];
  }
  return sum;
}

}  // namespace conveyor
