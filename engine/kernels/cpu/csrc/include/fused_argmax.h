// A greedy choice taken as a product's sums leave the registers, so that a step whose rows all
// sample greedily never writes its logits out: each thread keeps, per row and per lane of 16
// output columns, the largest sum it has seen and the least column holding it, and the least
// column holding a NaN; the threads' bests then give each row's choice as `torch.argmax` makes
// it over the whole row (the first of equal maxima; the first NaN where the row has one).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace conveyor {

constexpr int32_t kNoColumn = std::numeric_limits<int32_t>::max();
constexpr int64_t kNoNan = std::numeric_limits<int64_t>::max();

// One thread's best of one row so far.
struct alignas(64) RowBest {
  float value[16];
  int32_t column[16];
  int64_t nan;

  void reset() {
    std::fill(value, value + 16, -std::numeric_limits<float>::infinity());
    std::fill(column, column + 16, kNoColumn);
    nan = kNoNan;
  }
};

#if defined(__AVX512F__)
// Sums of output columns [n0, n0 + 16), those below N, into `best`. A column takes a lane from
// the one there when its sum is larger, or equal and the column earlier, whatever order the
// panels come in; -inf sums take lanes still empty, so a row of -inf chooses its first column.
inline void note_best(RowBest& best, __m512 sums, int64_t n0, int64_t N) {
  const __mmask16 valid = n0 + 16 <= N ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
  const __mmask16 nan = _mm512_mask_cmp_ps_mask(valid, sums, sums, _CMP_UNORD_Q);
  if (nan != 0) best.nan = std::min<int64_t>(best.nan, n0 + __builtin_ctz(nan));
  const __m512i columns =
      _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(n0)),
                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512 top = _mm512_load_ps(best.value);
  const __m512i at = _mm512_load_si512(best.column);
  const __mmask16 larger = _mm512_mask_cmp_ps_mask(valid, sums, top, _CMP_GT_OQ);
  const __mmask16 equal =
      _mm512_mask_cmp_ps_mask(valid, sums, top, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(columns, at);
  const __mmask16 take = larger | equal;
  _mm512_store_ps(best.value, _mm512_mask_mov_ps(top, take, sums));
  _mm512_store_si512(best.column, _mm512_mask_mov_epi32(at, take, columns));
}
#endif

// The row's choice from the bests of `threads` threads, `stride` rows apart.
inline int64_t row_choice(const RowBest* bests, int threads, int64_t stride) {
  int64_t nan = kNoNan, at = 0;
  float top = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (int t = 0; t < threads; ++t) {
    const RowBest& best = bests[t * stride];
    nan = std::min(nan, best.nan);
    for (int lane = 0; lane < 16; ++lane) {
      const int32_t column = best.column[lane];
      if (column == kNoColumn) continue;
      const float value = best.value[lane];
      if (!any || value > top || (value == top && column < at)) {
        top = value;
        at = column;
        any = true;
      }
    }
  }
  return nan != kNoNan ? nan : at;
}

}  // namespace conveyor
