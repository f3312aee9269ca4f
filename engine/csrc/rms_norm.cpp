// RMSNorm over the last dim of fp32 rows in one pass per row: y = w * x / sqrt(mean(x^2) + eps),
// the operations of Hugging Face's LlamaRMSNorm for fp32 inputs.
//
// x  [rows, dim] fp32, contiguous
// w  [dim]       fp32
//
// torch's CPU rms_norm runs as half a dozen separate ops (pow, mean, add, rsqrt, mul, mul), about
// 50 us a call for one decode row, sixty calls a step. Here a row is one loop to sum squares and
// one to scale; small batches run on the calling thread without waking the others.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "task_grain.h"

namespace {

void normalize_rows(const float* x, const float* w, float* y, int64_t dim, float eps,
                    int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const float* in = x + row * dim;
    float* out = y + row * dim;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < dim; ++d) squares += in[d] * in[d];
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] = w[d] * (in[d] * inv);
  }
}

}  // namespace

namespace conveyor {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: x [rows, dim] and weight [dim] shapes do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: x and weight must be fp32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: inputs must be contiguous");
  const int64_t rows = x.size(0), dim = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, rows_per_task(dim), [&](int64_t begin, int64_t end) {
    normalize_rows(xp, wp, op, dim, e, begin, end);
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("rms_norm", &conveyor::rms_norm); }
