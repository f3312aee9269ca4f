// fp32 values rounded to bf16 as the bf16 panels take their input rows: to nearest, ties to even
// (`vcvtneps2bf16`, as torch rounds), 16 lanes at a time. Every producer of bf16 rows for those
// products rounds through this one routine, so its rows are the ones the product would make.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_BF16_ROUND 1

namespace conveyor {

// in[0, count) as bf16 bit patterns at out.
inline void round_to_bf16(const float* in, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask =
        count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
    const __m256bh half = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, in + i));
    _mm256_mask_storeu_epi16(out + i, mask, reinterpret_cast<const __m256i&>(half));
  }
}

}  // namespace conveyor
#endif
