// Linear layers over bf16 weights on CPUs with AVX-512 BF16 dot products or AMX tiles:
// y = x w^T + bias with x, bias and y in fp32, each row of x rounded to bf16 (to nearest, ties
// to even, as torch rounds) and every product summed in fp32. `panel_linear` checks the inputs
// and calls this product for bf16 panels.
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
//
// On CPUs with AMX-BF16 the products run in tiles instead (`tile_task`), wherever the input
// features are a multiple of 32: a panel's 16 pairs of input features are one tile as the panel
// lays them out, 16 rows of x another, and one `tdpbf16ps` adds their 8192 multiply-adds into a
// tile of 16 x 16 fp32 sums. Two blocks of 16 rows by two panels at a time (four tiles of sums);
// a last block of a few rows is copied into a block of 16 of the thread's own. The default
// model's products ran 3-5x faster than in `vdpbf16ps` on 2 cores of a Xeon with AMX, from 16
// rows to 2048. The tiles round their sums apart from `vdpbf16ps` in the last bits, so the
// choice is one per process (never per batch) and a row's result still does not depend on its
// batch.
//
// `panel_argmax` is a product that writes no output: as each panel's sums leave the registers
// they go to the thread's best of their row (`fused_argmax.h`), and the threads' bests give each
// row's argmax as torch takes it over the whole output, for a greedy LM head that never writes
// its logits.
//
// `gated_linear` is the gated MLP's gate and up projections and activation in one op: panels
// [ceil(inter / 16), 2, in / 2, 32] hold each gate panel followed by the up panel of the same
// columns, bias [panels * 2 * 16] likewise, and each pair's sums give out [rows, inter] =
// silu(gate) * up as they leave the registers (or gelu(gate) * up under tanh's approximation,
// or gpt-oss's clamped SwiGLU), equal to the bit to `panel_linear` over the gate/up projection
// followed by `silu_mul` (`gelu_tanh_mul`, `clamped_swiglu_mul`): the activation's pass over
// memory and the
// projection's second half of output are gone. With `bf16_out` it writes those rows rounded to
// bf16, as a bf16 product rounds its input, and the down projection's product takes them as
// they are (`bf16_rows_product`): half the bytes written, and no rounding pass over fp32 rows
// (a prefill of 16 prompts of 128 tokens about 2-3% shorter).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx_tiles.h"
#include "bf16_round.h"
#include "fast_exp.h"
#include "ops.h"
#include "panel_passes.h"
#include "fused_argmax.h"
#include "scratch.h"
#include "pass_split.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CONVEYOR_BF16_PANELS 1
#endif

namespace {

// Whether the products run in AMX tiles (`tile_task`) rather than `vdpbf16ps`: on by default
// where the tiles are granted; `set_bf16_tiles` turns them off and on (tests and benchmarks
// compare both in one process).
std::atomic<bool> tiles_wanted{true};

#ifdef CONVEYOR_BF16_PANELS
using conveyor::chunk_rows;
using conveyor::kPanel;
using conveyor::near_equal_passes;

// Rows of x handled per pass over the weight: about this many bytes of bf16 rows, kept in L2.
constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int kMaxRows = 8;
// Panels one row runs over at once (enough independent sums for one row).
constexpr int kOneRowPanels = 8;
// bf16 values a panel holds per pair of input features.
constexpr int64_t kPairWidth = 2 * kPanel;

// x rounded to bf16, row by row: [rows, K] as 16-bit patterns.
conveyor::Scratch<uint16_t> round_rows(const float* x, int64_t M, int64_t K) {
  auto rounded = conveyor::scratch<uint16_t>(M * K);
  at::parallel_for(0, M, conveyor::rows_per_task(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) conveyor::round_to_bf16(x + m * K, K, rounded.get() + m * K);
  });
  return rounded;
}

// An op's input rows as its product takes them: bf16 rows as they are (the ones rounding fp32
// rows would give), fp32 rows rounded into `rounded`.
struct InputRows {
  conveyor::Scratch<uint16_t> rounded;
  const uint16_t* rows;
};

InputRows input_rows(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16)
    return {nullptr, reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>())};
  InputRows in{round_rows(x.data_ptr<float>(), x.size(0), x.size(1)), nullptr};
  in.rows = in.rounded.get();
  return in;
}

// x must be contiguous fp32 or bf16 rows [rows, in].
void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.is_contiguous(),
              op, ": x must be contiguous fp32 (or bf16) [rows, in]");
}

// The bias, where given: fp32 [values], as the panels hold it (zero-padded); else null.
const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t values, const char* op) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == values && bias->scalar_type() == at::kFloat &&
                  bias->is_contiguous(),
              op, ": bias must be fp32 [", values, "], zero-padded as the panels hold it");
  return bias->data_ptr<float>();
}

using Problem = conveyor::Bf16Product;
using Task = conveyor::ProductTask;

// What becomes of a pass's sums: each panel's 16 sums plus bias are its 16 output columns
// (plain); or the panels come in gate/up pairs, and the pair's sums plus bias give the 16
// columns of silu(gate) * up (gated); or each panel's sums plus bias go to the thread's best of
// their row (argmax: a greedy choice, with no output written).
enum class Epilogue { kPlain, kGated, kArgmax };

CONVEYOR_INLINE __m512 with_bias(__m512 sum, const Problem& pb, int64_t panel) {
  if (pb.bias == nullptr) return sum;
  return _mm512_add_ps(sum, _mm512_loadu_ps(pb.bias + panel * kPanel));
}

// 16 values (plus the residual's, if any) as output columns n0.. of one row: all 16, or those
// below N; to out16 rounded to bf16 as `round_rows` rounds, where the product writes bf16 rows.
CONVEYOR_INLINE void store_columns(__m512 values, const Problem& pb, int64_t row, int64_t n0) {
  const int64_t at = row * pb.N + n0;
  if (pb.out16 != nullptr) {
    const __m256bh half = _mm512_cvtneps_pbh(values);
    const __mmask16 mask =
        n0 + kPanel <= pb.N ? __mmask16(0xFFFF) : __mmask16((1u << (pb.N - n0)) - 1);
    _mm256_mask_storeu_epi16(pb.out16 + at, mask, reinterpret_cast<const __m256i&>(half));
    return;
  }
  if (n0 + kPanel <= pb.N) {
    if (pb.residual != nullptr) values = _mm512_add_ps(values, _mm512_loadu_ps(pb.residual + at));
    _mm512_storeu_ps(pb.out + at, values);
    return;
  }
  const __mmask16 mask = __mmask16((1u << (pb.N - n0)) - 1);
  if (pb.residual != nullptr)
    values = _mm512_add_ps(values, _mm512_maskz_loadu_ps(mask, pb.residual + at));
  _mm512_mask_storeu_ps(pb.out + at, mask, values);
}

CONVEYOR_INLINE __m256 upper8(__m512 v) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

CONVEYOR_INLINE __m512 joined(__m256 low, __m256 high) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
}

// The activation of 16 gate and up sums, eight lanes at a time in the operations `silu_mul`
// (`gate_activation.h`) does, so the fused activation equals the product followed by it to the
// bit.
CONVEYOR_INLINE __m512 activated(__m512 gate, __m512 up, const conveyor::GateActivation& act) {
  return joined(act(_mm512_castps512_ps256(gate), _mm512_castps512_ps256(up)),
                act(upper8(gate), upper8(up)));
}

// One row's sums for NP panels from p (plus bias) through the epilogue E to its output columns.
template <int NP, Epilogue E>
CONVEYOR_INLINE void store_row(const Problem& pb, const __m512* sums, int64_t row, int64_t p) {
  if constexpr (E == Epilogue::kGated) {
    static_assert(NP % 2 == 0, "gated panels come in gate/up pairs");
#pragma GCC unroll 8
    for (int j = 0; j < NP; j += 2)
      store_columns(
          activated(with_bias(sums[j], pb, p + j), with_bias(sums[j + 1], pb, p + j + 1), pb.act),
          pb, row, (p + j) / 2 * kPanel);
  } else if constexpr (E == Epilogue::kArgmax) {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      conveyor::note_best(pb.best[row], with_bias(sums[j], pb, p + j), (p + j) * kPanel, pb.N);
  } else {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      store_columns(with_bias(sums[j], pb, p + j), pb, row, (p + j) * kPanel);
  }
}

// The output lines (and residual lines) rows [row, row + MR) store for panels [p, p + NP),
// asked for before the pass computes them: out of L2 when many rows are multiplied, they would
// otherwise miss as the pass stores its sums.
template <int MR, int NP, Epilogue E>
CONVEYOR_INLINE void ask_for_outputs(const Problem& pb, int64_t row, int64_t p) {
  if constexpr (E == Epilogue::kArgmax) return;
  constexpr int kColumnPanels = E == Epilogue::kGated ? NP / 2 : NP;
  const int64_t n0 = (E == Epilogue::kGated ? p / 2 : p) * kPanel;
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < kColumnPanels; ++j) {
      const int64_t at = (row + m) * pb.N + n0 + j * kPanel;
      if (pb.out16 != nullptr) {
        __builtin_prefetch(pb.out16 + at, 1, 3);
        continue;
      }
      __builtin_prefetch(pb.out + at, 1, 3);
      if (pb.residual != nullptr) __builtin_prefetch(pb.residual + at, 0, 3);
    }
}

// Rows [row, row + MR) times panels [p, p + NP), through the epilogue E to out. With `Fetch`,
// one line of each of the NP panels at `ahead` is asked for every `every` pairs, from `ahead` on.
template <int MR, int NP, bool Fetch = false, Epilogue E = Epilogue::kPlain>
__attribute__((noinline)) void micro(const Problem& pb, int64_t row, const uint16_t* panels,
                                     int64_t p, const uint16_t* ahead = nullptr,
                                     int64_t every = 1) {
  const int64_t pairs = pb.K / 2, panel_size = pairs * kPairWidth;
  // The argmax stores no rows: its next panels' lines come all the way into L1 (the default
  // model's LM head 3-4% shorter at 64 rows and 5-8% at 16). Products that store rows keep them
  // in L2: in L1 decode steps measured no shorter at 64 rows and longer at 16.
  constexpr int kLocality = E == Epilogue::kArgmax ? 3 : 2;
  const uint16_t* x = pb.x + row * pb.K;
  const uint16_t* w = panels + p * panel_size;
  ask_for_outputs<MR, NP, E>(pb, row, p);
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t countdown = 1;
  for (int64_t k = 0; k < pairs; ++k) {
    if constexpr (Fetch) {
      if (--countdown == 0) {
        countdown = every;
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) __builtin_prefetch(ahead + j * panel_size, 0, kLocality);
        ahead += kPairWidth;
      }
    }
    __m512bh wv[NP];
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j)
      wv[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + j * panel_size + k * kPairWidth));
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
  for (int m = 0; m < MR; ++m) store_row<NP, E>(pb, acc[m], row + m, p);
}

// One pass of mr (1 to kMaxRows) rows from m over NP panels from p.
template <int NP, bool Fetch, Epilogue E>
void rows_pass(const Problem& pb, int64_t m, int64_t mr, const uint16_t* panels, int64_t p,
               const uint16_t* ahead, int64_t every) {
  switch (mr) {
    case 8: micro<8, NP, Fetch, E>(pb, m, panels, p, ahead, every); break;
    case 7: micro<7, NP, Fetch, E>(pb, m, panels, p, ahead, every); break;
    case 6: micro<6, NP, Fetch, E>(pb, m, panels, p, ahead, every); break;
    case 5: micro<5, NP, Fetch, E>(pb, m, panels, p, ahead, every); break;
    case 4: micro<4, NP, Fetch, E>(pb, m, panels, p, ahead, every); break;
    case 3: micro<3, NP, Fetch, E>(pb, m, panels, p, ahead, every); break;
    case 2: micro<2, NP, Fetch, E>(pb, m, panels, p, ahead, every); break;
    default: micro<1, NP, Fetch, E>(pb, m, panels, p, ahead, every); break;
  }
}

// Rows [m0, m0 + rows) times NP panels from p, in passes of at most kMaxRows rows, which fetch
// the NP panels at `ahead` (if any) into the caches for the next call, each pass an equal share
// of their lines spread over its pairs. The first pass alone asking for all of them left memory
// idle while the others ran (the default model's layers at 16 rows: 18.0 to 17.0 ms from this
// alone); fetching at any number of rows, not only up to 32, took them from 49.1 to 42.3 ms at
// 48 rows and from 56.9 to 51.2 at 64.
template <int NP, Epilogue E>
void rows_by_panels(const Problem& pb, int64_t m0, int64_t rows, const uint16_t* panels, int64_t p,
                    const uint16_t* ahead) {
  const int64_t passes = (rows + kMaxRows - 1) / kMaxRows, pairs = pb.K / 2;
  int64_t pass = 0;
  near_equal_passes(m0, rows, kMaxRows, [&](int64_t m, int64_t mr) {
    if (ahead != nullptr) {
      rows_pass<NP, true, E>(pb, m, mr, panels, p, ahead + pass++ * pairs / passes * kPairWidth,
                             passes);
    } else {
      rows_pass<NP, false, E>(pb, m, mr, panels, p, nullptr, 1);
    }
  });
}

// Panels taken together at the least: gated panels go in gate/up pairs.
template <Epilogue E>
constexpr int kUnit = E == Epilogue::kGated ? 2 : 1;

#ifdef CONVEYOR_AMX_TILES
using conveyor::kTileDepth;
using conveyor::kTileRows;
// Rows of x a tile pass holds: two tiles of 16.
constexpr int64_t kTileBlock = 2 * kTileRows;

bool tiles_usable() {
  return tiles_wanted.load(std::memory_order_relaxed) && conveyor::tiles_granted();
}

// A product over K input features runs in tiles: whole tile steps of 32 features.
bool tiles_take(int64_t K) { return K % kTileDepth == 0 && tiles_usable(); }

// One 16 x 16 tile of sums, as stored from its tile.
using TileSums = float[kTileRows * kPanel];

// Row m of the NP tiles of sums at `sums` (one block's), through the epilogue as output row `row`.
template <int NP, Epilogue E>
CONVEYOR_INLINE void store_tile_row(const Problem& pb, const TileSums* sums, int64_t row, int m,
                                    int64_t p) {
  __m512 values[NP];
#pragma GCC unroll 2
  for (int j = 0; j < NP; ++j) values[j] = _mm512_loadu_ps(sums[j] + m * kPanel);
  store_row<NP, E>(pb, values, row, p);
}

// RB blocks of 16 rows (at `blocks`, rows of K bf16 values each; the first `valid` rows of the
// RB * 16 are the product's, from `row` on) times NP panels from p: tile 4 + b holds block b's
// inputs, 6 + j panel j's pairs, and 2b + j their sums. Every sum runs over the tile steps in
// input order, whatever the rows around it, so a row's result does not depend on its batch.
// With `ahead`, each tile step asks for the same share of the NP panels there (the next ones),
// so that they come from memory while these multiply.
template <int RB, int NP, Epilogue E>
__attribute__((noinline)) void tile_micro(const Problem& pb, const uint16_t* const* blocks,
                                          int64_t row, int64_t valid, const uint16_t* panels,
                                          int64_t p, const uint16_t* ahead) {
  const int64_t panel_size = pb.K / 2 * kPairWidth, stride = pb.K * 2;
  const uint16_t* w = panels + p * panel_size;
  // Cache lines of one panel a tile step reads (16 pairs of 64 bytes).
  constexpr int kStepLines = kTileDepth / 2;
  _tile_zero(0);
  if constexpr (NP == 2) _tile_zero(1);
  if constexpr (RB == 2) _tile_zero(2);
  if constexpr (RB == 2 && NP == 2) _tile_zero(3);
  for (int64_t k = 0; k < pb.K; k += kTileDepth) {
    const uint16_t* pairs = w + k / 2 * kPairWidth;
    if (ahead != nullptr) {
#pragma GCC unroll 16
      for (int line = 0; line < kStepLines * NP; ++line)
        __builtin_prefetch(ahead + k / 2 * kPairWidth + line / kStepLines * panel_size +
                               line % kStepLines * kPairWidth,
                           0, 2);
    }
    _tile_loadd(4, blocks[0] + k, stride);
    _tile_loadd(6, pairs, kPairWidth * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NP == 2) {
      _tile_loadd(7, pairs + panel_size, kPairWidth * 2);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RB == 2) {
      _tile_loadd(5, blocks[1] + k, stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NP == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) TileSums sums[4];
  _tile_stored(0, sums[0], kPanel * 4);
  if constexpr (NP == 2) _tile_stored(1, sums[1], kPanel * 4);
  if constexpr (RB == 2) _tile_stored(2, sums[2], kPanel * 4);
  if constexpr (RB == 2 && NP == 2) _tile_stored(3, sums[3], kPanel * 4);
  for (int64_t m = 0; m < valid; ++m)
    store_tile_row<NP, E>(pb, sums + m / kTileRows * 2, row + m, m % kTileRows, p);
}

// A thread's own block of 16 rows for a task's last few, so that its tile reads 16 rows; kept
// from task to task and grown as needed. The rows past them are left as they are: a row of sums
// depends on its own row of inputs alone, and the sums of those rows are never stored. (Zeroing
// them at every task of a decode step of one row made it about a sixth longer.)
struct SpareBlock {
  conveyor::Scratch<uint16_t> rows;
  int64_t size = 0;

  const uint16_t* hold(const uint16_t* x, int64_t count, int64_t K) {
    if (size < kTileRows * K) {
      size = kTileRows * K;
      rows = conveyor::scratch<uint16_t>(size);
    }
    std::memcpy(rows.get(), x, count * K * 2);
    return rows.get();
  }
};

// A task's rows as blocks of 16: whole blocks in place, the last few in `spare`.
std::vector<const uint16_t*> tile_blocks(const Problem& pb, const Task& task, SpareBlock& spare) {
  std::vector<const uint16_t*> blocks;
  int64_t m = task.m0;
  for (; m + kTileRows <= task.m1; m += kTileRows) blocks.push_back(pb.x + m * pb.K);
  if (m < task.m1) blocks.push_back(spare.hold(pb.x + m * pb.K, task.m1 - m, pb.K));
  return blocks;
}

// NP panels from p over the task's blocks, two at a time; the first two ask for the NP panels
// after these, if the product has them.
template <int NP, Epilogue E>
void tile_panels(const Problem& pb, const std::vector<const uint16_t*>& blocks, const Task& task,
                 const uint16_t* panels, int64_t p, int64_t count) {
  const int64_t blocks_count = static_cast<int64_t>(blocks.size());
  const uint16_t* next =
      p + 2 * NP <= count ? panels + (p + NP) * (pb.K / 2 * kPairWidth) : nullptr;
  for (int64_t b = 0; b < blocks_count; b += 2) {
    const int64_t row = task.m0 + b * kTileRows;
    const int64_t valid = std::min(task.m1 - row, kTileBlock);
    const uint16_t* ahead = b == 0 ? next : nullptr;
    if (b + 1 < blocks_count)
      tile_micro<2, NP, E>(pb, blocks.data() + b, row, valid, panels, p, ahead);
    else tile_micro<1, NP, E>(pb, blocks.data() + b, row, valid, panels, p, ahead);
  }
}

// One task in tiles: each pair of its panels over all of its rows, two blocks at a time, so
// that the pair's weights come from memory once and from the caches for the other blocks.
template <Epilogue E>
void tile_task(const Problem& pb, const uint16_t* panels, const Task& task, int64_t count) {
  thread_local SpareBlock spare;
  const std::vector<const uint16_t*> blocks = tile_blocks(pb, task, spare);
  int64_t p = task.p0;
  for (; p + 2 <= task.p1; p += 2) tile_panels<2, E>(pb, blocks, task, panels, p, count);
  if constexpr (E != Epilogue::kGated) {
    if (p < task.p1) tile_panels<1, E>(pb, blocks, task, panels, p, count);
  }
}
#else
constexpr int64_t kTileBlock = kMaxRows;
bool tiles_take(int64_t) { return false; }
#endif

// A few rows (all of them in one pass) over panels [p0, p1), NP at a time, then a unit at a
// time.
template <int MR, int NP, Epilogue E>
void few_rows(const Problem& pb, const uint16_t* panels, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) micro<MR, NP, false, E>(pb, 0, panels, p);
  for (; p < p1; p += kUnit<E>) micro<MR, kUnit<E>, false, E>(pb, 0, panels, p);
}

// Panels the runs of a product's tasks come in: as many as one pass over that many rows takes
// at once (a run of fewer would leave a pass short of independent sums), in whole units.
template <Epilogue E>
int64_t run_group(int64_t rows) {
  const int64_t panels = rows == 1 ? kOneRowPanels : rows == 2 ? 4 : 2;
  return std::max<int64_t>(1, panels / kUnit<E>);
}

// The product's tasks in the order threads take them: a chunk of rows at a time (all rows, when
// a few rows go in one pass), and each chunk's units in runs a thread takes whole, each run
// 1 / (2 threads) of the units the chunk has left, so that runs shrink as the chunk nears its
// end and the threads finish close together. Runs of an equal eighth of a product each left
// up to a run's work on one thread at its end (the default model's output and down products,
// of 36 panels, went as 8 + 8 + 8 + 8 + 4: 20 panels to one thread, 16 to the other), and a
// run over every row of many rows was long: the default model's 121 layers took 4-8% longer
// from 1 to 2048 rows (its output and down products over 2048 rows 9-11%).
template <Epilogue E>
std::vector<Task> plan_tasks(int64_t M, int64_t K, int64_t units, int threads) {
  const int64_t rows =
      M <= 3 ? M : chunk_rows(K * 2, kChunkBytes, tiles_take(K) ? kTileBlock : kMaxRows);
  const int64_t group = run_group<E>(M), share = 2 * threads;
  std::vector<Task> tasks;
  for (int64_t m0 = 0; m0 < M; m0 += rows) {
    for (int64_t u0 = 0; u0 < units;) {
      const int64_t wanted = ((units - u0 + share - 1) / share + group - 1) / group * group;
      const int64_t u1 = std::min(units, u0 + wanted);
      tasks.push_back({m0, std::min(M, m0 + rows), u0 * kUnit<E>, u1 * kUnit<E>});
      u0 = u1;
    }
  }
  return tasks;
}

// One task: a few rows in one pass over its panels, NP at a time; or its rows over its panels
// two at a time, each two fetching the next two. Its last two fetch the first two of the task
// this thread takes next: `claim()` takes that task and returns them (null if there is none).
template <Epilogue E, typename Claim>
void task_product(const Problem& pb, const uint16_t* panels, const Task& task, Claim&& claim) {
  switch (pb.M) {
    case 1: few_rows<1, kOneRowPanels, E>(pb, panels, task.p0, task.p1); return;
    case 2: few_rows<2, 4, E>(pb, panels, task.p0, task.p1); return;
    case 3: few_rows<3, 2, E>(pb, panels, task.p0, task.p1); return;
  }
  const int64_t rows = task.m1 - task.m0, panel_size = pb.K / 2 * kPairWidth;
  int64_t p = task.p0;
  for (; p + 2 <= task.p1; p += 2) {
    const uint16_t* ahead = p + 4 <= task.p1 ? panels + (p + 2) * panel_size : claim();
    rows_by_panels<2, E>(pb, task.m0, rows, panels, p, ahead);
  }
  if constexpr (E != Epilogue::kGated) {
    if (p < task.p1) rows_by_panels<1, E>(pb, task.m0, rows, panels, p, nullptr);
  }
}

// This thread's part of the product's panels [0, count) through epilogue E: its tasks go to
// whichever thread is free next. A static half each left one thread waiting at the end of many
// products of a decode step (the other one held up by memory or by the process's other work).
// A thread takes its next task as its current one's last panels start, so that they fetch the
// next task's first (the first two panels of every run came from memory unasked: the default
// model's layers at 8 rows took 4-5% longer).
template <Epilogue E>
void take_tasks(const Problem& shared, const uint16_t* w, int64_t count,
                const std::vector<Task>& tasks, std::atomic<int64_t>& next) {
  Problem pb = shared;
  // Each thread keeps bests of its own (`run_argmax`).
  if constexpr (E == Epilogue::kArgmax) pb.best += omp_get_thread_num() * pb.M;
  const int64_t total = static_cast<int64_t>(tasks.size());
#ifdef CONVEYOR_AMX_TILES
  if (tiles_take(pb.K)) {
    conveyor::load_tile_layout();
    for (int64_t t = next++; t < total; t = next++) tile_task<E>(pb, w, tasks[t], count);
    _tile_release();
    return;
  }
#endif
  const int64_t panel_size = pb.K / 2 * kPairWidth;
  int64_t t = next++;
  while (t < total) {
    int64_t taken = -1;
    auto claim = [&]() -> const uint16_t* {
      taken = next++;
      if (taken >= total) return nullptr;
      const int64_t first = tasks[taken].p0;
      return first + 2 <= count ? w + first * panel_size : nullptr;
    };
    task_product<E>(pb, w, tasks[t], claim);
    t = taken >= 0 ? taken : next++;
  }
}

// The threads a product of these tasks runs on.
int product_threads(const std::vector<Task>& tasks) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size())));
}

// The product over torch's threads, in a parallel region of its own.
template <Epilogue E>
void run(const Problem& pb, const at::Tensor& panels, int64_t count) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const std::vector<Task> tasks =
      plan_tasks<E>(pb.M, pb.K, count / kUnit<E>, at::get_num_threads());
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(product_threads(tasks))
  take_tasks<E>(pb, w, count, tasks, next);
}

// Each row's greedy choice over the product's N columns into choice [M]: the threads' bests of
// every row, then the rows' choices from them.
void run_argmax(Problem pb, const at::Tensor& panels, int64_t* choice) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const int64_t count = panels.size(0);
  const std::vector<Task> tasks =
      plan_tasks<Epilogue::kArgmax>(pb.M, pb.K, count, at::get_num_threads());
  const int threads = product_threads(tasks);
  const auto bests = conveyor::scratch<conveyor::RowBest>(threads * pb.M);
  for (int64_t i = 0; i < threads * pb.M; ++i) bests[i].reset();
  pb.best = bests.get();
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  take_tasks<Epilogue::kArgmax>(pb, w, count, tasks, next);
  for (int64_t m = 0; m < pb.M; ++m)
    choice[m] = conveyor::row_choice(bests.get() + m, threads, pb.M);
}
#endif

}  // namespace

namespace conveyor {

bool bf16_tiles_available() {
#ifdef CONVEYOR_AMX_TILES
  return tiles_granted();
#else
  return false;
#endif
}

bool set_bf16_tiles(bool on) { return tiles_wanted.exchange(on); }

std::vector<ProductTask> bf16_product_tasks(int64_t M, int64_t K, int64_t count, bool gated,
                                            int threads) {
#ifndef CONVEYOR_BF16_PANELS
  TORCH_CHECK(false, "bf16 panels need AVX-512 BF16");
#else
  return gated ? plan_tasks<Epilogue::kGated>(M, K, count / 2, threads)
               : plan_tasks<Epilogue::kPlain>(M, K, count, threads);
#endif
}

void bf16_take_tasks(const Bf16Product& pb, const uint16_t* panels, int64_t count, bool gated,
                     const std::vector<ProductTask>& tasks, std::atomic<int64_t>& next) {
#ifndef CONVEYOR_BF16_PANELS
  TORCH_CHECK(false, "bf16 panels need AVX-512 BF16");
#else
  if (gated) take_tasks<Epilogue::kGated>(pb, panels, count, tasks, next);
  else take_tasks<Epilogue::kPlain>(pb, panels, count, tasks, next);
#endif
}

void bf16_panel_product(const float* x, int64_t M, int64_t K, const at::Tensor& panels,
                        const float* bias, const float* residual, float* out,
                        int64_t out_features) {
#ifndef CONVEYOR_BF16_PANELS
  TORCH_CHECK(false, "bf16 panels need AVX-512 BF16");
#else
  const conveyor::Scratch<uint16_t> rounded = round_rows(x, M, K);
  bf16_rows_product(rounded.get(), M, K, panels, bias, residual, out, out_features);
#endif
}

void bf16_rows_product(const uint16_t* x, int64_t M, int64_t K, const at::Tensor& panels,
                       const float* bias, const float* residual, float* out, int64_t out_features) {
#ifndef CONVEYOR_BF16_PANELS
  TORCH_CHECK(false, "bf16 panels need AVX-512 BF16");
#else
  run<Epilogue::kPlain>(Problem{x, bias, residual, out, nullptr, M, K, out_features}, panels,
                        panels.size(0));
#endif
}

at::Tensor panel_argmax(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features) {
#ifndef CONVEYOR_BF16_PANELS
  TORCH_CHECK(false, "panel_argmax needs AVX-512 BF16");
#else
  check_rows(x, "panel_argmax");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 &&
                  panels.size(2) == 2 * kPanel && panels.is_contiguous(),
              "panel_argmax: panels must be contiguous bf16 [panels, in / 2, 32]");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) == 2 * panels.size(1),
              "panel_argmax: x and panels' input sizes differ");
  TORCH_CHECK(out_features > 0 && (out_features + kPanel - 1) / kPanel == panels.size(0),
              "panel_argmax: out_features does not match the number of panels");
  const float* b = checked_bias(bias, panels.size(0) * kPanel, "panel_argmax");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor choice = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return choice;
  const InputRows in = input_rows(x);
  run_argmax(Problem{in.rows, b, nullptr, nullptr, nullptr, M, K, out_features}, panels,
             choice.data_ptr<int64_t>());
  return choice;
#endif
}

at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t inter, bool bf16_out,
                        const GateActivation& act) {
#ifndef CONVEYOR_BF16_PANELS
  TORCH_CHECK(false, "gated_linear needs AVX-512 BF16");
#else
  check_rows(x, "gated_linear");
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 && panels.size(1) == 2 &&
                  panels.size(3) == 2 * kPanel && panels.is_contiguous(),
              "gated_linear: panels must be contiguous bf16 [panels, 2, in / 2, 32]");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) == 2 * panels.size(2),
              "gated_linear: x and panels' input sizes differ");
  TORCH_CHECK(inter > 0 && (inter + kPanel - 1) / kPanel == panels.size(0),
              "gated_linear: inter does not match the number of panels");
  const float* b = checked_bias(bias, panels.size(0) * 2 * kPanel, "gated_linear");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, inter}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0) return out;
  const InputRows in = input_rows(x);
  float* out32 = bf16_out ? nullptr : out.data_ptr<float>();
  uint16_t* out16 = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  Problem pb{in.rows, b, nullptr, out32, out16, M, K, inter};
  pb.act = act;
  run<Epilogue::kGated>(pb, panels, 2 * panels.size(0));
  return out;
#endif
}

at::Tensor gated_linear_op(const at::Tensor& x, const at::Tensor& panels,
                           const c10::optional<at::Tensor>& bias, int64_t inter, bool bf16_out,
                           bool gelu, const c10::optional<c10::ArrayRef<double>>& clamped) {
  return gated_linear(x, panels, bias, inter, bf16_out,
                      gate_activation(gelu, clamped, "gated_linear"));
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "gated_linear(Tensor x, Tensor panels, Tensor? bias, int inter, bool bf16_out=False, "
      "bool gelu=False, float[]? clamped=None) -> Tensor");
  m.def("panel_argmax(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("bf16_tiles_available() -> bool", &conveyor::bf16_tiles_available);
  m.def("set_bf16_tiles(bool on) -> bool", &conveyor::set_bf16_tiles);
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("gated_linear", &conveyor::gated_linear_op);
  m.impl("panel_argmax", &conveyor::panel_argmax);
}
