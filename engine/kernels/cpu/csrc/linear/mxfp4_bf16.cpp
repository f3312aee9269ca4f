// MXFP4 block panels (`block_panels.h`) times rows rounded to bf16, in AVX-512 BF16 dot
// products: the experts of a bf16 model served from an MXFP4 checkpoint (gpt-oss as published)
// keep the checkpoint's 0.53 bytes a weight and multiply at the bf16 panels' rate.
//
// x       [rows, in]                 fp32, contiguous (in a multiple of 32), each row rounded
//                                    to bf16 as the bf16 panels round theirs (`bf16_round.h`)
// panels  [ceil(out / 16), in / 32, 272] uint8: MXFP4 block panels, one group per 32 input
//                                    features of 16 columns (16 E8M0 scale bytes, then 8 bytes
//                                    of codes per input feature), every scale byte from 2 to
//                                    252 (`PanelLinear.multiply_in_bf16` checks)
// bias    [panels * 16]              fp32, optional, zero-padded like the panels
//
// A weight, level * 2^(e - 128) (the level GGUF's doubled E2M1 value: 0, 1, 2, 3, 4, 6, 8, 12
// and their negatives), is exact in bf16 for those scale bytes: each pair of a group's input
// features widens in registers to the 32 bf16 weights a bf16 panel holds there, the codes put
// in pair order (a byte shuffle) and looked up as the levels' bf16 bits (a 16-bit permute), e - 128
// added to the exponent of every nonzero level. `vdpbf16ps` then sums them as the bf16 panels'
// product does, pair after pair in input order, so the output equals to the bit the bf16
// panels' `vdpbf16ps` product over the same weights. More rows than one pass holds widen each
// panel once into a bf16 panel of the thread's own and multiply every pass over it, in the
// same operations: a row's result does not depend on its batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_panels.h"
#include "block_rows.h"
#include "ops.h"
#include "panel_passes.h"
#include "pass_split.h"
#include "scratch.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_MXFP4_BF16 1
#endif

namespace {

#ifdef CONVEYOR_MXFP4_BF16
using conveyor::kPanel;
using conveyor::MXFP4;

constexpr int64_t kGroupBytes = MXFP4::kGroupBytes;
constexpr int kScaleBytes = MXFP4::kScales;

constexpr int kPairs = conveyor::kBlockPairs;
constexpr int64_t kPairWidth = conveyor::kBf16PairWidth;

// The levels' bf16 bits by code (the top bit of a code is the sign).
alignas(64) constexpr uint16_t kLevels[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0,
                                              0x4100, 0x4140, 0x8000, 0xBF80, 0xC000, 0xC040,
                                              0xC080, 0xC0C0, 0xC100, 0xC140};
// Lane 2i and 2i + 1 of a pair take column i's scale.
alignas(64) constexpr uint16_t kColumnOfLane[32] = {0,  0,  1,  1,  2,  2,  3,  3,  4,  4,  5,
                                                    5,  6,  6,  7,  7,  8,  8,  9,  9,  10, 10,
                                                    11, 11, 12, 12, 13, 13, 14, 14, 15, 15};

struct Problem {
  const uint16_t* x;  // rows rounded to bf16
  const float* bias;
  float* out;
  int64_t M, K, N;
};

// The tables a pass widens codes with, loaded once.
struct Tables {
  __m128i interleave;
  __m512i levels, columns;
  static Tables load() {
    return {_mm_load_si128(reinterpret_cast<const __m128i*>(conveyor::kNibbleInterleave)),
            _mm512_load_si512(kLevels), _mm512_load_si512(kColumnOfLane)};
  }
};

// A group's scale bytes as what each lane of a pair adds to a bf16 level's bits: e - 128 in
// its exponent field.
CONVEYOR_INLINE __m512i exponent_steps(const uint8_t* group, const Tables& t) {
  const __m256i e = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
  const __m256i steps = _mm256_slli_epi16(_mm256_sub_epi16(e, _mm256_set1_epi16(128)), 7);
  return _mm512_permutexvar_epi16(t.columns, _mm512_castsi256_si512(steps));
}

// One pair of a group's input features (16 bytes of codes) as the 32 bf16 weights of a bf16
// panel's pair: the codes interleaved, so that their low halves (columns 0 to 7) and then their
// high halves (8 to 15) are in pair order, looked up as levels, and their exponents stepped by
// the group's scales (zeros stay zero).
CONVEYOR_INLINE __m512i pair_weights(const uint8_t* codes, __m512i steps, const Tables& t) {
  const __m512i levels =
      _mm512_permutexvar_epi16(conveyor::nibble_pair(codes, t.interleave), t.levels);
  const __mmask32 nonzero = _mm512_test_epi16_mask(levels, _mm512_set1_epi16(0x7FFF));
  return _mm512_mask_add_epi16(levels, nonzero, levels, steps);
}

// A panel's weights widened into a bf16 panel [in / 2, 32], as `pair_weights` gives them.
void widen(const uint8_t* panel, int64_t K, uint16_t* pairs) {
  const Tables t = Tables::load();
  for (int64_t b = 0; b < K / MXFP4::kBlock; ++b) {
    const uint8_t* group = panel + b * kGroupBytes;
    const __m512i steps = exponent_steps(group, t);
    for (int i = 0; i < kPairs; ++i)
      _mm512_storeu_si512(pairs + (b * kPairs + i) * kPairWidth,
                          pair_weights(group + kScaleBytes + i * 16, steps, t));
  }
}

// acc[m][j] += row m's pair k times weights w[j], for MR rows.
template <int MR, int NP>
CONVEYOR_INLINE void madd_pair(__m512 (&acc)[MR][NP], const uint16_t* x, int64_t K, int64_t k,
                               const __m512i (&w)[NP]) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    int32_t pair;
    std::memcpy(&pair, x + m * K + 2 * k, 4);
    const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, reinterpret_cast<__m512bh>(w[j]));
  }
}

template <int MR, int NP>
CONVEYOR_INLINE void store_rows(const __m512 (&acc)[MR][NP], const Problem& pb, int64_t row,
                                int64_t p) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      conveyor::store_block_columns(acc[m][j], pb.bias, pb.out, pb.N, row + m, (p + j) * kPanel);
}

// Rows [row, row + MR) times the NP panels at `sources` (the first one panel p), widened in
// registers group by group.
template <int MR, int NP>
__attribute__((noinline)) void micro(const Problem& pb, int64_t row,
                                     const conveyor::PanelGroups* sources, int64_t p) {
  const Tables t = Tables::load();
  __m512 acc[MR][NP];
  conveyor::zero_sums(acc);
  const uint16_t* x = pb.x + row * pb.K;
  for (int64_t b = 0; b < pb.K / MXFP4::kBlock; ++b) {
    __m512i steps[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) steps[j] = exponent_steps(sources[j].panel + b * kGroupBytes, t);
    for (int i = 0; i < kPairs; ++i) {
      __m512i w[NP];
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j)
        w[j] = pair_weights(sources[j].panel + b * kGroupBytes + kScaleBytes + i * 16, steps[j], t);
      madd_pair(acc, x, pb.K, b * kPairs + i, w);
    }
  }
  store_rows(acc, pb, row, p);
}

// Rows [row, row + MR) times the NP widened panels at `sources` (the first one panel p).
template <int MR, int NP>
__attribute__((noinline)) void micro(const Problem& pb, int64_t row,
                                     const conveyor::WidenedPanel* sources, int64_t p) {
  __m512 acc[MR][NP];
  conveyor::zero_sums(acc);
  const uint16_t* x = pb.x + row * pb.K;
  for (int64_t k = 0; k < pb.K / 2; ++k) {
    __m512i w[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) w[j] = _mm512_loadu_si512(sources[j].pairs + k * kPairWidth);
    madd_pair(acc, x, pb.K, k, w);
  }
  store_rows(acc, pb, row, p);
}

// The product's passes (`block_rows.h`) over these micro kernels.
struct Mxfp4Kernel {
  using Problem = ::Problem;
  static constexpr int64_t kGroupBytes = ::kGroupBytes;
  template <int MR, int NP, typename Source>
  static void micro(const Problem& pb, int64_t row, const Source* sources, int64_t p) {
    ::micro<MR, NP>(pb, row, sources, p);
  }
  static void widen(const uint8_t* panel, int64_t K, uint16_t* pairs) { ::widen(panel, K, pairs); }
};
#endif

}  // namespace

namespace conveyor {

at::Tensor mxfp4_bf16_linear(const at::Tensor& x, const at::Tensor& panels,
                             const c10::optional<at::Tensor>& bias, int64_t out_features) {
#ifndef CONVEYOR_MXFP4_BF16
  TORCH_CHECK(false, "mxfp4_bf16_linear needs AVX-512 BF16");
#else
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kByte &&
                  panels.size(2) == kGroupBytes && panels.is_contiguous(),
              "mxfp4_bf16_linear: panels must be contiguous uint8 MXFP4 block panels [panels, "
              "in / 32, ",
              kGroupBytes, "]");
  const float* b = checked_block_inputs("mxfp4_bf16_linear", x, panels, bias, out_features);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, out_features}, x.options());
  if (M == 0) return out;
  const auto rounded = bf16_rows(x);
  const Problem pb{rounded.get(), b, out.data_ptr<float>(), M, K, out_features};
  block_product<Mxfp4Kernel>(pb, panels.data_ptr<uint8_t>(), panels.size(0));
  return out;
#endif
}

void mxfp4_take_tasks(const uint16_t* x, const float* bias, float* out, int64_t M, int64_t K,
                      int64_t N, const uint8_t* panels, const std::vector<ProductTask>& tasks,
                      std::atomic<int64_t>& next) {
#ifndef CONVEYOR_MXFP4_BF16
  TORCH_CHECK(false, "MXFP4 products need AVX-512 BF16");
#else
  const Problem pb{x, bias, out, M, K, N};
  take_runs(tasks, next,
            [&](int64_t p0, int64_t p1) { block_panels<Mxfp4Kernel>(pb, panels, p0, p1); });
#endif
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("mxfp4_bf16_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("mxfp4_bf16_linear", &conveyor::mxfp4_bf16_linear); }
