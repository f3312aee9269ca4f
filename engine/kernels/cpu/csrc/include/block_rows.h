// What the bf16 products over block panels share (`mxfp4_bf16.cpp`, `block_bf16.cpp`): their
// inputs' checks beside the panels' format, the rows rounded to bf16 as the bf16 panels round
// theirs, and how a pass's sums leave as output columns.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "bf16_round.h"
#include "block_panels.h"
#include "panel_passes.h"
#include "pass_split.h"
#include "scratch.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace conveyor {

// Pairs of input features in a 32-wide block, and the bf16 values a bf16 panel's pair holds.
constexpr int kBlockPairs = kBlock / 2;
constexpr int64_t kBf16PairWidth = 2 * kPanel;
// Rows one pass holds, and about this many bytes of bf16 rows per chunk a thread's panels pass
// over.
constexpr int kBlockPassRows = 8;
constexpr int64_t kBlockChunkBytes = 256 * 1024;
// Byte 2j + s of a pair's 16 bytes of nibbles (8 per input feature) is byte j of feature s.
alignas(16) constexpr uint8_t kNibbleInterleave[16] = {0, 8,  1, 9,  2, 10, 3, 11,
                                                       4, 12, 5, 13, 6, 14, 7, 15};

// x contiguous fp32 [rows, in] with in = 32 per group of the panels [panels, in / 32, group]
// (contiguous uint8, their format checked by the op), out_features filling the panels, and the
// bias, if any, fp32 [panels * 16]; returns the bias's values (null without one).
inline const float* checked_block_inputs(const char* op, const at::Tensor& x,
                                         const at::Tensor& panels,
                                         const c10::optional<at::Tensor>& bias,
                                         int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be contiguous fp32 [rows, in]");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) == panels.size(1) * kBlock, op,
              ": x and panels' input sizes differ");
  TORCH_CHECK(out_features > 0 && (out_features + kPanel - 1) / kPanel == panels.size(0), op,
              ": out_features does not match the number of panels");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == panels.size(0) * kPanel &&
                  bias->scalar_type() == at::kFloat && bias->is_contiguous(),
              op, ": bias must be fp32 [panels * 16], zero-padded");
  return bias->data_ptr<float>();
}

// x's rows [rows, in] rounded to bf16, a few rows a task.
inline Scratch<uint16_t> bf16_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  auto rounded = scratch<uint16_t>(M * K);
  const float* rows = x.data_ptr<float>();
  at::parallel_for(0, M, rows_per_task(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) round_to_bf16(rows + m * K, K, rounded.get() + m * K);
  });
  return rounded;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
template <int MR, int NP>
CONVEYOR_INLINE void zero_sums(__m512 (&acc)[MR][NP]) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_setzero_ps();
}

// A pair of input features' 16 bytes of nibbles (byte j of a feature: column j's 4 bits in its
// low half, column j + 8's in its high half), interleaved by `kNibbleInterleave`, as 32 16-bit
// values in a bf16 panel's pair order (lane 2c + s: column c of feature s).
CONVEYOR_INLINE __m512i nibble_pair(const uint8_t* packed, __m128i interleave) {
  const __m256i bytes = _mm256_cvtepu8_epi16(
      _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed)), interleave));
  const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_srli_epi16(bytes, 4), 1);
}

// Where a pass reads a panel: its groups, widened in registers as it goes, or the bf16 panel
// [in / 2, 32] they were widened into once (beside the groups, whose scales a pass may read).
struct PanelGroups {
  const uint8_t* panel;
};

struct WidenedPanel {
  const uint8_t* panel;
  const uint16_t* pairs;
};

// The passes of a product over block panels, for a `Kernel` that names its `Problem` (rows
// rounded to bf16: M, K, ...), its `kGroupBytes`, `micro<MR, NP>(pb, row, sources, p)` for
// MR (1 to kBlockPassRows) rows from `row` over the NP panels at `sources` (the first one
// panel p), from `PanelGroups` and from `WidenedPanel`s alike, and `widen(panel, K, pairs)`.
template <typename Kernel, int NP, typename Source>
void block_pass(const typename Kernel::Problem& pb, int64_t m, int64_t mr, const Source* sources,
                int64_t p) {
  switch (mr) {
    case 8: Kernel::template micro<8, NP>(pb, m, sources, p); break;
    case 7: Kernel::template micro<7, NP>(pb, m, sources, p); break;
    case 6: Kernel::template micro<6, NP>(pb, m, sources, p); break;
    case 5: Kernel::template micro<5, NP>(pb, m, sources, p); break;
    case 4: Kernel::template micro<4, NP>(pb, m, sources, p); break;
    case 3: Kernel::template micro<3, NP>(pb, m, sources, p); break;
    case 2: Kernel::template micro<2, NP>(pb, m, sources, p); break;
    default: Kernel::template micro<1, NP>(pb, m, sources, p); break;
  }
}

// All of a few rows (one pass) over panels [p0, p1), widened in registers NP at a time.
template <typename Kernel, int NP>
void block_few_rows(const typename Kernel::Problem& pb, const uint8_t* panels, int64_t panel_bytes,
                    int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) {
    PanelGroups sources[NP];
    for (int j = 0; j < NP; ++j) sources[j] = {panels + (p + j) * panel_bytes};
    block_pass<Kernel, NP>(pb, 0, pb.M, sources, p);
  }
  for (; p < p1; ++p) {
    const PanelGroups source{panels + p * panel_bytes};
    block_pass<Kernel, 1>(pb, 0, pb.M, &source, p);
  }
}

// Many rows over panels [p0, p1): a chunk of rows at a time, two panels (or a last one)
// widened once per chunk into the thread's bf16 panels and every pass of the chunk multiplied
// over them.
template <typename Kernel>
void block_many_rows(const typename Kernel::Problem& pb, const uint8_t* panels, int64_t panel_bytes,
                     int64_t p0, int64_t p1) {
  const int64_t panel_size = pb.K / 2 * kBf16PairWidth;
  const auto pairs = scratch<uint16_t>(2 * panel_size);
  const int64_t chunk = chunk_rows(pb.K * 2, kBlockChunkBytes, kBlockPassRows);
  for (int64_t m0 = 0; m0 < pb.M; m0 += chunk) {
    const int64_t rows = std::min(chunk, pb.M - m0);
    for (int64_t p = p0; p < p1; p += 2) {
      const bool two = p + 1 < p1;
      const WidenedPanel sources[2] = {{panels + p * panel_bytes, pairs.get()},
                                       {panels + (p + 1) * panel_bytes, pairs.get() + panel_size}};
      Kernel::widen(sources[0].panel, pb.K, pairs.get());
      if (two) Kernel::widen(sources[1].panel, pb.K, pairs.get() + panel_size);
      near_equal_passes(m0, rows, kBlockPassRows, [&](int64_t m, int64_t mr) {
        if (two) block_pass<Kernel, 2>(pb, m, mr, sources, p);
        else block_pass<Kernel, 1>(pb, m, mr, sources, p);
      });
    }
  }
}

// Every row over panels [p0, p1): a few rows widen in registers (four panels at a time for up
// to 2 rows, else two), more widen each panel once.
template <typename Kernel>
void block_panels(const typename Kernel::Problem& pb, const uint8_t* panels, int64_t p0,
                  int64_t p1) {
  const int64_t panel_bytes = pb.K / kBlock * Kernel::kGroupBytes;
  if (pb.M <= 2) block_few_rows<Kernel, 4>(pb, panels, panel_bytes, p0, p1);
  else if (pb.M <= kBlockPassRows) block_few_rows<Kernel, 2>(pb, panels, panel_bytes, p0, p1);
  else block_many_rows<Kernel>(pb, panels, panel_bytes, p0, p1);
}

// The product over all `count` panels, split over torch's threads.
template <typename Kernel>
void block_product(const typename Kernel::Problem& pb, const uint8_t* panels, int64_t count) {
  at::parallel_for(0, count, 4,
                   [&](int64_t p0, int64_t p1) { block_panels<Kernel>(pb, panels, p0, p1); });
}

// 16 sums plus bias (if any) as output columns n0.. of row `row` of out [rows, N]: all 16, or
// those below N.
CONVEYOR_INLINE void store_block_columns(__m512 values, const float* bias, float* out, int64_t N,
                                         int64_t row, int64_t n0) {
  if (bias != nullptr) values = _mm512_add_ps(values, _mm512_loadu_ps(bias + n0));
  const __mmask16 mask = n0 + kPanel <= N ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
  _mm512_mask_storeu_ps(out + row * N + n0, mask, values);
}
#endif

}  // namespace conveyor
