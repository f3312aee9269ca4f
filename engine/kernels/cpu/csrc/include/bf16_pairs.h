// Register-tiled products over bf16 pairs (AVX-512 BF16 `vdpbf16ps`), as a bf16 model's prompt
// attention takes them: a [rows][2 * pairs] holds bf16 bit patterns (row stride lda), b is
// [pairs][cols] 32-bit words, word i of a column holding the two bf16 values that multiply a
// row's elements 2i and 2i + 1 (row stride ldb words). Sums are fp32. Up to 6 rows by 64
// columns (cols a multiple of 16) a call, in 24 accumulators; each b word is loaded once for the
// rows, each pair of a broadcast to the columns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16_round.h"

#ifdef CONVEYOR_BF16_ROUND

namespace conveyor {

// c[MR][16 * NB] (row stride ldc) = scale * (a b), or with Accumulate c += a b.
template <int MR, int NB, bool Accumulate>
__attribute__((noinline)) void bf16_pair_tile(const uint16_t* a, int64_t lda, const uint32_t* b,
                                              int64_t ldb, int64_t pairs, float scale, float* c,
                                              int64_t ldc) {
  __m512 acc[MR][NB];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
      acc[m][j] = Accumulate ? _mm512_loadu_ps(c + m * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh col[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
      col[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + i * ldb + 16 * j));
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * i, sizeof(pair));
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], x, col[j]);
    }
  }
  const __m512 by = _mm512_set1_ps(scale);
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
      _mm512_storeu_ps(c + m * ldc + 16 * j, Accumulate ? acc[m][j] : _mm512_mul_ps(acc[m][j], by));
}

template <int MR, bool Accumulate>
void bf16_pair_rows(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t pairs,
                    float scale, float* c, int64_t ldc, int64_t blocks) {
  switch (blocks) {
    case 4: bf16_pair_tile<MR, 4, Accumulate>(a, lda, b, ldb, pairs, scale, c, ldc); break;
    case 3: bf16_pair_tile<MR, 3, Accumulate>(a, lda, b, ldb, pairs, scale, c, ldc); break;
    case 2: bf16_pair_tile<MR, 2, Accumulate>(a, lda, b, ldb, pairs, scale, c, ldc); break;
    default: bf16_pair_tile<MR, 1, Accumulate>(a, lda, b, ldb, pairs, scale, c, ldc); break;
  }
}

// c[rows][cols] = scale * (a b), or with Accumulate c += a b; cols a multiple of 16.
template <bool Accumulate>
void bf16_pair_product(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
                       int64_t pairs, float scale, float* c, int64_t ldc, int64_t rows,
                       int64_t cols) {
  using Rows = void (*)(const uint16_t*, int64_t, const uint32_t*, int64_t, int64_t, float, float*,
                        int64_t, int64_t);
  static constexpr Rows kByRows[] = {
      &bf16_pair_rows<1, Accumulate>, &bf16_pair_rows<2, Accumulate>,
      &bf16_pair_rows<3, Accumulate>, &bf16_pair_rows<4, Accumulate>,
      &bf16_pair_rows<5, Accumulate>, &bf16_pair_rows<6, Accumulate>};
  constexpr int64_t kRows = 6, kCols = 64;
  for (int64_t j = 0; j < cols; j += kCols) {
    const int64_t blocks = std::min(kCols, cols - j) / 16;
    for (int64_t m = 0; m < rows; m += kRows) {
      const uint16_t* am = a + m * lda;
      float* cm = c + m * ldc + j;
      kByRows[std::min(kRows, rows - m) - 1](am, lda, b + j, ldb, pairs, scale, cm, ldc, blocks);
    }
  }
}

}  // namespace conveyor
#endif
