// GGUF block panels (`block_panels.h`: Q4_1, Q8_0, Q4_K, Q6_K, Q8_K) times rows rounded to
// bf16, in AVX-512 BF16 dot products: a bf16 model's quantized layers keep their blocks (0.6 to
// 1.4 bytes a weight instead of bf16's 2) and multiply at about the bf16 panels' rate.
//
// x       [rows, in]                   fp32, contiguous (in a multiple of 32), each row rounded
//                                      to bf16 as the bf16 panels round theirs (`bf16_round.h`)
// panels  [ceil(out / 16), in / 32, group] uint8: block panels of one of those formats
// bias    [panels * 16]                fp32, optional, zero-padded like the panels
//
// A block's weights are d * q + m (Q6_K and Q8_K: a d for each half of the block), with q a
// small integer, exact in bf16. So each row's product over a block is d * sum(x q) + m *
// sum(x): the q of each pair of input features widen in registers to bf16 (nibbles: a byte
// shuffle into pair order and a lookup; bytes: interleaved and converted through fp32), a chain
// of `vdpbf16ps` sums x q over the block (or each half), and one fused multiply-add per scale
// adds it times d, and the row's sum of the block's rounded x times m, into the running sums.
// The weights are exact, so the product is within fp32 summation of the exact product of the
// rounded rows: closer than bf16 panels of the same weights, which round the weights too. More
// rows than one pass holds widen each panel's q once into a buffer of the thread's own and
// multiply every pass over it in the same operations: a row's result does not depend on its
// batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "block_panels.h"
#include "block_rows.h"
#include "ops.h"
#include "panel_passes.h"
#include "pass_split.h"
#include "scratch.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_BLOCK_BF16 1
#endif

namespace {

#ifdef CONVEYOR_BLOCK_BF16
using conveyor::kBlock;
using conveyor::kPanel;

constexpr int kPairs = conveyor::kBlockPairs;
constexpr int64_t kPairWidth = conveyor::kBf16PairWidth;

// 0 to 15 as bf16 bits, by value.
alignas(64) constexpr uint16_t kSmallInts[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0,
                                                 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130,
                                                 0x4140, 0x4150, 0x4160, 0x4170};
// A format as this product reads it: where its q start, whether they are nibbles, whether a
// minimum m is added, and how many halves of a block have their own d; `scales` loads d (one
// vector per half) and m as fp32.
struct Q41 {
  static constexpr int64_t kGroupBytes = conveyor::Q41::kGroupBytes, kCodes = 64;
  static constexpr bool kNibbles = true, kMin = true;
  static constexpr int kHalves = 1;
  static CONVEYOR_INLINE void scales(const uint8_t* g, __m512* d, __m512& m) {
    d[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32)));
  }
};

struct Q80 {
  static constexpr int64_t kGroupBytes = conveyor::Q80::kGroupBytes, kCodes = 32;
  static constexpr bool kNibbles = false, kMin = false;
  static constexpr int kHalves = 1;
  static CONVEYOR_INLINE void scales(const uint8_t* g, __m512* d, __m512&) {
    d[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
  }
};

struct Q4K {
  static constexpr int64_t kGroupBytes = conveyor::Q4K::kGroupBytes, kCodes = 128;
  static constexpr bool kNibbles = true, kMin = true;
  static constexpr int kHalves = 1;
  static CONVEYOR_INLINE void scales(const uint8_t* g, __m512* d, __m512& m) {
    d[0] = _mm512_loadu_ps(g);
    m = _mm512_loadu_ps(g + 64);
  }
};

struct Q6K {
  static constexpr int64_t kGroupBytes = conveyor::Q6K::kGroupBytes, kCodes = 128;
  static constexpr bool kNibbles = false, kMin = false;
  static constexpr int kHalves = 2;
  static CONVEYOR_INLINE void scales(const uint8_t* g, __m512* d, __m512&) {
    d[0] = _mm512_loadu_ps(g);
    d[1] = _mm512_loadu_ps(g + 64);
  }
};

struct Q8K {
  static constexpr int64_t kGroupBytes = conveyor::Q8K::kGroupBytes, kCodes = 192;
  static constexpr bool kNibbles = false, kMin = true;
  static constexpr int kHalves = 2;
  static CONVEYOR_INLINE void scales(const uint8_t* g, __m512* d, __m512& m) {
    d[0] = _mm512_loadu_ps(g);
    d[1] = _mm512_loadu_ps(g + 64);
    m = _mm512_loadu_ps(g + 128);
  }
};

// Pair i of a group's q as the 32 bf16 values of a bf16 panel's pair (lane 2c + s: column c of
// input feature 2i + s).
template <typename F>
CONVEYOR_INLINE __m512i pair_q(const uint8_t* group, int i, __m512i small_ints,
                               __m128i interleave) {
  if constexpr (F::kNibbles) {
    const __m512i q = conveyor::nibble_pair(group + F::kCodes + 16 * i, interleave);
    return _mm512_permutexvar_epi16(q, small_ints);
  } else {
    const uint8_t* at = group + F::kCodes + 32 * i;
    const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(first, second)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(first, second)));
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
  }
}

struct Problem {
  const uint16_t* x;  // rows rounded to bf16
  const float* sums;  // [rows, in / 32]: each block's sum of a row's rounded x
  const float* bias;
  float* out;
  int64_t M, K, N;
};

// Rows [row, row + MR) times the NP panels at `sources` (the first one panel p): per block,
// each half's x q summed apart, then added times its d, and the block's x sums times m.
template <typename F, int MR, int NP, typename Source>
__attribute__((noinline)) void micro(const Problem& pb, int64_t row, const Source* sources,
                                     int64_t p) {
  const __m512i small_ints = _mm512_load_si512(kSmallInts);
  const __m128i interleave =
      _mm_load_si128(reinterpret_cast<const __m128i*>(conveyor::kNibbleInterleave));
  const int64_t groups = pb.K / kBlock;
  __m512 acc[MR][NP];
  conveyor::zero_sums(acc);
  const uint16_t* x = pb.x + row * pb.K;
  for (int64_t b = 0; b < groups; ++b) {
    __m512 d[NP][2], m[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) F::scales(sources[j].panel + b * F::kGroupBytes, d[j], m[j]);
#pragma GCC unroll 2
    for (int h = 0; h < F::kHalves; ++h) {
      __m512 part[MR][NP];
      conveyor::zero_sums(part);
      for (int i = h * kPairs / F::kHalves; i < (h + 1) * kPairs / F::kHalves; ++i) {
        __m512bh w[NP];
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) {
          if constexpr (std::is_same_v<Source, conveyor::WidenedPanel>)
            w[j] = reinterpret_cast<__m512bh>(
                _mm512_loadu_si512(sources[j].pairs + (b * kPairs + i) * kPairWidth));
          else
            w[j] = reinterpret_cast<__m512bh>(
                pair_q<F>(sources[j].panel + b * F::kGroupBytes, i, small_ints, interleave));
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + r * pb.K + b * kBlock + 2 * i, 4);
          const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 8
          for (int j = 0; j < NP; ++j) part[r][j] = _mm512_dpbf16_ps(part[r][j], xb, w[j]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(part[r][j], d[j][h], acc[r][j]);
    }
    if constexpr (F::kMin) {
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 sum = _mm512_set1_ps(pb.sums[(row + r) * groups + b]);
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(sum, m[j], acc[r][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      conveyor::store_block_columns(acc[r][j], pb.bias, pb.out, pb.N, row + r, (p + j) * kPanel);
}

// A panel's q widened into `pairs` [in / 2, 32], as `pair_q` gives them.
template <typename F>
void widen(const uint8_t* panel, int64_t K, uint16_t* pairs) {
  const __m512i small_ints = _mm512_load_si512(kSmallInts);
  const __m128i interleave =
      _mm_load_si128(reinterpret_cast<const __m128i*>(conveyor::kNibbleInterleave));
  for (int64_t b = 0; b < K / kBlock; ++b)
    for (int i = 0; i < kPairs; ++i)
      _mm512_storeu_si512(pairs + (b * kPairs + i) * kPairWidth,
                          pair_q<F>(panel + b * F::kGroupBytes, i, small_ints, interleave));
}

// The product's passes (`block_rows.h`) over format F's micro kernel.
template <typename F>
struct BlockKernel {
  using Problem = ::Problem;
  static constexpr int64_t kGroupBytes = F::kGroupBytes;
  template <int MR, int NP, typename Source>
  static void micro(const Problem& pb, int64_t row, const Source* sources, int64_t p) {
    ::micro<F, MR, NP>(pb, row, sources, p);
  }
  static void widen(const uint8_t* panel, int64_t K, uint16_t* pairs) {
    ::widen<F>(panel, K, pairs);
  }
};

// visit(Kernel{}) for the product's kernel of the format this group size names (checked by the
// callers).
template <typename Visit>
void with_format(int64_t group, Visit&& visit) {
  switch (group) {
    case Q41::kGroupBytes: visit(BlockKernel<Q41>{}); return;
    case Q80::kGroupBytes: visit(BlockKernel<Q80>{}); return;
    case Q4K::kGroupBytes: visit(BlockKernel<Q4K>{}); return;
    case Q6K::kGroupBytes: visit(BlockKernel<Q6K>{}); return;
    default: visit(BlockKernel<Q8K>{}); return;
  }
}

// The product over panels of whichever format their group size names (checked by the op).
void run_format(const Problem& pb, const at::Tensor& panels) {
  with_format(panels.size(2), [&](auto kernel) {
    conveyor::block_product<decltype(kernel)>(pb, panels.data_ptr<uint8_t>(), panels.size(0));
  });
}

// Each row's sum of each block of 32 rounded inputs (`block_row_sums`).
void block_sums(const uint16_t* x, int64_t M, int64_t K, float* sums) {
  at::parallel_for(0, M, conveyor::rows_per_task(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      conveyor::block_row_sums(x + m * K, K, sums + m * (K / kBlock));
  });
}
#endif

}  // namespace

namespace conveyor {

void block_row_sums(const uint16_t* row, int64_t K, float* sums) {
#ifndef CONVEYOR_BLOCK_BF16
  TORCH_CHECK(false, "block sums need AVX-512 BF16");
#else
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint16_t* at = row + b * kBlock;
    const __m512 low = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))), 16));
    const __m512 high = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 16))), 16));
    sums[b] = _mm512_reduce_add_ps(_mm512_add_ps(low, high));
  }
#endif
}

void bf16_block_take_tasks(const uint16_t* x, const float* sums, const float* bias, float* out,
                           int64_t M, int64_t K, int64_t N, const at::Tensor& panels,
                           const std::vector<ProductTask>& tasks, std::atomic<int64_t>& next) {
#ifndef CONVEYOR_BLOCK_BF16
  TORCH_CHECK(false, "block products in bf16 need AVX-512 BF16");
#else
  const uint8_t* w = panels.data_ptr<uint8_t>();
  if (panels.size(2) == MXFP4::kGroupBytes) {
    mxfp4_take_tasks(x, bias, out, M, K, N, w, tasks, next);
    return;
  }
  const ::Problem pb{x, sums, bias, out, M, K, N};
  with_format(panels.size(2), [&](auto kernel) {
    take_runs(tasks, next,
              [&](int64_t p0, int64_t p1) { block_panels<decltype(kernel)>(pb, w, p0, p1); });
  });
#endif
}

at::Tensor block_bf16_linear(const at::Tensor& x, const at::Tensor& panels,
                             const c10::optional<at::Tensor>& bias, int64_t out_features) {
#ifndef CONVEYOR_BLOCK_BF16
  TORCH_CHECK(false, "block_bf16_linear needs AVX-512 BF16");
#else
  const int64_t group = panels.dim() == 3 ? panels.size(2) : 0;
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.is_contiguous() &&
                  (group == conveyor::Q41::kGroupBytes || group == conveyor::Q80::kGroupBytes ||
                   group == conveyor::Q4K::kGroupBytes || group == conveyor::Q6K::kGroupBytes ||
                   group == conveyor::Q8K::kGroupBytes),
              "block_bf16_linear: panels must be contiguous uint8 block panels [panels, in / 32, ",
              Q41::kGroupBytes, " (Q4_1), ", Q80::kGroupBytes, " (Q8_0), ", Q4K::kGroupBytes,
              " (Q4_K), ", Q6K::kGroupBytes, " (Q6_K) or ", Q8K::kGroupBytes, " (Q8_K)]");
  const float* b = checked_block_inputs("block_bf16_linear", x, panels, bias, out_features);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, out_features}, x.options());
  if (M == 0) return out;
  const auto rounded = bf16_rows(x);
  const auto sums = scratch<float>(M * (K / kBlock));
  block_sums(rounded.get(), M, K, sums.get());
  const Problem pb{rounded.get(), sums.get(), b, out.data_ptr<float>(), M, K, out_features};
  run_format(pb, panels);
  return out;
#endif
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("block_bf16_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("block_bf16_linear", &conveyor::block_bf16_linear); }
