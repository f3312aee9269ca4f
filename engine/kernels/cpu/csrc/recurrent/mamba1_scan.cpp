// Mamba1's selective scan (Jamba's, Mamba's and Falcon-Mamba's mixers) on the CPU: a prompt
// chunk's tokens, the chunks of one length side by side, each from its request's state, which
// it leaves updated (`mamba1_prompt_scan`); and one decode token of each row, its state read
// from and written to the state cache in place (`mamba1_decode`).
//
// mamba1_prompt_scan:
// x, steps  [tokens, rows, channels]               fp32, contiguous (steps after the bias and
//           softplus)
// b, c      [tokens, rows, state dims]             fp32, contiguous
// rates     [channels, state dims]                 fp32, contiguous: A (negative)
// states    [rows, channels, state dims]           fp32, contiguous: updated in place
// out       [tokens, rows, channels]               fp32 (without the D skip)
//
// mamba1_decode:
// x, steps  [rows, channels]                       fp32, contiguous
// b, c      [rows, state dims]                     fp32, contiguous
// rates     [channels, state dims]                 fp32, contiguous
// states    [slots, channels, state dims]          fp32, contiguous: row i's at slots[i]
// slots     [rows] int64
// sources   [rows] int64, optional: row i reads its state from sources[i] and writes it to
//           slots[i] (a request's rows verifying drafts); the rows then run in order
// out       [rows, channels]                       fp32 (without the D skip)
//
// With S a channel's state and dt its step, each token in turn:
//   S <- exp(dt A) S + dt x b,  out = S . c
// as transformers' sequential scan. Torch takes a prompt a token at a time, a handful of ops
// each over every channel's state; here a (row, channel) task keeps its state in registers and
// takes the chunk's tokens in turn. At decode torch gathers the rows' states, decays them, adds
// the writes, scatters them back and reads them again; here each state is read and written once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "fast_exp.h"
#include "state_rows.h"

namespace {

struct ScanArgs {
  const float *x, *steps, *b, *c, *rates;
  float* states;
  float* out;
  int64_t tokens, rows, channels, state_dims;
};

// One token through one channel's state `s` (`n` dims): the state updated, its read by `c`.
float scan_token(float* s, const float* rates, const float* b, const float* c, float step, float x,
                 int64_t n) {
  const float written = step * x;
  int64_t j = 0;
  float sum = 0.f;
#ifdef CONVEYOR_EXP8
  __m256 total = _mm256_setzero_ps();
  const __m256 dt = _mm256_set1_ps(step), w = _mm256_set1_ps(written);
  for (; j + 8 <= n; j += 8) {
    const __m256 decay = conveyor::exp8_clamped(_mm256_mul_ps(dt, _mm256_loadu_ps(rates + j)));
    const __m256 kept =
        _mm256_fmadd_ps(decay, _mm256_loadu_ps(s + j), _mm256_mul_ps(w, _mm256_loadu_ps(b + j)));
    _mm256_storeu_ps(s + j, kept);
    total = _mm256_fmadd_ps(kept, _mm256_loadu_ps(c + j), total);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  for (float lane : lanes) sum += lane;
#endif
  for (; j < n; ++j) {
    s[j] = conveyor::exp_clamped(step * rates[j]) * s[j] + written * b[j];
    sum += s[j] * c[j];
  }
  return sum;
}

// Task `task` = row * channels + channel: its state through every token of the chunk.
void scan_task(const ScanArgs& a, int64_t task, std::vector<float>& held) {
  const int64_t row = task / a.channels, channel = task % a.channels, n = a.state_dims;
  float* state = a.states + task * n;
  held.assign(state, state + n);  // the state stays in the core's cache across the tokens
  const float* rates = a.rates + channel * n;
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int64_t at = (t * a.rows + row) * a.channels + channel;
    const int64_t bc = (t * a.rows + row) * n;
    a.out[at] = scan_token(held.data(), rates, a.b + bc, a.c + bc, a.steps[at], a.x[at], n);
  }
  std::copy(held.begin(), held.end(), state);
}

struct DecodeArgs {
  const float *x, *steps, *b, *c, *rates;
  float* states;
  const int64_t *slots, *sources;  // sources: null where each row reads its own slot
  float* out;
  int64_t channels, state_dims;
};

// Row `row`'s channel `channel`: its state from its source's slot, updated into its own.
void decode_task(const DecodeArgs& a, int64_t row, int64_t channel) {
  const int64_t n = a.state_dims, at = row * a.channels + channel;
  const int64_t slot = a.slots[row], source = a.sources != nullptr ? a.sources[row] : slot;
  float* state = a.states + (slot * a.channels + channel) * n;
  if (source != slot) {
    const float* read = a.states + (source * a.channels + channel) * n;
    std::copy(read, read + n, state);
  }
  a.out[at] = scan_token(state, a.rates + channel * n, a.b + row * n, a.c + row * n, a.steps[at],
                         a.x[at], n);
}

void check(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim,
              "mamba1_prompt_scan: ", name, " must be contiguous fp32 of ", dim, " dims");
}

}  // namespace

namespace conveyor {

at::Tensor mamba1_prompt_scan(const at::Tensor& x, const at::Tensor& steps, const at::Tensor& b,
                              const at::Tensor& c, const at::Tensor& rates, at::Tensor states) {
  check(x, "x", 3);
  check(steps, "steps", 3);
  check(b, "b", 3);
  check(c, "c", 3);
  check(rates, "rates", 2);
  check(states, "states", 3);
  const int64_t tokens = x.size(0), rows = x.size(1), channels = x.size(2), n = b.size(2);
  TORCH_CHECK(steps.sizes() == x.sizes(), "mamba1_prompt_scan: steps must be shaped as x");
  TORCH_CHECK(b.size(0) == tokens && b.size(1) == rows && c.sizes() == b.sizes(),
              "mamba1_prompt_scan: b and c must be [tokens, rows, state dims]");
  TORCH_CHECK(rates.size(0) == channels && rates.size(1) == n,
              "mamba1_prompt_scan: rates must be [channels, state dims]");
  TORCH_CHECK(states.size(0) == rows && states.size(1) == channels && states.size(2) == n,
              "mamba1_prompt_scan: states must be [rows, channels, state dims]");
  at::Tensor out = at::empty({tokens, rows, channels}, x.options());
  const ScanArgs args{x.data_ptr<float>(),
                      steps.data_ptr<float>(),
                      b.data_ptr<float>(),
                      c.data_ptr<float>(),
                      rates.data_ptr<float>(),
                      states.data_ptr<float>(),
                      out.data_ptr<float>(),
                      tokens,
                      rows,
                      channels,
                      n};
  at::parallel_for(0, rows * channels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> held;
    for (int64_t task = begin; task < end; ++task) scan_task(args, task, held);
  });
  return out;
}

at::Tensor mamba1_decode(const at::Tensor& x, const at::Tensor& steps, const at::Tensor& b,
                         const at::Tensor& c, const at::Tensor& rates, at::Tensor states,
                         const at::Tensor& slots, const std::optional<at::Tensor>& sources) {
  const int64_t rows = x.size(0);
  const char* op = "mamba1_decode";
  check_token_rows(op, x, "x", rows, 2);
  check_token_rows(op, steps, "steps", rows, 2);
  check_token_rows(op, b, "b", rows, 2);
  check_token_rows(op, c, "c", rows, 2);
  const int64_t channels = x.size(1), n = b.size(1);
  TORCH_CHECK(steps.sizes() == x.sizes(), "mamba1_decode: steps must be shaped as x");
  TORCH_CHECK(c.sizes() == b.sizes(), "mamba1_decode: b and c must have one shape");
  TORCH_CHECK(rates.scalar_type() == at::kFloat && rates.is_contiguous() && rates.dim() == 2 &&
                  rates.size(0) == channels && rates.size(1) == n,
              "mamba1_decode: rates must be contiguous fp32 [channels, state dims]");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 3 &&
                  states.size(1) == channels && states.size(2) == n,
              "mamba1_decode: states must be contiguous fp32 [slots, channels, state dims]");
  const StateRows state_rows = checked_state_rows(op, slots, sources, rows, states.size(0));
  at::Tensor out = at::empty({rows, channels}, x.options());
  const DecodeArgs args{x.data_ptr<float>(),
                        steps.data_ptr<float>(),
                        b.data_ptr<float>(),
                        c.data_ptr<float>(),
                        rates.data_ptr<float>(),
                        states.data_ptr<float>(),
                        state_rows.slots,
                        state_rows.sources,
                        out.data_ptr<float>(),
                        channels,
                        n};
  for_each_row_head(rows, channels, state_rows.sources != nullptr, [&] {
    return [&args](int64_t row, int64_t channel) { decode_task(args, row, channel); };
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "mamba1_prompt_scan(Tensor x, Tensor steps, Tensor b, Tensor c, Tensor rates, "
      "Tensor(a!) states) -> Tensor");
  m.def(
      "mamba1_decode(Tensor x, Tensor steps, Tensor b, Tensor c, Tensor rates, Tensor(a!) states, "
      "Tensor slots, Tensor? sources=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("mamba1_prompt_scan", &conveyor::mamba1_prompt_scan);
  m.impl("mamba1_decode", &conveyor::mamba1_decode);
}
