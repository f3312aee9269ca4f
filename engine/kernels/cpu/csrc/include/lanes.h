// One value from the eight lanes of an AVX2 register: their largest, or their sum in a fixed
// tree. Shared by the int8 rounding of activations and the paged attention's softmax.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

namespace conveyor {

inline __attribute__((always_inline)) float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline __attribute__((always_inline)) float horizontal_sum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

}  // namespace conveyor
#endif
