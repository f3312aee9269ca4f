// The gated MLP's activation for fp32 rows in one pass: out = silu(gate) * up (`silu_mul`),
// gelu(gate) * up under tanh's approximation (`gelu_tanh_mul`, Gemma's), or gpt-oss's clamped
// SwiGLU (`clamped_swiglu_mul`), where gate and up are the two halves of each row of the fused
// gate/up projection, read in place.
//
// x    [rows, 2 * inter] fp32, contiguous
// out  [rows, inter]     fp32
//
// torch runs this as a slice, the activation and mul: two ops and a temporary a layer (GELU's
// approximation alone is several, the clamped SwiGLU six). silu(g) is g / (1 + exp(-g)), as
// torch computes it, GELU's the same over 2u and the clamped SwiGLU's sigmoid likewise
// (`fast_exp.h`), with exp in plain arithmetic, eight lanes at a time with AVX2. The products
// over gate/up panel pairs and the layer of experts apply the same functions (`gate_activation.h`).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "gate_activation.h"
#include "ops.h"
#include "pass_split.h"

namespace {

at::Tensor gated_rows(const at::Tensor& x, const char* op, const conveyor::GateActivation& act) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, op, ": x must be [rows, 2 * inter]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be fp32");
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op_out = out.data_ptr<float>();
  at::parallel_for(0, rows, conveyor::rows_per_task(inter), [&](int64_t begin, int64_t end) {
    conveyor::gate_rows(act, xp, op_out, inter, begin, end);
  });
  return out;
}

}  // namespace

namespace conveyor {

at::Tensor silu_mul(const at::Tensor& x) {
  return gated_rows(x, "silu_mul", GateActivation::silu_or_gelu(false));
}

at::Tensor gelu_tanh_mul(const at::Tensor& x) {
  return gated_rows(x, "gelu_tanh_mul", GateActivation::silu_or_gelu(true));
}

at::Tensor clamped_swiglu_mul(const at::Tensor& x, double alpha, double limit) {
  TORCH_CHECK(limit > 0, "clamped_swiglu_mul: limit must be positive");
  return gated_rows(x, "clamped_swiglu_mul", GateActivation::clamped(alpha, limit));
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_mul(Tensor x) -> Tensor");
  m.def("clamped_swiglu_mul(Tensor x, float alpha, float limit) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("silu_mul", &conveyor::silu_mul);
  m.impl("gelu_tanh_mul", &conveyor::gelu_tanh_mul);
  m.impl("clamped_swiglu_mul", &conveyor::clamped_swiglu_mul);
}
