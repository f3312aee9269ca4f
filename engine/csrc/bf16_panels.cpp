// Linear layers over bf16 weights on CPUs with AVX-512 BF16 dot products: y = x w^T + bias with
// x, bias and y in fp32, each row of x rounded to bf16 (to nearest, ties to even, as torch
// rounds) and every product summed in fp32. `panel_linear` checks the inputs and calls this
// product for bf16 panels.
//
// x       [rows, in]                   fp32, contiguous (in even)
// panels  [ceil(out / 16), in / 2, 32] bf16: panel p holds output columns 16p..16p+15; for each
//                                      pair of input features (2k, 2k + 1), column c's two
//                                      weights sit at 2c and 2c + 1 (zero-padded columns)
// bias    [panels * 16]                fp32, optional, zero-padded like the panels
//
// One `vdpbf16ps` adds a pair of input features of one row times the same pair of a panel's 16
// columns into 16 fp32 sums: 32 multiply-adds an instruction, twice the fp32 rate of a fused
// multiply-add of the same width, over weights that stream at half fp32's bytes. The inner loop
// holds up to 8 rows by 2 panels of sums in registers (1 row runs over 8 panels, 2 over 4, for
// enough independent sums); every output is summed over the pairs in input order, whatever the
// number of rows, threads or panels at once, so a row's result does not depend on its batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"
#include "panel_passes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_BF16_PANELS 1
#endif

namespace {

#ifdef CONVEYOR_BF16_PANELS
using conveyor::chunk_rows;
using conveyor::kPanel;
using conveyor::near_equal_passes;

// Rows of x handled per pass over the weight: about this many bytes of bf16 rows, kept in L2.
constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int kMaxRows = 8;
// Up to this many rows, the next two panels are fetched while the first pass runs over the
// current two (a few passes leave too little time to hide their first reads from memory; more
// rows gain nothing and lose a little, the fetched panels pushing rows out of L2).
constexpr int64_t kFetchRows = 32;
// bf16 values a panel holds per pair of input features.
constexpr int64_t kPairWidth = 2 * kPanel;

// x rounded to bf16, row by row: [rows, K] as 16-bit patterns.
std::vector<uint16_t> round_rows(const float* x, int64_t M, int64_t K) {
  std::vector<uint16_t> rounded(M * K);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* in = x + m * K;
      uint16_t* out = rounded.data() + m * K;
      for (int64_t i = 0; i < K; i += 16) {
        const __mmask16 mask = K - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - i)) - 1);
        const __m256bh half = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, in + i));
        _mm256_mask_storeu_epi16(out + i, mask, reinterpret_cast<const __m256i&>(half));
      }
    }
  });
  return rounded;
}

struct Problem {
  const uint16_t* x;  // rounded rows
  const float* bias;  // padded to whole panels, or null
  float* out;
  int64_t M, K, N;
};

// Stores 16 sums plus bias as output columns n0.. of one row: all 16, or those below N.
CONVEYOR_INLINE void store_panel(__m512 sum, const Problem& pb, int64_t row, int64_t n0) {
  if (pb.bias != nullptr) sum = _mm512_add_ps(sum, _mm512_loadu_ps(pb.bias + n0));
  float* out = pb.out + row * pb.N + n0;
  if (n0 + kPanel <= pb.N)
    _mm512_storeu_ps(out, sum);
  else
    _mm512_mask_storeu_ps(out, __mmask16((1u << (pb.N - n0)) - 1), sum);
}

// Rows [row, row + MR) times panels [p, p + NP), written to out plus bias. With `Fetch`, the
// NP panels at `ahead` are fetched into the caches along the way.
template <int MR, int NP, bool Fetch = false>
__attribute__((noinline)) void micro(const Problem& pb, int64_t row, const uint16_t* panels,
                                     int64_t p, const uint16_t* ahead = nullptr) {
  const int64_t pairs = pb.K / 2, panel_size = pairs * kPairWidth;
  const uint16_t* x = pb.x + row * pb.K;
  const uint16_t* w = panels + p * panel_size;
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    if constexpr (Fetch)
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j)
        __builtin_prefetch(ahead + j * panel_size + k * kPairWidth, 0, 2);
    __m512bh wv[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      wv[j] = reinterpret_cast<__m512bh>(
          _mm512_loadu_si512(w + j * panel_size + k * kPairWidth));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * pb.K + 2 * k, 4);
      const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) store_panel(acc[m][j], pb, row + m, (p + j) * kPanel);
}

// One pass of mr (1 to kMaxRows) rows from m over NP panels from p.
template <int NP, bool Fetch>
void rows_pass(const Problem& pb, int64_t m, int64_t mr, const uint16_t* panels, int64_t p,
               const uint16_t* ahead) {
  switch (mr) {
    case 8: micro<8, NP, Fetch>(pb, m, panels, p, ahead); break;
    case 7: micro<7, NP, Fetch>(pb, m, panels, p, ahead); break;
    case 6: micro<6, NP, Fetch>(pb, m, panels, p, ahead); break;
    case 5: micro<5, NP, Fetch>(pb, m, panels, p, ahead); break;
    case 4: micro<4, NP, Fetch>(pb, m, panels, p, ahead); break;
    case 3: micro<3, NP, Fetch>(pb, m, panels, p, ahead); break;
    case 2: micro<2, NP, Fetch>(pb, m, panels, p, ahead); break;
    default: micro<1, NP, Fetch>(pb, m, panels, p, ahead); break;
  }
}

// Rows [m0, m0 + rows) times NP panels from p, in passes of at most kMaxRows rows; the first
// pass fetches the NP panels at `ahead` (if any) into the caches for the next call.
template <int NP>
void rows_by_panels(const Problem& pb, int64_t m0, int64_t rows, const uint16_t* panels,
                    int64_t p, const uint16_t* ahead) {
  near_equal_passes(m0, rows, kMaxRows, [&](int64_t m, int64_t mr) {
    if (m == m0 && ahead != nullptr) {
      rows_pass<NP, true>(pb, m, mr, panels, p, ahead);
    } else {
      rows_pass<NP, false>(pb, m, mr, panels, p, nullptr);
    }
  });
}

// A few rows (all of them in one pass) over panels [p0, p1), NP at a time, then one at a time.
template <int MR, int NP>
void few_rows(const Problem& pb, const uint16_t* panels, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) micro<MR, NP>(pb, 0, panels, p);
  for (; p < p1; ++p) micro<MR, 1>(pb, 0, panels, p);
}

// Panels [p0, p1) for all rows, a chunk of rows at a time, two panels at a time.
void rows_in_chunks(const Problem& pb, const uint16_t* panels, int64_t p0, int64_t p1) {
  const int64_t chunk = chunk_rows(pb.K * 2, kChunkBytes, kMaxRows);
  for (int64_t m0 = 0; m0 < pb.M; m0 += chunk) {
    const int64_t rows = std::min(chunk, pb.M - m0);
    const int64_t panel_size = pb.K / 2 * kPairWidth;
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2) {
      const uint16_t* ahead =
          rows <= kFetchRows && p + 4 <= p1 ? panels + (p + 2) * panel_size : nullptr;
      rows_by_panels<2>(pb, m0, rows, panels, p, ahead);
    }
    if (p < p1) rows_by_panels<1>(pb, m0, rows, panels, p, nullptr);
  }
}

void panel_range(const Problem& pb, const uint16_t* panels, int64_t p0, int64_t p1) {
  switch (pb.M) {
    case 1: few_rows<1, 8>(pb, panels, p0, p1); return;
    case 2: few_rows<2, 4>(pb, panels, p0, p1); return;
    case 3: few_rows<3, 2>(pb, panels, p0, p1); return;
    default: rows_in_chunks(pb, panels, p0, p1);
  }
}
#endif

}  // namespace

namespace conveyor {

void bf16_panel_product(const float* x, int64_t M, int64_t K, const at::Tensor& panels,
                        const float* bias, float* out, int64_t out_features) {
#ifndef CONVEYOR_BF16_PANELS
  TORCH_CHECK(false, "bf16 panels need AVX-512 BF16");
#else
  const std::vector<uint16_t> rounded = round_rows(x, M, K);
  const Problem pb{rounded.data(), bias, out, M, K, out_features};
  const uint16_t* w = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  // Enough panels per task that a thread's share streams as one run.
  at::parallel_for(0, panels.size(0), 4,
                   [&](int64_t p0, int64_t p1) { panel_range(pb, w, p0, p1); });
#endif
}

}  // namespace conveyor
