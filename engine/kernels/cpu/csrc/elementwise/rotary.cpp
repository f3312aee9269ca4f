// Rotary embedding in Hugging Face's half-split layout over fp32 q/k rows, in one pass:
// out = x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x[half:], x[:half]); or, with
// `pairs`, over neighbouring dims (GLM's, ERNIE 4.5's, Helium's): dims 2i and 2i + 1 turn by
// the i-th frequency (cos[i], sin[i] of the table's first half), out[2i] = x[2i] * cos[i] +
// -x[2i + 1] * sin[i] and out[2i + 1] = x[2i + 1] * cos[i] + x[2i] * sin[i].
//
// x         [tokens, heads, dim] fp32; heads and dims contiguous, tokens at any stride (a view
//           of the fused qkv projection)
// cos, sin  [tokens, 1, rotary dim] fp32; dims contiguous, tokens at any stride. A rotary dim
//           short of the heads' (a partial rotary, Phi-4-mini's) turns each head's first dims,
//           their two halves, and passes the rest as they are; 0 turns nothing (a NoPE layer)
// returns   [tokens, heads, dim] fp32, contiguous
//
// torch runs this as seven ops (two slices, neg, cat, two muls, add) per layer. Products and the
// sum are rounded separately, as torch rounds them, so the result is the same to the bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "ops.h"
#include "pass_split.h"

namespace conveyor {

__attribute__((optimize("fp-contract=off"))) void rotary_rows(const float* x, int64_t x_stride,
                                                              const float* cos, const float* sin,
                                                              int64_t cs_stride, float* out,
                                                              int64_t heads, int64_t dim,
                                                              int64_t rotary_dim, int64_t begin,
                                                              int64_t end, bool pairs) {
  const int64_t half = rotary_dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + t * cs_stride;
    const float* s = sin + t * cs_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const float* in = x + t * x_stride + h * dim;
      float* o = out + (t * heads + h) * dim;
      for (int64_t i = 0; pairs && i < half; ++i) {
        const float even = in[2 * i], odd = in[2 * i + 1];
        const float a = even * c[i], b = -odd * s[i];
        const float e = odd * c[i], f = even * s[i];
        o[2 * i] = a + b;
        o[2 * i + 1] = e + f;
      }
      for (int64_t d = 0; !pairs && d < half; ++d) {
        const float a = in[d] * c[d];
        const float b = -in[d + half] * s[d];
        o[d] = a + b;
      }
      for (int64_t d = half; !pairs && d < rotary_dim; ++d) {
        const float a = in[d] * c[d];
        const float b = in[d - half] * s[d];
        o[d] = a + b;
      }
      for (int64_t d = rotary_dim; d < dim; ++d) o[d] = in[d];
    }
  }
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool pairs) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 3 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && cos.size(1) == 1 && cos.size(2) <= x.size(2) &&
                  cos.size(2) % 2 == 0,
              "rotary: x [tokens, heads, dim] and cos/sin [tokens, 1, dim] do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rotary: x, cos and sin must be fp32");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2) && cos.stride(2) == 1 &&
                  sin.stride(2) == 1 && cos.stride(0) == sin.stride(0),
              "rotary: heads and dims must be contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, rows_per_task(heads * dim), [&](int64_t begin, int64_t end) {
    rotary_rows(xp, x.stride(0), cp, sp, cos.stride(0), op, heads, dim, cos.size(2), begin, end,
                pairs);
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool pairs=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("rotary", &conveyor::rotary); }
