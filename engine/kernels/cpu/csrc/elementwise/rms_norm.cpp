// RMSNorm over the last dim of fp32 rows in one pass per row: y = w * x / sqrt(mean(x^2) + eps),
// the operations of Hugging Face's LlamaRMSNorm for fp32 inputs.
//
// x  [rows, dim] fp32, contiguous
// w  [dim]       fp32
// y  [rows, dim] fp32, or with bf16_out (AVX-512 BF16) rounded to bf16 as a bf16 product rounds
//                its input rows, for the q/k/v and gate/up products to take as they are
//
// `head_rms_norm` norms each head of q and k rows [tokens, heads, dim] (Qwen3's per-head q/k
// norms: a `[heads, dim]` weight, the q heads' then the k heads'), a head a row of the same loop;
// `all_heads_rms_norm` norms q's heads as one row and k's as another (OLMo 2's q/k norms).
//
// torch's CPU rms_norm runs as half a dozen separate ops (pow, mean, add, rsqrt, mul, mul), about
// 50 us a call for one decode row, sixty calls a step. Here a row is one loop to sum squares and
// one to scale; small batches run on the calling thread without waking the others.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "bf16_round.h"
#include "ops.h"
#include "pass_split.h"

namespace {

// One row. Not inlined: a single compiled copy (one order of the vectorized sum of squares)
// serves the fp32 and the bf16 rows alike, so the bf16 rows are the fp32 rows rounded.
__attribute__((noinline)) void normalize_row(const float* in, const float* w, float* out,
                                             int64_t dim, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < dim; ++d) squares += in[d] * in[d];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) out[d] = w[d] * (in[d] * inv);
}

void normalize_rows(const float* x, const float* w, float* y, int64_t dim, float eps, int64_t begin,
                    int64_t end) {
  for (int64_t row = begin; row < end; ++row)
    normalize_row(x + row * dim, w, y + row * dim, dim, eps);
}

#ifdef CONVEYOR_BF16_ROUND
// The same rows rounded to bf16 (to nearest, ties to even) as a bf16 product rounds its input.
void normalize_rows_bf16(const float* x, const float* w, uint16_t* y, int64_t dim, float eps,
                         int64_t begin, int64_t end) {
  std::vector<float> row(dim);
  for (int64_t r = begin; r < end; ++r) {
    normalize_row(x + r * dim, w, row.data(), dim, eps);
    conveyor::round_to_bf16(row.data(), dim, y + r * dim);
  }
}
#endif

}  // namespace

namespace conveyor {

void rms_norm_rows(const float* x, const float* weight, float* out32, uint16_t* out16, int64_t dim,
                   float eps, int64_t begin, int64_t end) {
  if (out32 != nullptr) {
    normalize_rows(x, weight, out32, dim, eps, begin, end);
    return;
  }
#ifndef CONVEYOR_BF16_ROUND
  TORCH_CHECK(false, "rms_norm: bf16 rows need AVX-512 BF16");
#else
  normalize_rows_bf16(x, weight, out16, dim, eps, begin, end);
#endif
}

void rms_norm_heads(const float* x, int64_t x_stride, const float* weight, float* out,
                    int64_t out_stride, int64_t heads, int64_t dim, float eps, int64_t begin,
                    int64_t end) {
  for (int64_t r = begin; r < end; ++r)
    for (int64_t h = 0; h < heads; ++h)
      normalize_row(x + r * x_stride + h * dim, weight + h * dim, out + r * out_stride + h * dim,
                    dim, eps);
}

at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 2 && weight.size(0) == x.size(1) &&
                  weight.size(1) == x.size(2),
              "head_rms_norm: x [tokens, heads, dim] and weight [heads, dim] do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "head_rms_norm: x and weight must be fp32");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2) && weight.is_contiguous(),
              "head_rms_norm: heads and dims must be contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, tokens, rows_per_task(heads * dim), [&](int64_t begin, int64_t end) {
    rms_norm_heads(xp, x.stride(0), wp, op, heads * dim, heads, dim, e, begin, end);
  });
  return out;
}

void rms_norm_q_and_k(const float* x, int64_t x_stride, const float* weight, float* out,
                      int64_t out_stride, int64_t q_size, int64_t k_size, float eps, int64_t begin,
                      int64_t end) {
  rms_norm_heads(x, x_stride, weight, out, out_stride, 1, q_size, eps, begin, end);
  rms_norm_heads(x + q_size, x_stride, weight + q_size, out + q_size, out_stride, 1, k_size, eps,
                 begin, end);
}

at::Tensor all_heads_rms_norm(const at::Tensor& x, const at::Tensor& weight, int64_t q_heads,
                              double eps) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 1 && weight.size(0) == x.size(1) * x.size(2) &&
                  q_heads > 0 && q_heads < x.size(1),
              "all_heads_rms_norm: x [tokens, q heads + kv heads, dim] and weight "
              "[(q heads + kv heads) * dim] do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "all_heads_rms_norm: x and weight must be fp32");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2) && weight.is_contiguous(),
              "all_heads_rms_norm: heads and dims must be contiguous");
  const int64_t tokens = x.size(0), width = x.size(1) * x.size(2), q_size = q_heads * x.size(2);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, tokens, rows_per_task(width), [&](int64_t begin, int64_t end) {
    rms_norm_q_and_k(xp, x.stride(0), wp, op, width, q_size, width - q_size, e, begin, end);
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: x [rows, dim] and weight [dim] shapes do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: x and weight must be fp32");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: inputs must be contiguous");
  const int64_t rows = x.size(0), dim = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
#ifndef CONVEYOR_BF16_ROUND
  TORCH_CHECK(!bf16_out, "rms_norm: bf16 rows need AVX-512 BF16");
#endif
  at::Tensor out =
      bf16_out ? at::empty({rows, dim}, x.options().dtype(at::kBFloat16)) : at::empty_like(x);
  float* out32 = bf16_out ? nullptr : out.data_ptr<float>();
  uint16_t* out16 = bf16_out ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, rows, rows_per_task(dim), [&](int64_t begin, int64_t end) {
    rms_norm_rows(xp, wp, out32, out16, dim, e, begin, end);
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool bf16_out=False) -> Tensor");
  m.def("head_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("all_heads_rms_norm(Tensor x, Tensor weight, int q_heads, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("rms_norm", &conveyor::rms_norm);
  m.impl("head_rms_norm", &conveyor::head_rms_norm);
  m.impl("all_heads_rms_norm", &conveyor::all_heads_rms_norm);
}
