// Top-k, top-p (nucleus) and min-p sampling on the CPU: each row's token drawn from the running
// sum of its kept tokens' probabilities, without sorting the row.
//
// x        [rows, vocab] fp32, contiguous: temperature-scaled logits, -inf where ruled out
// top_k    [rows] int64, in [1, vocab] (vocab: no top-k)
// top_p    [rows] fp32, in (0, 1]
// min_p    [rows] fp32, in [0, 1]
// uniforms [rows] fp32, in [0, 1)
// out      [rows] int64
//
// A row's top-k is every token at least its k-th largest logit (ties kept, as vLLM keeps them);
// its nucleus, over the top-k renormalised, every token whose probability mass strictly above it
// is below top_p (the best token always, and every token tied with the last one it needs), as
// engine/worker/top_k_top_p.py keeps them; min_p then drops the tokens whose probability is
// below min_p times the best one's. The draw is the first token whose running sum of the kept
// weights, in token order, passes uniforms[row] of their total, as `inverse_cdf` draws it.
//
// Passes over a row: its largest and smallest logits; each token's weight exp(x - largest)
// (stored; eight lanes at a time with AVX2) counted and summed into one of kBuckets buckets by
// logit, largest first; the k-th largest lies in the first bucket whose running count reaches
// k, the nucleus' edge in the first whose running mass reaches top_p of the top-k's, and only
// the bucket that holds each is sorted to find it; the kept weights summed by blocks;
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
  std::vector<int64_t> counts;
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
  int64_t* counts = s.counts.data();
  std::fill(mass, mass + kBuckets, 0.0);
  std::fill(counts, counts + kBuckets, 0);
  for (int64_t j = 0; j < n; ++j) {
    mass[b[j]] += w[j];
    ++counts[b[j]];
  }
  for (int64_t k = 0; k < kBuckets; ++k) total += mass[k];
  return total;
}

// The logits of bucket `bucket` at least `floor`, sorted, largest first, into s.edge.
void sorted_bucket(const float* x, int64_t n, int32_t bucket, float floor, Scratch& s) {
  s.edge.clear();
  for (int64_t i = 0; i < n; ++i)
    if (s.buckets[i] == bucket && x[i] >= floor) s.edge.push_back(x[i]);
  std::sort(s.edge.begin(), s.edge.end(), std::greater<float>());
}

// The k-th largest logit (k < n): in the first bucket whose running count reaches k, sorted.
// The mass of the tokens below it is taken out of s.mass; the top-k's mass is returned.
double cut_top_k(const float* x, int64_t n, int64_t k, float top, float* kth, Scratch& s) {
  int64_t before = 0;
  int32_t bucket = 0;
  while (before + s.counts[bucket] < k) before += s.counts[bucket++];
  sorted_bucket(x, n, bucket, -std::numeric_limits<float>::infinity(), s);
  *kth = s.edge[k - before - 1];
  double kept = 0.0;
  for (const float v : s.edge)
    if (v >= *kth) kept += weight_of(v - top);
  s.mass[bucket] = kept;
  std::fill(s.mass.begin() + bucket + 1, s.mass.end(), 0.0);
  double total = 0.0;
  for (int32_t b = 0; b < kBuckets; ++b) total += s.mass[b];
  return total;
}

// The smallest logit of the nucleus among the logits at least `floor`: in the first bucket
// whose running mass reaches `reach`, its logits sorted, largest first, and summed on from the
// mass before it.
float nucleus_edge(const float* x, int64_t n, float top, float floor, double reach, Scratch& s) {
  double before = 0.0;
  int32_t edge_bucket = -1;
  for (int32_t k = 0; k < kBuckets; ++k) {
    if (before + s.mass[k] >= reach) {
      edge_bucket = k;
      break;
    }
    before += s.mass[k];
  }
  if (edge_bucket < 0) return floor;  // rounding: keep all
  sorted_bucket(x, n, edge_bucket, floor, s);
  if (s.edge.empty()) return floor;
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

int64_t draw_row(const float* x, int64_t n, int64_t top_k, float top_p, float min_p, float uniform,
                 Scratch& s) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const Range range = row_range(x, n);
  if (range.nan >= 0) return range.nan;
  if (range.top == -kInf) return n - 1;
  if (range.top == kInf) return std::find(x, x + n, kInf) - x;
  const float low = std::min(std::max(range.low, range.top - kSpan), range.top - 1e-3f);
  // Finite, so that no logit's bucket is 0 * inf.
  const float scale = static_cast<float>(kBuckets) / std::max(range.top - low, 1e-30f);
  const bool limited = top_k < n;
  double total = weigh(x, n, range.top, scale, top_p < 1.f || limited, s);
  float edge = -kInf;
  if (limited) total = cut_top_k(x, n, top_k, range.top, &edge, s);
  if (top_p < 1.f) edge = nucleus_edge(x, n, range.top, edge, top_p * total, s);
  // The best token's weight is exp(0) = 1: min-p's floor is min_p itself.
  const double kept = keep(x, n, edge, min_p, s);
  // Strictly below the total, so that some token's running sum passes it.
  const double point = std::min(static_cast<double>(uniform) * kept, std::nextafter(kept, 0.0));
  return walk(n, point, s);
}

}  // namespace

namespace conveyor {

at::Tensor nucleus_draw(const at::Tensor& x, const at::Tensor& top_k, const at::Tensor& top_p,
                        const at::Tensor& min_p, const at::Tensor& uniforms) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "nucleus_draw: x must be contiguous fp32 [rows, vocab >= 1]");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(top_k.dim() == 1 && top_k.size(0) == rows && top_k.scalar_type() == at::kLong &&
                  top_k.is_contiguous(),
              "nucleus_draw: top_k must be contiguous int64 [rows]");
  for (const at::Tensor* t : {&top_p, &min_p, &uniforms})
    TORCH_CHECK(
        t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat && t->is_contiguous(),
        "nucleus_draw: top_p, min_p and uniforms must be contiguous fp32 [rows]");
  const int64_t* kp = top_k.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(1 <= kp[r] && kp[r] <= n, "nucleus_draw: top_k must be in [1, vocab]");
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
    s.counts.resize(kBuckets);
    for (int64_t r = begin; r < end; ++r)
      op[r] = draw_row(xp + r * n, n, kp[r], pp[r], mp[r], up[r], s);
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "nucleus_draw(Tensor x, Tensor top_k, Tensor top_p, Tensor min_p, Tensor uniforms) -> "
      "Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("nucleus_draw", &conveyor::nucleus_draw); }
