// A few rows through a linear layer whose weight is held in fp16: y = x w^T + bias, with x, bias
// and y in fp32.
//
// x     [rows, in]  fp32, contiguous
// w     [out, in]   fp16, contiguous
// bias  [out]       fp32, optional
//
// With a few rows the product is bound by streaming w from memory, so the output columns are
// split over torch's threads and each thread streams its own rows of w exactly once, converting
// 8 fp16 values at a time (F16C) and reusing them for up to 4 rows of x from cache. Without
// AVX2, F16C and FMA the op refuses to run and callers keep fbgemm's kernel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define CONVEYOR_HALF_LINEAR_SIMD 1
#endif

namespace {

#ifdef CONVEYOR_HALF_LINEAR_SIMD
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One MR x NR tile of outputs: MR rows of x against NR rows of w, K in steps of 8.
template <int MR, int NR>
inline void tile(const float* x, int64_t ldx, const at::Half* w, int64_t ldw, int64_t K,
                 float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n)
      wv[n] = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * ldw + k)));
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float sum = hsum(acc[m][n]);
      for (int64_t r = k; r < K; ++r)
        sum += x[m * ldx + r] * static_cast<float>(w[n * ldw + r]);
      out[m * ldo + n] = sum;
    }
}

template <int MR, int NR>
void rows(const float* x, int64_t ldx, const at::Half* w, int64_t K, float* out, int64_t ldo,
          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<MR, NR>(x, ldx, w + n * K, K, K, out + n, ldo);
  for (; n < n1; ++n) tile<MR, 1>(x, ldx, w + n * K, K, K, out + n, ldo);
}

void block(const float* x, const at::Half* w, float* out, int64_t M, int64_t N, int64_t K,
           int64_t n0, int64_t n1) {
  // Each thread streams its own columns of w once; the x rows are reused from cache.
  constexpr int64_t kStrip = 16;
  for (int64_t s = n0; s < n1; s += kStrip) {
    const int64_t e = std::min(s + kStrip, n1);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows<4, 2>(x + m * K, K, w, K, out + m * N, N, s, e);
    switch (M - m) {
      case 3: rows<3, 2>(x + m * K, K, w, K, out + m * N, N, s, e); break;
      case 2: rows<2, 4>(x + m * K, K, w, K, out + m * N, N, s, e); break;
      case 1: rows<1, 4>(x + m * K, K, w, K, out + m * N, N, s, e); break;
      default: break;
    }
  }
}
#endif

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias) {
#ifndef CONVEYOR_HALF_LINEAR_SIMD
  TORCH_CHECK(false, "half_linear needs AVX2, F16C and FMA");
#else
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "half_linear: x [rows, in] and w [out, in] shapes do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kHalf,
              "half_linear: x must be fp32 and w fp16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "half_linear: inputs must be contiguous");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) &&
                    bias->scalar_type() == at::kFloat,
                "half_linear: bias must be fp32 [out]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const at::Half* wp = w.data_ptr<at::Half>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16,
                   [&](int64_t n0, int64_t n1) { block(xp, wp, op, M, N, K, n0, n1); });
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("half_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("half_linear", &half_linear); }
