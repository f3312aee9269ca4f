// Panels of 16 output columns in GGUF's 32-wide blocks, as `panel_linear` reads them: a panel is
// `in / 32` groups, each holding 32 input features of its 16 columns with one scale (and, for
// Q4_1, one minimum) per column, as GGUF stores them per row and block:
//
// Q4_1 (320 bytes): d[16] fp16, m[16] fp16, then per input feature 8 bytes whose byte j holds
//                   column j's 4-bit q in its low half and column j + 8's in its high half;
//                   weight = d * q + m
// Q8_0 (544 bytes): d[16] fp16, then per input feature 16 int8 q, one per column;
//                   weight = d * q
//
// Q4_K (384 bytes): d[16] fp32, m[16] fp32, then the nibbles as Q4_1's; a GGUF Q4_K
//                   super-block cut into 32-wide blocks, d = d_super * scale and m = -dmin *
//                   min (products exact in fp32, not in fp16); weight = d * q + m
// Q6_K (640 bytes): d[2][16] fp32 (a scale per column for inputs 0..15, then 16..31), then per
//                   input feature 16 int8 q (-32..31); weight = d * q
// Q8_K (704 bytes): d[2][16] fp32, m[16] fp32, then per input feature 16 int8 q; not GGUF's:
//                   any of the above widened to it (`gguf_blocks.as_q8_k`), so projections
//                   stored in two formats join into one; weight = d * q + m
//
// MXFP4 (272 bytes): e[16], each column's E8M0 scale byte, then the nibbles as Q4_1's, each an
//                   E2M1 code (sign in its top bit); weight = level * 2^(e - 128), the level
//                   being the code's value doubled (GGUF's: 0, 1, 2, 3, 4, 6, 8, 12 and their
//                   negatives), exact in fp32 as GGUF's dequantization is
//
// Q4_1 for 8-bit products (320 bytes, int8 panels; `int8_panels.cpp`): d[16], m[16] fp16, then
//                   for columns 8h..8h+7 (h = 0, 1) and step s = 0..3, 32 bytes whose byte
//                   4c + i holds column 8h + c's q of input feature 4s + i in its low half and
//                   of feature 16 + 4s + i in its high half: one 32-byte load and a mask give
//                   4 features of 8 columns, as AVX2's 8-bit multiply-add takes them
// Q8_0 for 8-bit products (544 bytes, int8 panels): d[16] fp16, then for columns 8h..8h+7 and
//                   step s = 0..7, 32 bytes whose byte 4c + i is column 8h + c's int8 q of
//                   input feature 4s + i
//
// A weight widens to exactly the fp32 value GGUF's dequantization gives: d * q is exact in fp32
// (11 by 4 or 8 significant bits; Q4_K's 17 by 4), so one fused multiply-add rounds d * q + m
// once, as the product and the sum done apart do; Q6_K's d * q is rounded once, as GGUF's is.
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_BLOCK_PANELS 1
#endif

namespace conveyor {

constexpr int64_t kBlock = 32;

#ifdef CONVEYOR_BLOCK_PANELS
// count (a multiple of 8) fp16 values at the start of a group, widened to fp32 (exactly).
inline void widen_halves(const uint8_t* group, int count, float* out) {
  for (int i = 0; i < count; i += 8)
    _mm256_store_ps(
        out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 2 * i))));
}

// count fp32 values at the start of a group (a K-quant's scales), copied to aligned storage.
inline void copy_floats(const uint8_t* group, int count, float* out) {
  for (int i = 0; i < count; i += 8)
    _mm256_store_ps(out + i, _mm256_loadu_ps(reinterpret_cast<const float*>(group) + i));
}

// One input feature's 16 4-bit q (8 bytes: column j in byte j's low half, column j + 8 in its
// high half) as fp32, columns 0..7 and 8..15.
inline void widen_nibbles(const uint8_t* packed, __m256* q) {
  const __m256i bytes =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed)));
  q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)));
  q[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
}

// One input feature's 16 int8 q (16 bytes, one per column) as fp32, columns 0..7 and 8..15.
inline void widen_bytes(const uint8_t* bytes, __m256* q) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(packed));
  q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(packed, 8)));
}

// The 16 weights d * q + m, one fused multiply-add (rounded once) per column.
inline void scaled_with_min(const __m256* q, const float* d, const float* m, __m256* w) {
  w[0] = _mm256_fmadd_ps(q[0], _mm256_load_ps(d), _mm256_load_ps(m));
  w[1] = _mm256_fmadd_ps(q[1], _mm256_load_ps(d + 8), _mm256_load_ps(m + 8));
}

// The 16 weights d * q, one product (rounded once) per column.
inline void scaled(const __m256* q, const float* d, __m256* w) {
  w[0] = _mm256_mul_ps(q[0], _mm256_load_ps(d));
  w[1] = _mm256_mul_ps(q[1], _mm256_load_ps(d + 8));
}
#endif

struct Q41 {
  static constexpr int64_t kBlock = conveyor::kBlock;
  static constexpr int64_t kGroupBytes = 64 + kBlock * 8;
  static constexpr int kScales = 32;  // d[16], m[16]
#ifdef CONVEYOR_BLOCK_PANELS
  static inline void scales(const uint8_t* group, float* out) { widen_halves(group, kScales, out); }
  // The 16 weights of input feature kk of the group.
  static inline void weights(const uint8_t* group, int kk, const float* s, __m256* w) {
    __m256 q[2];
    widen_nibbles(group + 64 + kk * 8, q);
    scaled_with_min(q, s, s + 16, w);
  }
#endif
};

struct Q80 {
  static constexpr int64_t kBlock = conveyor::kBlock;
  static constexpr int64_t kGroupBytes = 32 + kBlock * 16;
  static constexpr int kScales = 16;  // d[16]
#ifdef CONVEYOR_BLOCK_PANELS
  static inline void scales(const uint8_t* group, float* out) { widen_halves(group, kScales, out); }
  static inline void weights(const uint8_t* group, int kk, const float* s, __m256* w) {
    __m256 q[2];
    widen_bytes(group + 32 + kk * 16, q);
    scaled(q, s, w);
  }
#endif
};

struct Q4K {
  static constexpr int64_t kBlock = conveyor::kBlock;
  static constexpr int64_t kGroupBytes = 128 + kBlock * 8;
  static constexpr int kScales = 32;  // d[16], m[16]
#ifdef CONVEYOR_BLOCK_PANELS
  static inline void scales(const uint8_t* group, float* out) { copy_floats(group, kScales, out); }
  static inline void weights(const uint8_t* group, int kk, const float* s, __m256* w) {
    __m256 q[2];
    widen_nibbles(group + 128 + kk * 8, q);
    scaled_with_min(q, s, s + 16, w);
  }
#endif
};

struct Q6K {
  static constexpr int64_t kBlock = conveyor::kBlock;
  static constexpr int64_t kGroupBytes = 128 + kBlock * 16;
  static constexpr int kScales = 32;  // d[2][16]
#ifdef CONVEYOR_BLOCK_PANELS
  static inline void scales(const uint8_t* group, float* out) { copy_floats(group, kScales, out); }
  static inline void weights(const uint8_t* group, int kk, const float* s, __m256* w) {
    __m256 q[2];
    widen_bytes(group + 128 + kk * 16, q);
    scaled(q, s + (kk < 16 ? 0 : 16), w);
  }
#endif
};

struct Q8K {
  static constexpr int64_t kBlock = conveyor::kBlock;
  static constexpr int64_t kGroupBytes = 192 + kBlock * 16;
  static constexpr int kScales = 48;  // d[2][16], m[16]
#ifdef CONVEYOR_BLOCK_PANELS
  static inline void scales(const uint8_t* group, float* out) { copy_floats(group, kScales, out); }
  static inline void weights(const uint8_t* group, int kk, const float* s, __m256* w) {
    __m256 q[2];
    widen_bytes(group + 192 + kk * 16, q);
    scaled_with_min(q, s + (kk < 16 ? 0 : 16), s + 32, w);
  }
#endif
};

struct MXFP4 {
  static constexpr int64_t kBlock = conveyor::kBlock;
  static constexpr int64_t kGroupBytes = 16 + kBlock * 8;
  static constexpr int kScales = 16;  // 2^(e - 128) per column
#ifdef CONVEYOR_BLOCK_PANELS
  // GGUF's half scale of an E8M0 byte, built from its bits (below 2: subnormal).
  static inline void scales(const uint8_t* group, float* out) {
    for (int j = 0; j < kScales; ++j) {
      const uint32_t e = group[j];
      const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
      __builtin_memcpy(out + j, &bits, sizeof(bits));
    }
  }
  static inline void weights(const uint8_t* group, int kk, const float* s, __m256* w) {
    const __m256 positive = _mm256_setr_ps(0, 1, 2, 3, 4, 6, 8, 12);
    const __m256 negative = _mm256_setr_ps(0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i bytes = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + 16 + kk * 8)));
    const __m256i codes[2] = {_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)),
                              _mm256_srli_epi32(bytes, 4)};
    for (int h = 0; h < 2; ++h) {
      // The low three bits pick the magnitude, the top one (moved to the sign) the side.
      const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(codes[h], 28));
      const __m256 level = _mm256_blendv_ps(_mm256_permutevar8x32_ps(positive, codes[h]),
                                            _mm256_permutevar8x32_ps(negative, codes[h]), sign);
      w[h] = _mm256_mul_ps(level, _mm256_load_ps(s + 8 * h));
    }
  }
#endif
};

// Whether uint8 block panels of this group size are of a format above (each of them
// `panel_linear` widens to fp32, and the bf16 products take).
inline bool block_group(int64_t group) {
  return group == Q41::kGroupBytes || group == Q80::kGroupBytes || group == Q4K::kGroupBytes ||
         group == Q6K::kGroupBytes || group == Q8K::kGroupBytes || group == MXFP4::kGroupBytes;
}

struct Q41Int8 {
  static constexpr int64_t kScaleBytes = 64;  // d[16], m[16]
  static constexpr int64_t kGroupBytes = kScaleBytes + kBlock * 8;
};

struct Q80Int8 {
  static constexpr int64_t kScaleBytes = 32;  // d[16]
  static constexpr int64_t kGroupBytes = kScaleBytes + kBlock * 16;
};

#ifdef CONVEYOR_BLOCK_PANELS
// One block panel (`K / 32` groups) widened to an fp32 panel `[K, 16]`.
template <typename Q>
inline void dequantize_panel(const uint8_t* panel, int64_t K, float* out) {
  alignas(32) float s[Q::kScales];
  for (int64_t b = 0; b < K / Q::kBlock; ++b) {
    const uint8_t* group = panel + b * Q::kGroupBytes;
    Q::scales(group, s);
    for (int kk = 0; kk < Q::kBlock; ++kk) {
      __m256 w[2];
      Q::weights(group, kk, s, w);
      float* row = out + (b * Q::kBlock + kk) * 16;
      _mm256_storeu_ps(row, w[0]);
      _mm256_storeu_ps(row + 8, w[1]);
    }
  }
}
#endif

}  // namespace conveyor
