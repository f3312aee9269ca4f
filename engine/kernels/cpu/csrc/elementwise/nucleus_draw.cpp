// Top-p (nucleus) sampling on the CPU: each row's token drawn from the running sum of its
// nucleus' probabilities, without sorting the row.
//
// x        [rows, vocab] fp32, contiguous: temperature-scaled logits, -inf where ruled out
// top_p    [rows] fp32, in (0, 1]
// min_p    [rows] fp32, in [0, 1]
// uniforms [rows] fp32, in [0, 1)
// out      [rows] int64
//
// A row's nucleus is every token whose probability mass strictly above it is below top_p (the
// best token always, and every token tied with the last one it needs), as
// engine/worker/top_k_top_p.py keeps it; min_p then drops the tokens whose probability is below
// min_p times the best one's. The draw is the first token whose running sum of the kept
// weights, in token order, passes uniforms[row] of their total, as `inverse_cdf` draws it.
//
// Passes over a row: its largest and smallest logits; each token's weight exp(x - largest)
// (stored; eight lanes at a time with AVX2) summed into one of kBuckets buckets by logit,
// largest first; the edge lies in the first bucket whose running mass reaches top_p of the
// total, and only that bucket's logits are sorted to find it; the kept weights summed by blocks;
// the blocks walked to the one the draw falls in, and its tokens one by one. A row whose logits
// are all -inf gets its last token (the caller reads it as ruled out); a row with a NaN its
// first NaN. Rows are split over torch's threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "fast_exp.h"

namespace {

constexpr int64_t kBuckets = 2048;
// Logits this far below the row's largest share the last bucket (weights below e^-40).
constexpr float kSpan = 40.f;
// Tokens whose kept weights are summed together before the draw walks them one by one.
constexpr int64_t kBlock = 64;

// A token's weight: exp(d) for d = x - largest, and 0 where fp32's exp would be subnormal or
// zero (a -inf logit has no weight at all).
inline float weight_of(float d) { return d < conveyor::kExpLow ? 0.f : conveyor::exp_clamped(d); }

// A logit's bucket: 0 for the largest, kBuckets - 1 for the lowest and -inf.
inline int32_t bucket_of(float top, float x, float scale) {
  return static_cast<int32_t>(std::min((top - x) * scale, static_cast<float>(kBuckets - 1)));
}

struct Scratch {
  std::vector<float> weights;
  std::vector<int32_t> buckets;
  std::vector<double> mass;
  std::vector<float> edge;
  std::vector<double> blocks;
};

struct Range {
  float top, low;
  int64_t nan;  // the first NaN's index, or -1
};

Range row_range(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  float low = std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef CONVEYOR_EXP8
  if (n >= 8) {
    __m256 top8 = _mm256_set1_ps(top), low8 = _mm256_set1_ps(low);
    __m256 unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      top8 = _mm256_max_ps(v, top8);  // a NaN in v keeps the running value; noted apart
      low8 = _mm256_min_ps(v, low8);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float tops[8], lows[8];
    _mm256_storeu_ps(tops, top8);
    _mm256_storeu_ps(lows, low8);
    for (int j = 0; j < 8; ++j) {
      top = std::max(top, tops[j]);
      low = std::min(low, lows[j]);
    }
    nan = _mm256_movemask_ps(unordered) != 0;
  }
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    top = std::max(top, x[i]);
    low = std::min(low, x[i]);
  }
  int64_t first_nan = -1;
  if (nan)
    for (int64_t j = 0; j < n && first_nan < 0; ++j)
      if (std::isnan(x[j])) first_nan = j;
  return {top, low, first_nan};
}

// Stores each token's weight and, where `bucketed`, its bucket, adding the weights into `mass`
// by bucket; their total (0 where not `bucketed`: nothing needs it).
double weigh(const float* x, int64_t n, float top, float scale, bool bucketed, Scratch& s) {
  float* w = s.weights.data();
  int32_t* b = s.buckets.data();
  int64_t i = 0;
#ifdef CONVEYOR_EXP8
  const __m256 top8 = _mm256_set1_ps(top), scale8 = _mm256_set1_ps(scale);
  const __m256 low8 = _mm256_set1_ps(conveyor::kExpLow);
  const __m256 last8 = _mm256_set1_ps(static_cast<float>(kBuckets - 1));
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 d = _mm256_sub_ps(v, top8);
    const __m256 e = conveyor::exp8_clamped(d);
    _mm256_storeu_ps(w + i, _mm256_andnot_ps(_mm256_cmp_ps(d, low8, _CMP_LT_OQ), e));
    if (bucketed) {
      const __m256 at = _mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(top8, v), scale8), last8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b + i), _mm256_cvttps_epi32(at));
    }
  }
#endif
  for (; i < n; ++i) {
    w[i] = weight_of(x[i] - top);
    if (bucketed) b[i] = bucket_of(top, x[i], scale);
  }
  if (!bucketed) return 0.0;
  double total = 0.0;
  double* mass = s.mass.data();
  std::fill(mass, mass + kBuckets, 0.0);
  for (int64_t j = 0; j < n; ++j) mass[b[j]] += w[j];
  for (int64_t k = 0; k < kBuckets; ++k) total += mass[k];
  return total;
}

// The smallest logit of the nucleus: the first bucket whose running mass reaches `reach`, its
// logits sorted, largest first, and summed on from the mass before it.
float nucleus_edge(const float* x, int64_t n, float top, double reach, Scratch& s) {
  double before = 0.0;
  int32_t edge_bucket = -1;
  for (int32_t k = 0; k < kBuckets; ++k) {
    if (before + s.mass[k] >= reach) {
      edge_bucket = k;
      break;
    }
    before += s.mass[k];
  }
  if (edge_bucket < 0) return -std::numeric_limits<float>::infinity();  // rounding: keep all
  s.edge.clear();
  for (int64_t i = 0; i < n; ++i)
    if (s.buckets[i] == edge_bucket) s.edge.push_back(x[i]);
  std::sort(s.edge.begin(), s.edge.end(), std::greater<float>());
  for (const float v : s.edge) {
    before += weight_of(v - top);
    if (before >= reach) return v;
  }
  return s.edge.back();
}

// Zeroes the weights of tokens outside the nucleus and below the min-p floor; sums the rest
// by blocks of kBlock tokens; their total.
double keep(const float* x, int64_t n, float edge, float floor, Scratch& s) {
  float* w = s.weights.data();
  for (int64_t i = 0; i < n; ++i) w[i] = (x[i] >= edge && w[i] >= floor) ? w[i] : 0.f;
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  s.blocks.resize(num_blocks);
  double total = 0.0;
  for (int64_t block = 0; block < num_blocks; ++block) {
    const int64_t begin = block * kBlock, end = std::min(n, begin + kBlock);
    float lanes[8] = {};
    int64_t i = begin;
    for (; i + 8 <= end; i += 8)
      for (int j = 0; j < 8; ++j) lanes[j] += w[i + j];
    double sum = 0.0;
    for (const float lane : lanes) sum += lane;
    for (; i < end; ++i) sum += w[i];
    s.blocks[block] = sum;
    total += sum;
  }
  return total;
}

// The first token whose running sum of kept weights passes `point`: the blocks are walked to
// the one it falls in, then its tokens one by one (on past it, should rounding leave the sum
// short); the last token of any weight where nothing passes.
int64_t walk(int64_t n, double point, const Scratch& s) {
  const float* w = s.weights.data();
  double sum = 0.0;
  int64_t block = 0;
  const int64_t num_blocks = static_cast<int64_t>(s.blocks.size());
  while (block < num_blocks && sum + s.blocks[block] <= point) sum += s.blocks[block++];
  int64_t last = -1;
  for (int64_t i = block * kBlock; i < n; ++i) {
    if (w[i] <= 0.f) continue;
    sum += w[i];
    last = i;
    if (sum > point) return i;
  }
  if (last >= 0) return last;
  for (int64_t i = n - 1; i >= 0; --i)
    if (w[i] > 0.f) return i;
  return n - 1;
}

int64_t draw_row(const float* x, int64_t n, float top_p, float min_p, float uniform,
                 Scratch& s) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const Range range = row_range(x, n);
  if (range.nan >= 0) return range.nan;
  if (range.top == -kInf) return n - 1;
  if (range.top == kInf) return std::find(x, x + n, kInf) - x;
  const float low = std::min(std::max(range.low, range.top - kSpan), range.top - 1e-3f);
  // Finite, so that no logit's bucket is 0 * inf.
  const float scale = static_cast<float>(kBuckets) / std::max(range.top - low, 1e-30f);
  const bool bucketed = top_p < 1.f;
  const double total = weigh(x, n, range.top, scale, bucketed, s);
  const float edge = bucketed ? nucleus_edge(x, n, range.top, top_p * total, s) : -kInf;
  // The best token's weight is exp(0) = 1: min-p's floor is min_p itself.
  const double kept = keep(x, n, edge, min_p, s);
  // Strictly below the total, so that some token's running sum passes it.
  const double point = std::min(static_cast<double>(uniform) * kept, std::nextafter(kept, 0.0));
  return walk(n, point, s);
}

}  // namespace

namespace conveyor {

at::Tensor nucleus_draw(const at::Tensor& x, const at::Tensor& top_p, const at::Tensor& min_p,
                        const at::Tensor& uniforms) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "nucleus_draw: x must be contiguous fp32 [rows, vocab >= 1]");
  const int64_t rows = x.size(0), n = x.size(1);
  for (const at::Tensor* t : {&top_p, &min_p, &uniforms})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat &&
                    t->is_contiguous(),
                "nucleus_draw: top_p, min_p and uniforms must be contiguous fp32 [rows]");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const float* up = uniforms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    s.weights.resize(n);
    s.buckets.resize(n);
    s.mass.resize(kBuckets);
    for (int64_t r = begin; r < end; ++r)
      op[r] = draw_row(xp + r * n, n, pp[r], mp[r], up[r], s);
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("nucleus_draw(Tensor x, Tensor top_p, Tensor min_p, Tensor uniforms) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("nucleus_draw", &conveyor::nucleus_draw); }
