// Eight fp32, fp16 or bf16 values as eight floats in one AVX2 register: 16-bit values widen as
// they load (fp16 through F16C; bf16 is the top half of an fp32), exactly, so a kernel streams
// half the bytes with no converted copy. Shared by the panel GEMM and the paged attention.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define CONVEYOR_LOAD8 1

namespace conveyor {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

}  // namespace conveyor
#endif
