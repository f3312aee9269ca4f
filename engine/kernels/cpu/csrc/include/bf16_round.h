// fp32 values rounded to bf16 as the bf16 panels take their input rows: to nearest, ties to even
// (`vcvtneps2bf16`, as torch rounds), 16 lanes at a time. Every producer of bf16 rows for those
// products rounds through this one routine, so its rows are the ones the product would make.
//
// `CONVEYOR_BF16_ROUND` marks builds with AVX-512 BF16, where the bf16 products run. Elsewhere
// the same routine rounds one value at a time, as torch's `c10::BFloat16` does, so that code
// shared with those products still builds on every x86-64 level.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_BF16_ROUND 1
#endif

namespace conveyor {

#ifdef CONVEYOR_BF16_ROUND
// in[0, count) as bf16 bit patterns at out.
inline void round_to_bf16(const float* in, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask = count - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (count - i)) - 1);
    const __m256bh half = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, in + i));
    _mm256_mask_storeu_epi16(out + i, mask, reinterpret_cast<const __m256i&>(half));
  }
}
#else
// in[0, count) as bf16 bit patterns at out: NaN stays a quiet NaN, the rest to nearest even.
inline void round_to_bf16(const float* in, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + i, sizeof(bits));
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
      out[i] = static_cast<uint16_t>((bits >> 16) | 0x0040u);
    } else {
      out[i] = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
  }
}
#endif

}  // namespace conveyor
