// One decode token of each row through Mamba2's selective scan, each row's state updated in place
// in the state cache.
//
// x        [rows, heads, head dims]                 fp32, contiguous
// steps    [rows, heads]                            fp32, contiguous (after the bias and softplus)
// b, c     [rows, groups, state dims]               fp32, contiguous
// rates    [heads]                                  fp32: each head's A (negative)
// states   [slots, heads, head dims, state dims]    fp32, contiguous: row i's at slots[i]
// slots    [rows] int64
// sources  [rows] int64, optional: row i reads its state from sources[i] and writes it to
//          slots[i] (a request's rows verifying drafts, each from the state the row before it
//          left); the rows then run in order, so a source may be an earlier row's slot
// out      [rows, heads, head dims]                 fp32 (without the D skip)
//
// A head reads group `head / (heads / groups)`. With S a head's state and dt its step:
//   S <- exp(dt A) S + dt x b^T,  out = S c
// as transformers' `mamba2_selective_state_update`. Torch gathers the rows' states, decays them,
// adds the writes, scatters them back and reads them again for the product; here a (row, head)
// task updates each row of its state and takes its dot with c while the row is in registers, so a
// step moves each state through memory once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "state_rows.h"

namespace {

struct SsdArgs {
  const float *x, *steps, *b, *c, *rates;
  float* states;
  const int64_t *slots, *sources;  // sources: null where each row reads its own slot
  float* out;
  int64_t heads, groups, head_dims, state_dims;
};

// Lanes of partial sums for a state row's dot with c: whole vectors the compiler keeps apart.
constexpr int64_t kLanes = 16;

// Row `row`'s head `head`.
void scan_task(const SsdArgs& s, int64_t row, int64_t head) {
  const int64_t n = s.state_dims;
  const int64_t group = head / (s.heads / s.groups);
  const float* b = s.b + (row * s.groups + group) * n;
  const float* c = s.c + (row * s.groups + group) * n;
  const float* x = s.x + (row * s.heads + head) * s.head_dims;
  const int64_t source = s.sources != nullptr ? s.sources[row] : s.slots[row];
  const float* state = s.states + (source * s.heads + head) * s.head_dims * n;
  float* kept = s.states + (s.slots[row] * s.heads + head) * s.head_dims * n;
  float* out = s.out + (row * s.heads + head) * s.head_dims;
  const float step = s.steps[row * s.heads + head];
  const float decay = std::exp(step * s.rates[head]);
  const int64_t whole = n - n % kLanes;
  for (int64_t p = 0; p < s.head_dims; ++p) {
    const float* r = state + p * n;
    float* t = kept + p * n;
    const float written = step * x[p];
    float part[kLanes] = {};
    for (int64_t j = 0; j < whole; j += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        const float v = r[j + l] * decay + written * b[j + l];
        t[j + l] = v;
        part[l] += v * c[j + l];
      }
    }
    float sum = 0.f;
    for (int64_t j = whole; j < n; ++j) {
      t[j] = r[j] * decay + written * b[j];
      sum += t[j] * c[j];
    }
    for (int64_t l = 0; l < kLanes; ++l) sum += part[l];
    out[p] = sum;
  }
}

}  // namespace

namespace conveyor {

at::Tensor ssd_decode(const at::Tensor& x, const at::Tensor& steps, const at::Tensor& b,
                      const at::Tensor& c, const at::Tensor& rates, at::Tensor states,
                      const at::Tensor& slots, const std::optional<at::Tensor>& sources) {
  const int64_t rows = x.size(0);
  const char* op = "ssd_decode";
  check_token_rows(op, x, "x", rows, 3);
  check_token_rows(op, steps, "steps", rows, 2);
  check_token_rows(op, b, "b", rows, 3);
  check_token_rows(op, c, "c", rows, 3);
  const int64_t heads = x.size(1), head_dims = x.size(2), groups = b.size(1), n = b.size(2);
  TORCH_CHECK(c.sizes() == b.sizes(), "ssd_decode: b and c must have one shape");
  TORCH_CHECK(groups > 0 && heads % groups == 0,
              "ssd_decode: the heads must be a multiple of the groups");
  TORCH_CHECK(steps.size(1) == heads, "ssd_decode: steps must have a value per head");
  TORCH_CHECK(rates.scalar_type() == at::kFloat && rates.is_contiguous() && rates.dim() == 1 &&
                  rates.size(0) == heads,
              "ssd_decode: rates must be contiguous fp32 [heads]");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 4,
              "ssd_decode: states must be contiguous fp32 [slots, heads, head dims, state dims]");
  TORCH_CHECK(states.size(1) == heads && states.size(2) == head_dims && states.size(3) == n,
              "ssd_decode: states must be [slots, heads, head dims, state dims]");
  const StateRows state_rows = checked_state_rows(op, slots, sources, rows, states.size(0));
  at::Tensor out = at::empty({rows, heads, head_dims}, x.options());
  const SsdArgs args{x.data_ptr<float>(),
                     steps.data_ptr<float>(),
                     b.data_ptr<float>(),
                     c.data_ptr<float>(),
                     rates.data_ptr<float>(),
                     states.data_ptr<float>(),
                     state_rows.slots,
                     state_rows.sources,
                     out.data_ptr<float>(),
                     heads,
                     groups,
                     head_dims,
                     n};
  for_each_row_head(rows, heads, state_rows.sources != nullptr, [&] {
    return [&args](int64_t row, int64_t head) { scan_task(args, row, head); };
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "ssd_decode(Tensor x, Tensor steps, Tensor b, Tensor c, Tensor rates, Tensor(a!) states, "
      "Tensor slots, Tensor? sources=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("ssd_decode", &conveyor::ssd_decode); }
