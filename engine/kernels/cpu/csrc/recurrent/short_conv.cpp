// A step's causal short convolution (LFM2's convolution layers, Qwen3.5's before its delta rule),
// each row over its request's last inputs kept in the state cache, which it leaves updated.
//
// inputs   [tokens, channels] fp32, channels contiguous (rows may be strided, as a slice of a
//          wider projection's output): the rows' tokens one after another
// states   [slots, width - 1, channels] fp32, contiguous: row r's last inputs at slots[r]
// taps     [width, channels] fp32, contiguous: oldest input first
// bias     [channels] fp32, or none
// slots, query_lens   [rows] int64: each row's slot and tokens (summing to the inputs' rows)
// sources  [rows] int64, optional: row i reads its state from sources[i] and writes it to
//          slots[i], the rows in order, so that a row may read the state an earlier one wrote
//          (a request verifying drafts, a row a token)
// out      [tokens, channels] fp32: silu of the sum where `silu`
//
// Token p of a row reads its inputs p - width + 1 .. p, those before the step from the row's
// state. Torch gathers each tap's inputs from the states and the step's rows stacked into one pool
// (a copy of every input a tap); here each token reads them in place, then each row's state
// becomes its last width - 1 inputs once every token has read the old one.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_exp.h"
#include "pass_split.h"
#include "state_rows.h"

namespace {

struct ConvArgs {
  const float* inputs;
  float* states;
  const float* taps;
  const float* bias;
  const int64_t* slots;
  float* out;
  int64_t channels, kept, stride;  // kept = width - 1; stride: the inputs' row stride
  bool silu;
};

// silu over x[0, n) in place, eight lanes at a time with AVX2.
void silu_in_place(float* x, int64_t n) {
  int64_t i = 0;
#ifdef CONVEYOR_EXP8
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, conveyor::silu8(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = conveyor::silu(x[i]);
}

// Token `t`, position `p` of row `row` whose tokens start at `start`.
void conv_token(const ConvArgs& a, int64_t t, int64_t row, int64_t p, int64_t start) {
  const int64_t c = a.channels;
  float* out = a.out + t * c;
  for (int64_t i = 0; i < c; ++i) out[i] = 0.f;
  for (int64_t j = 0; j <= a.kept; ++j) {
    const int64_t at = p - a.kept + j;  // the input's position in the row; negative: its state
    const float* src = at >= 0 ? a.inputs + (start + at) * a.stride
                               : a.states + (a.slots[row] * a.kept + a.kept + at) * c;
    const float* tap = a.taps + j * c;
    for (int64_t i = 0; i < c; ++i) out[i] += tap[i] * src[i];
  }
  if (a.bias != nullptr) {
    for (int64_t i = 0; i < c; ++i) out[i] += a.bias[i];
  }
  if (a.silu) silu_in_place(out, c);
}

// Row `row`'s state becomes the last `kept` of its state followed by its `len` tokens.
void keep_last(const ConvArgs& a, int64_t row, int64_t start, int64_t len) {
  const int64_t c = a.channels;
  float* state = a.states + a.slots[row] * a.kept * c;
  const int64_t from_state = std::max<int64_t>(a.kept - len, 0);
  // Shift the state's newest rows to its front (reading ahead of writing), then the tokens.
  std::memmove(state, state + (a.kept - from_state) * c, from_state * c * sizeof(float));
  const int64_t first = start + len - (a.kept - from_state);
  for (int64_t i = from_state; i < a.kept; ++i) {
    std::memcpy(state + i * c, a.inputs + (first + i - from_state) * a.stride, c * sizeof(float));
  }
}

// Row `row`'s tokens, from `start` on, through the convolution, over threads.
void conv_row(const ConvArgs& a, int64_t row, int64_t start, int64_t end) {
  at::parallel_for(start, end, conveyor::rows_per_task(a.channels * (a.kept + 1)),
                   [&](int64_t begin, int64_t stop) {
                     for (int64_t t = begin; t < stop; ++t) conv_token(a, t, row, t - start, start);
                   });
}

// Rows that read sources, in order: each row's source state copied into its slot (where they
// differ), then its tokens, then its slot's update, which a later row may read.
void conv_chained(const ConvArgs& a, const int64_t* sources, const std::vector<int64_t>& starts,
                  const int64_t* lens) {
  const int64_t values = a.kept * a.channels;
  for (int64_t row = 0; row + 1 < static_cast<int64_t>(starts.size()); ++row) {
    if (sources[row] != a.slots[row]) {
      std::memcpy(a.states + a.slots[row] * values, a.states + sources[row] * values,
                  values * sizeof(float));
    }
    conv_row(a, row, starts[row], starts[row + 1]);
    keep_last(a, row, starts[row], lens[row]);
  }
}

void check_fp32(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dims,
              "short_conv: ", name, " must be contiguous fp32 with ", dims, " dims");
}

}  // namespace

namespace conveyor {

at::Tensor short_conv(const at::Tensor& inputs, at::Tensor states, const at::Tensor& taps,
                      const c10::optional<at::Tensor>& bias, const at::Tensor& slots,
                      const at::Tensor& query_lens, bool silu,
                      const c10::optional<at::Tensor>& sources) {
  TORCH_CHECK(inputs.scalar_type() == at::kFloat && inputs.dim() == 2 && inputs.stride(1) == 1 &&
                  inputs.stride(0) >= inputs.size(1),
              "short_conv: inputs must be fp32 [tokens, channels] with contiguous channels");
  check_fp32(states, "states", 3);
  check_fp32(taps, "taps", 2);
  const int64_t tokens = inputs.size(0), channels = inputs.size(1), kept = taps.size(0) - 1;
  TORCH_CHECK(kept >= 1 && taps.size(1) == channels, "short_conv: taps must be [width, channels]");
  TORCH_CHECK(states.size(1) == kept && states.size(2) == channels,
              "short_conv: states must be [slots, width - 1, channels]");
  if (bias.has_value()) {
    check_fp32(*bias, "bias", 1);
    TORCH_CHECK(bias->size(0) == channels, "short_conv: bias must have a value per channel");
  }
  TORCH_CHECK(
      query_lens.scalar_type() == at::kLong && query_lens.is_contiguous() && query_lens.dim() == 1,
      "short_conv: query_lens must be int64 [rows]");
  const int64_t rows = query_lens.size(0);
  const conveyor::StateRows state_rows =
      conveyor::checked_state_rows("short_conv", slots, sources, rows, states.size(0));
  const int64_t* slot = state_rows.slots;
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  std::vector<int64_t> starts(rows + 1, 0), token_rows(tokens);
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(lens[row] >= 1, "short_conv: each row takes at least one token");
    starts[row + 1] = starts[row] + lens[row];
    TORCH_CHECK(starts[row + 1] <= tokens, "short_conv: query_lens sum past the inputs");
    for (int64_t t = starts[row]; t < starts[row + 1]; ++t) token_rows[t] = row;
  }
  TORCH_CHECK(starts[rows] == tokens, "short_conv: query_lens must sum to the inputs' rows");
  at::Tensor out = at::empty({tokens, channels}, inputs.options());
  const ConvArgs args{inputs.data_ptr<float>(),
                      states.data_ptr<float>(),
                      taps.data_ptr<float>(),
                      bias.has_value() ? bias->data_ptr<float>() : nullptr,
                      slot,
                      out.data_ptr<float>(),
                      channels,
                      kept,
                      inputs.stride(0),
                      silu};
  if (state_rows.sources != nullptr) {
    conv_chained(args, state_rows.sources, starts, lens);
    return out;
  }
  at::parallel_for(0, tokens, rows_per_task(channels * (kept + 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) {
                       const int64_t row = token_rows[t];
                       conv_token(args, t, row, t - starts[row], starts[row]);
                     }
                   });
  at::parallel_for(0, rows, rows_per_task(channels * kept), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) keep_last(args, row, starts[row], lens[row]);
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "short_conv(Tensor inputs, Tensor(a!) states, Tensor taps, Tensor? bias, Tensor slots, "
      "Tensor query_lens, bool silu, Tensor? sources=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("short_conv", &conveyor::short_conv); }
