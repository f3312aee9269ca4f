// The gated MLP's activation for fp32 rows in one pass: out = silu(gate) * up (`silu_mul`), or
// gelu(gate) * up under tanh's approximation (`gelu_tanh_mul`, Gemma's), where gate and up are
// the two halves of each row of the fused gate/up projection, read in place.
//
// x    [rows, 2 * inter] fp32, contiguous
// out  [rows, inter]     fp32
//
// torch runs this as a slice, the activation and mul: two ops and a temporary a layer (GELU's
// approximation alone is several). silu(g) is g / (1 + exp(-g)), as torch computes it, and
// GELU's the same over 2u (`fast_exp.h`), with exp in plain arithmetic, eight lanes at a time
// with AVX2.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "fast_exp.h"
#include "ops.h"
#include "pass_split.h"

namespace {

struct Silu {
  static float one(float x) { return conveyor::silu(x); }
#ifdef CONVEYOR_EXP8
  static __m256 eight(__m256 x) { return conveyor::silu8(x); }
#endif
};

struct GeluTanh {
  static float one(float x) { return conveyor::gelu_tanh(x); }
#ifdef CONVEYOR_EXP8
  static __m256 eight(__m256 x) { return conveyor::gelu_tanh8(x); }
#endif
};

template <typename Act>
void gate_rows(const float* x, float* out, int64_t inter, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const float* gate = x + row * 2 * inter;
    const float* up = gate + inter;
    float* o = out + row * inter;
    int64_t i = 0;
#ifdef CONVEYOR_EXP8
    for (; i + 8 <= inter; i += 8) {
      const __m256 s = Act::eight(_mm256_loadu_ps(gate + i));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < inter; ++i) o[i] = Act::one(gate[i]) * up[i];
  }
}

template <typename Act>
at::Tensor gated_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, op, ": x must be [rows, 2 * inter]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": x must be fp32");
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op_out = out.data_ptr<float>();
  at::parallel_for(0, rows, conveyor::rows_per_task(inter), [&](int64_t begin, int64_t end) {
    gate_rows<Act>(xp, op_out, inter, begin, end);
  });
  return out;
}

}  // namespace

namespace conveyor {

at::Tensor silu_mul(const at::Tensor& x) { return gated_rows<Silu>(x, "silu_mul"); }

at::Tensor gelu_tanh_mul(const at::Tensor& x) { return gated_rows<GeluTanh>(x, "gelu_tanh_mul"); }

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_mul(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("silu_mul", &conveyor::silu_mul);
  m.impl("gelu_tanh_mul", &conveyor::gelu_tanh_mul);
}
