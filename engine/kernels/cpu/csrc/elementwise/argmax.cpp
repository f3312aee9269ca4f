// Greedy choice over fp32 logits: each row's index of its largest value, as torch.argmax(dim=-1)
// picks it (the first of equal maxima; the first NaN where a row has one).
//
// x    [rows, vocab] fp32, contiguous, vocab >= 1
// out  [rows]        int64
//
// torch's argmax compares one element at a time; this takes the row's maximum eight lanes at a
// time with AVX2, then finds its first position eight lanes at a time (a row of the default
// model's 49152 logits stays in L2 between the two passes). Rows are split over torch's threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__)
#include <immintrin.h>
#define CONVEYOR_ARGMAX_SIMD 1
#endif

namespace {

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(row[i])) return i;
  return -1;
}

int64_t first_index_of(const float* row, int64_t n, float value) {
  int64_t i = 0;
#ifdef CONVEYOR_ARGMAX_SIMD
  const __m256 target = _mm256_set1_ps(value);
  for (; i + 8 <= n; i += 8) {
    const int mask =
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
    if (mask != 0) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
#endif
  for (; i < n; ++i)
    if (row[i] == value) return i;
  return 0;  // not reached: value is one of the row's elements
}

int64_t row_argmax(const float* row, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  bool nan = false;
#ifdef CONVEYOR_ARGMAX_SIMD
  if (n >= 8) {
    __m256 best = _mm256_set1_ps(top);
    __m256 unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      best = _mm256_max_ps(v, best);  // a NaN in v keeps best; the NaN is noted apart
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best);
    for (const float lane : lanes) top = std::max(top, lane);
    nan = _mm256_movemask_ps(unordered) != 0;
  }
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(row[i]);
    top = std::max(top, row[i]);
  }
  if (nan) return first_nan(row, n);
  return first_index_of(row, n, top);
}

}  // namespace

namespace conveyor {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1, "argmax_rows: x must be [rows, vocab >= 1]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "argmax_rows: x must be fp32");
  TORCH_CHECK(x.is_contiguous(), "argmax_rows: x must be contiguous");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // About 64k elements per task: one row of a small vocabulary does not start a thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * n, n);
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("argmax_rows", &conveyor::argmax_rows); }
