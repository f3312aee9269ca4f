// Eight fp32, fp16, bf16 or fp8 (e5m2) values as eight floats in one AVX2 register: narrower
// values widen as they load (fp16 through F16C; bf16 is the top half of an fp32, e5m2 the top
// byte of an fp16), exactly, so a kernel streams fewer bytes with no converted copy. Shared by
// the panel GEMM and the paged attention.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define CONVEYOR_LOAD8 1

namespace conveyor {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
}

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

}  // namespace conveyor
#endif
