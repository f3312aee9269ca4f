// Linear layers on the CPU over weights packed in panels of 16 output columns:
// y = x w^T + bias, with x, bias and y in fp32 and the weight in fp32, fp16 or GGUF blocks.
//
// x       [rows, in]             fp32, contiguous
// panels  [ceil(out / 16), in, 16]  fp32 or fp16, contiguous: panel p holds output columns
//                                  16p..16p+15, one row of 16 per input feature (zero-padded)
//      or [ceil(out / 16), in / 32, group] uint8: the same panels in GGUF's 32-wide blocks,
//                                  one group per panel and 32 input features (`block_panels.h`)
//      or the same in int8: Q4_1 blocks times activations rounded to 8-bit blocks, an
//                                  approximate product (`int8_panels.cpp`)
//      or [ceil(out / 16), in / 2, 32] bf16: pairs of input features, times x rounded to bf16
//                                  in AVX-512 BF16 dot products (`bf16_panels.cpp`); these
//                                  also take x as bf16 rows, already rounded
// bias    [panels * 16]          fp32, optional, zero-padded like the panels
// residual [rows, out]           fp32, optional: added to the product (a decoder layer's skip
//                                  connection), as each panel's sums are stored for bf16 panels
//
// The inner loop multiplies up to 6 rows of x by one panel: each step broadcasts one input
// feature of each row and adds it times the panel's 16 weights into 12 accumulators held in
// registers; fp16 weights are widened as they are loaded (F16C), so a panel stays in L1 at half
// the bytes while passes over more rows reuse it. Panels are split over torch's threads, so each
// thread streams its own share of the weight from memory once per chunk of rows. Up to 3 rows
// (decoding a few sequences, bound by memory bandwidth) run over two or four panels at once
// instead, for enough independent accumulators.
//
// Block panels hold the weights of a GGUF Q4_1 or Q8_0 checkpoint: each weight is widened to
// its exact fp32 value in registers (up to 6 rows), or a few panels at a time into fp32 panels
// that the fp32 path then reads (more rows), so a product over blocks equals the product over
// the dequantized fp32 panels to the bit while streaming a fifth (Q4_1) of their bytes.
//
// Every output is summed over the input features in order, one fused multiply-add at a time,
// whatever the number of rows, threads or path: a row's result does not depend on its batch.
// Without AVX2, F16C and FMA the op refuses to run and callers keep torch's products.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_panels.h"
#include "load8.h"
#include "ops.h"
#include "panel_passes.h"
#include "panel_shapes.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_PANEL_LINEAR_SIMD 1
#endif

namespace {

using conveyor::chunk_rows;
using conveyor::kPanel;
using conveyor::near_equal_passes;

// Rows of x handled per pass over the weight: about this many bytes of x, kept in L2.
constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int kMaxRows = 6;
// fp32 bytes of block panels widened at a time for many rows.
constexpr int64_t kWidenBytes = 256 * 1024;

#ifdef CONVEYOR_PANEL_LINEAR_SIMD
using conveyor::dequantize_panel;
using conveyor::load8;

// Helpers of the micro kernels, inlined (`CONVEYOR_INLINE`) so that the accumulators stay in
// registers: the loops over rows and vectors are unrolled.
template <int MR, int J>
CONVEYOR_INLINE void zero_tile(__m256 (&acc)[MR][J]) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) acc[m][j] = _mm256_setzero_ps();
}

// acc[m] += x[m * ldx] * w for MR rows of x and J vectors of 8 weights.
template <int MR, int J>
CONVEYOR_INLINE void madd_tile(__m256 (&acc)[MR][J], const float* x, int64_t ldx,
                               const __m256 (&w)[J]) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const __m256 xb = _mm256_broadcast_ss(x + m * ldx);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) acc[m][j] = _mm256_fmadd_ps(xb, w[j], acc[m][j]);
  }
}

// The tile plus bias (if any) to MR rows of out (row stride ldo).
template <int MR, int J>
CONVEYOR_INLINE void store_tile(const __m256 (&acc)[MR][J], float* out, int64_t ldo,
                                const float* bias) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      __m256 v = acc[m][j];
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j * 8));
      _mm256_storeu_ps(out + m * ldo + j * 8, v);
    }
}

// MR rows of x times NP consecutive panels, written to out (row stride ldo) plus bias.
template <int MR, int NP, typename W>
inline void micro(const float* x, int64_t K, const W* panels, float* out, int64_t ldo,
                  const float* bias) {
  __m256 acc[MR][2 * NP];
  zero_tile(acc);
  const int64_t panel_size = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w[2 * NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      w[2 * p] = load8(panels + p * panel_size + k * kPanel);
      w[2 * p + 1] = load8(panels + p * panel_size + k * kPanel + 8);
    }
    madd_tile(acc, x + k, K, w);
  }
  store_tile(acc, out, ldo, bias);
}

// 1 to 6 rows of x times one panel.
template <typename W>
inline void micro_rows(int64_t rows, const float* x, int64_t K, const W* panel, float* out,
                       int64_t ldo, const float* bias) {
  switch (rows) {
    case 6: micro<6, 1>(x, K, panel, out, ldo, bias); break;
    case 5: micro<5, 1>(x, K, panel, out, ldo, bias); break;
    case 4: micro<4, 1>(x, K, panel, out, ldo, bias); break;
    case 3: micro<3, 1>(x, K, panel, out, ldo, bias); break;
    case 2: micro<2, 1>(x, K, panel, out, ldo, bias); break;
    case 1: micro<1, 1>(x, K, panel, out, ldo, bias); break;
    default: break;
  }
}

struct Problem {
  const float* x;
  const float* bias;  // padded to whole panels, or null
  float* out;
  int64_t M, K, N;
};

// Rows [m0, m0 + rows) of x times one panel, in passes of at most 6 rows of near-equal size.
// The last panel's spare columns go to a scratch tile instead of past the end of the output
// rows.
template <typename W>
void rows_by_panel(const Problem& pb, int64_t m0, int64_t rows, const W* panel, int64_t p) {
  const int64_t n0 = p * kPanel;
  const int64_t cols = std::min(kPanel, pb.N - n0);
  const float* bias = pb.bias == nullptr ? nullptr : pb.bias + n0;
  near_equal_passes(m0, rows, kMaxRows, [&](int64_t m, int64_t mr) {
    if (cols == kPanel) {
      micro_rows(mr, pb.x + m * pb.K, pb.K, panel, pb.out + m * pb.N + n0, pb.N, bias);
    } else {
      float tile[kMaxRows * kPanel];
      micro_rows(mr, pb.x + m * pb.K, pb.K, panel, tile, kPanel, bias);
      for (int64_t r = 0; r < mr; ++r)
        std::memcpy(pb.out + (m + r) * pb.N + n0, tile + r * kPanel, cols * sizeof(float));
    }
  });
}

// Up to 3 rows: several panels at a time while whole panels remain, for enough independent
// accumulators (one row alone would leave the multiply-adds waiting on each other).
template <int MR, int NP, typename W>
void few_rows(const Problem& pb, const W* panels, int64_t p0, int64_t p1) {
  const int64_t panel_size = pb.K * kPanel;
  int64_t p = p0;
  for (; p + NP <= p1 && (p + NP) * kPanel <= pb.N; p += NP) {
    const float* bias = pb.bias == nullptr ? nullptr : pb.bias + p * kPanel;
    micro<MR, NP>(pb.x, pb.K, panels + p * panel_size, pb.out + p * kPanel, pb.N, bias);
  }
  for (; p < p1; ++p) rows_by_panel(pb, 0, pb.M, panels + p * panel_size, p);
}

// Panels p0..p1 (the first at `first`, the rest after it) for all rows, a chunk of rows at a
// time.
template <typename W>
void rows_in_chunks(const Problem& pb, const W* first, int64_t p0, int64_t p1) {
  const int64_t panel_size = pb.K * kPanel;
  const int64_t chunk = chunk_rows(pb.K * 4, kChunkBytes, kMaxRows);
  for (int64_t m0 = 0; m0 < pb.M; m0 += chunk) {
    const int64_t rows = std::min(chunk, pb.M - m0);
    for (int64_t p = p0; p < p1; ++p) rows_by_panel(pb, m0, rows, first + (p - p0) * panel_size, p);
  }
}

// Panels [p0, p1) for all rows.
template <typename W>
void panel_range(const Problem& pb, const W* panels, int64_t p0, int64_t p1) {
  switch (pb.M) {
    case 1: few_rows<1, 4>(pb, panels, p0, p1); return;
    case 2: few_rows<2, 2>(pb, panels, p0, p1); return;
    case 3: few_rows<3, 2>(pb, panels, p0, p1); return;
    default: rows_in_chunks(pb, panels + p0 * pb.K * kPanel, p0, p1);
  }
}

// MR rows of x times NP consecutive block panels (format Q): the micro kernel above with each
// weight widened from its block as it is needed, summed in the same order.
template <int MR, int NP, typename Q>
inline void micro_blocks(const float* x, int64_t K, const uint8_t* panels, int64_t panel_bytes,
                         float* out, int64_t ldo, const float* bias) {
  __m256 acc[MR][2 * NP];
  zero_tile(acc);
  for (int64_t b = 0; b < K / Q::kBlock; ++b) {
    alignas(32) float scales[NP][Q::kScales];
    const uint8_t* group[NP];
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      group[p] = panels + p * panel_bytes + b * Q::kGroupBytes;
      Q::scales(group[p], scales[p]);
    }
    for (int kk = 0; kk < Q::kBlock; ++kk) {
      __m256 w[2 * NP];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) Q::weights(group[p], kk, scales[p], w + 2 * p);
      madd_tile(acc, x + b * Q::kBlock + kk, K, w);
    }
  }
  store_tile(acc, out, ldo, bias);
}

// Up to 6 rows over block panels, widened in registers (up to 2 rows over two panels at once);
// a last, partly filled panel goes through a scratch fp32 panel.
template <int MR, int NP, typename Q>
void few_rows_blocks(const Problem& pb, const uint8_t* panels, int64_t p0, int64_t p1,
                     float* scratch) {
  const int64_t panel_bytes = pb.K / Q::kBlock * Q::kGroupBytes;
  int64_t p = p0;
  for (; p + NP <= p1 && (p + NP) * kPanel <= pb.N; p += NP) {
    const float* bias = pb.bias == nullptr ? nullptr : pb.bias + p * kPanel;
    micro_blocks<MR, NP, Q>(pb.x, pb.K, panels + p * panel_bytes, panel_bytes, pb.out + p * kPanel,
                            pb.N, bias);
  }
  for (; p < p1; ++p) {
    dequantize_panel<Q>(panels + p * panel_bytes, pb.K, scratch);
    rows_by_panel(pb, 0, pb.M, scratch, p);
  }
}

// The first cache-line boundary in a float buffer (16 floats spare): the kernel's 32-byte loads
// from it never straddle two lines.
inline float* line_aligned(std::vector<float>& buffer) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) &
                                  ~uintptr_t{63});
}

// Block panels [p0, p1) for all rows. Up to 6 rows widen each weight in registers as they go.
// More rows widen a few panels at a time (kWidenBytes of fp32, kept in L2) once, then multiply
// every chunk of rows over them as over fp32 panels.
template <typename Q>
void block_panel_range(const Problem& pb, const uint8_t* panels, int64_t p0, int64_t p1) {
  const int64_t panel_bytes = pb.K / Q::kBlock * Q::kGroupBytes;
  const int64_t panel_floats = pb.K * kPanel;
  if (pb.M <= kMaxRows) {
    std::vector<float> buffer(panel_floats + 16);
    float* scratch = line_aligned(buffer);  // for a last, partly filled panel
    switch (pb.M) {
      case 1: few_rows_blocks<1, 2, Q>(pb, panels, p0, p1, scratch); return;
      case 2: few_rows_blocks<2, 2, Q>(pb, panels, p0, p1, scratch); return;
      case 3: few_rows_blocks<3, 1, Q>(pb, panels, p0, p1, scratch); return;
      case 4: few_rows_blocks<4, 1, Q>(pb, panels, p0, p1, scratch); return;
      case 5: few_rows_blocks<5, 1, Q>(pb, panels, p0, p1, scratch); return;
      default: few_rows_blocks<6, 1, Q>(pb, panels, p0, p1, scratch); return;
    }
  }
  const int64_t group = std::max<int64_t>(1, kWidenBytes / (panel_floats * 4));
  std::vector<float> buffer(std::min(group, p1 - p0) * panel_floats + 16);
  float* widened = line_aligned(buffer);
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    for (int64_t p = g0; p < g1; ++p)
      dequantize_panel<Q>(panels + p * panel_bytes, pb.K, widened + (p - g0) * panel_floats);
    rows_in_chunks(pb, static_cast<const float*>(widened), g0, g1);
  }
}

template <typename Q>
void run_blocks(const Problem& pb, const at::Tensor& panels) {
  const uint8_t* w = panels.data_ptr<uint8_t>();
  at::parallel_for(0, panels.size(0), 4,
                   [&](int64_t p0, int64_t p1) { block_panel_range<Q>(pb, w, p0, p1); });
}

// visit(Q{}) for the block format this group size names (checked by `check_layout`).
template <typename Visit>
void with_block_format(int64_t group, Visit&& visit) {
  switch (group) {
    case conveyor::Q41::kGroupBytes: visit(conveyor::Q41{}); return;
    case conveyor::Q80::kGroupBytes: visit(conveyor::Q80{}); return;
    case conveyor::Q4K::kGroupBytes: visit(conveyor::Q4K{}); return;
    case conveyor::Q6K::kGroupBytes: visit(conveyor::Q6K{}); return;
    case conveyor::MXFP4::kGroupBytes: visit(conveyor::MXFP4{}); return;
    default: visit(conveyor::Q8K{}); return;
  }
}

// Block panels of whichever format their group size names.
void run_block_format(const Problem& pb, const at::Tensor& panels) {
  with_block_format(panels.size(2), [&](auto q) { run_blocks<decltype(q)>(pb, panels); });
}

template <typename W>
void run(const Problem& pb, const at::Tensor& panels) {
  const W* w = panels.data_ptr<W>();
  // Enough panels per task that a thread's share streams as one run.
  at::parallel_for(0, panels.size(0), 4,
                   [&](int64_t p0, int64_t p1) { panel_range(pb, w, p0, p1); });
}
#endif

// The panels' last dimension as their dtype lays them out.
void check_layout(const at::Tensor& panels) {
  switch (panels.scalar_type()) {
    case at::kFloat:
    case at::kHalf:
      TORCH_CHECK(panels.size(2) == kPanel, "panel_linear: panels must be [panels, in, 16]");
      break;
    case at::kBFloat16:
      TORCH_CHECK(panels.size(2) == 2 * kPanel,
                  "panel_linear: bf16 panels must be [panels, in / 2, 32]");
      break;
    case at::kByte:
      TORCH_CHECK(conveyor::block_group(panels.size(2)),
                  "panel_linear: block panels must be [panels, in / 32, ",
                  conveyor::Q41::kGroupBytes, " (Q4_1), ", conveyor::Q80::kGroupBytes, " (Q8_0), ",
                  conveyor::Q4K::kGroupBytes, " (Q4_K), ", conveyor::Q6K::kGroupBytes, " (Q6_K), ",
                  conveyor::Q8K::kGroupBytes, " (Q8_K) or ", conveyor::MXFP4::kGroupBytes,
                  " (MXFP4)]");
      break;
    case at::kChar:
      TORCH_CHECK(panels.size(2) == conveyor::Q41Int8::kGroupBytes ||
                      panels.size(2) == conveyor::Q80Int8::kGroupBytes,
                  "panel_linear: int8 block panels must be [panels, in / 32, ",
                  conveyor::Q41Int8::kGroupBytes, " (Q4_1) or ", conveyor::Q80Int8::kGroupBytes,
                  " (Q8_0)]");
      break;
    default:
      TORCH_CHECK(false,
                  "panel_linear: panels must be fp32, fp16, bf16 pairs or uint8 blocks "
                  "(int8 for 8-bit activations)");
  }
}

}  // namespace

namespace conveyor {

int64_t panel_in_features(const at::Tensor& panels) {
  switch (panels.scalar_type()) {
    case at::kByte:
    case at::kChar: return panels.size(1) * kBlock;
    case at::kBFloat16: return panels.size(1) * 2;
    default: return panels.size(1);
  }
}

bool fp32_row_panels(const at::Tensor& panels, int64_t out, int64_t in) {
  if (panels.scalar_type() == at::kByte) return block_panels_fit(panels, out, in);
  return (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kHalf) &&
         panels.dim() == 3 && panels.is_contiguous() &&
         panels.size(0) == (out + kPanel - 1) / kPanel && panels.size(1) == in &&
         panels.size(2) == kPanel;
}

void panel_take_tasks(const float* x, const float* bias, float* out, int64_t M, int64_t K,
                      int64_t N, const at::Tensor& panels, const std::vector<ProductTask>& tasks,
                      std::atomic<int64_t>& next) {
#ifndef CONVEYOR_PANEL_LINEAR_SIMD
  TORCH_CHECK(false, "panel_linear needs AVX2, F16C and FMA");
#else
  const Problem pb{x, bias, out, M, K, N};
  if (panels.scalar_type() == at::kHalf) {
    const at::Half* w = panels.data_ptr<at::Half>();
    take_runs(tasks, next, [&](int64_t p0, int64_t p1) { panel_range(pb, w, p0, p1); });
    return;
  }
  if (panels.scalar_type() == at::kFloat) {
    const float* w = panels.data_ptr<float>();
    take_runs(tasks, next, [&](int64_t p0, int64_t p1) { panel_range(pb, w, p0, p1); });
    return;
  }
  const uint8_t* w = panels.data_ptr<uint8_t>();
  with_block_format(panels.size(2), [&](auto q) {
    take_runs(tasks, next,
              [&](int64_t p0, int64_t p1) { block_panel_range<decltype(q)>(pb, w, p0, p1); });
  });
#endif
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features,
                        const c10::optional<at::Tensor>& residual) {
#ifndef CONVEYOR_PANEL_LINEAR_SIMD
  TORCH_CHECK(false, "panel_linear needs AVX2, F16C and FMA");
#else
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3,
              "panel_linear: x must be [rows, in] and panels 3-d");
  TORCH_CHECK(x.size(1) > 0, "panel_linear: x has no input features");
  check_layout(panels);
  TORCH_CHECK(x.size(1) == panel_in_features(panels),
              "panel_linear: x and panels' input sizes differ");
  const bool bf16_rows = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == at::kFloat || (bf16_rows && panels.scalar_type() == at::kBFloat16),
              "panel_linear: x must be fp32 (or bf16 over bf16 panels)");
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous(),
              "panel_linear: inputs must be contiguous");
  TORCH_CHECK(out_features > 0 && (out_features + kPanel - 1) / kPanel == panels.size(0),
              "panel_linear: out_features does not match the number of panels");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == panels.size(0) * kPanel &&
                    bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "panel_linear: bias must be fp32 [panels * 16], zero-padded");
  const int64_t M = x.size(0), K = x.size(1);
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual)
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == M &&
                    residual->size(1) == out_features && residual->scalar_type() == at::kFloat &&
                    residual->is_contiguous(),
                "panel_linear: residual must be contiguous fp32 [rows, out_features]");
  at::Tensor out = at::empty({M, out_features}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  if (panels.scalar_type() == at::kBFloat16) {
    // The residual is added as each panel's sums leave the registers.
    const float* skip = has_residual ? residual->data_ptr<float>() : nullptr;
    if (bf16_rows)
      bf16_rows_product(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, panels,
                        b, skip, o, out_features);
    else bf16_panel_product(x.data_ptr<float>(), M, K, panels, b, skip, o, out_features);
    return out;
  }
  const Problem pb{x.data_ptr<float>(), b, o, M, K, out_features};
  const bool blocks = panels.scalar_type() == at::kByte;
  if (panels.scalar_type() == at::kChar)
    int8_panel_product(pb.x, M, K, panels, pb.bias, pb.out, out_features);
  else if (blocks) run_block_format(pb, panels);
  else if (panels.scalar_type() == at::kHalf) run<at::Half>(pb, panels);
  else run<float>(pb, panels);
  // out + residual is residual + out to the bit (IEEE addition commutes).
  if (has_residual) out.add_(*residual);
  return out;
#endif
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features, "
      "Tensor? residual=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("panel_linear", &conveyor::panel_linear); }
