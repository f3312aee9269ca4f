// Paged decode attention for the CPU: one query token per sequence attends over its K/V read
// in place from the paged cache, with no gather into a contiguous copy.
//
// query      [seqs, heads, head_dim]            (rows may be strided; heads and dims contiguous)
// key/value  [blocks, block_size, kv_heads, head_dim]   (one layer of the cache, contiguous)
// table      [seqs, width] int64 block ids
// lens       [seqs] int64 tokens to attend to
// returns    [seqs, heads, head_dim] in the query's dtype
//
// Work is split over (sequence, kv head) pairs; each pair reads its K and V rows once and serves
// every query head of its group (grouped-query attention). Scores are kept for the whole
// sequence, so the softmax is exact rather than online.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

struct Shape {
  int64_t heads, kv_heads, dim, block_size, width, query_stride;
  float scale;
};

template <typename T>
inline void load_row(const T* src, float* dst, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

inline void axpy(float w, const float* x, float* y, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) y[d] += w * x[d];
}

// K or V rows of one kv head inside one block: `count` rows, `stride` elements apart.
template <typename T>
inline const float* rows_as_float(const T* src, int64_t count, int64_t stride, int64_t dim,
                                  float* scratch, int64_t& row_stride) {
  if constexpr (std::is_same_v<T, float>) {
    row_stride = stride;
    return src;
  } else {
    for (int64_t r = 0; r < count; ++r) load_row(src + r * stride, scratch + r * dim, dim);
    row_stride = dim;
    return scratch;
  }
}

inline void softmax_weights(float* scores, int64_t len, float& total) {
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) peak = std::max(peak, scores[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    scores[t] = std::exp(scores[t] - peak);
    sum += scores[t];
  }
  total = sum;
}

template <typename T>
void attend_group(const T* query, const T* key, const T* value, const int64_t* blocks,
                  int64_t len, int64_t kv_head, const Shape& s, T* out) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim, bs = s.block_size;
  const int64_t token_stride = s.kv_heads * dim, block_stride = bs * token_stride;
  std::vector<float> q(group * dim), scratch(bs * dim), acc(group * dim, 0.f);
  std::vector<float> scores(group * len), total(group);
  for (int64_t g = 0; g < group; ++g) {
    load_row(query + (kv_head * group + g) * dim, q.data() + g * dim, dim);
    for (int64_t d = 0; d < dim; ++d) q[g * dim + d] *= s.scale;
  }
  const int64_t num_blocks = (len + bs - 1) / bs;
  int64_t row_stride = 0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * bs, count = std::min(bs, len - first);
    const float* k = rows_as_float(key + blocks[b] * block_stride + kv_head * dim, count,
                                   token_stride, dim, scratch.data(), row_stride);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t r = 0; r < count; ++r)
        scores[g * len + first + r] = dot(q.data() + g * dim, k + r * row_stride, dim);
  }
  for (int64_t g = 0; g < group; ++g) softmax_weights(scores.data() + g * len, len, total[g]);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * bs, count = std::min(bs, len - first);
    const float* v = rows_as_float(value + blocks[b] * block_stride + kv_head * dim, count,
                                   token_stride, dim, scratch.data(), row_stride);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t r = 0; r < count; ++r)
        axpy(scores[g * len + first + r], v + r * row_stride, acc.data() + g * dim, dim);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    T* dst = out + (kv_head * group + g) * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[g * dim + d] * inv);
  }
}

template <typename T>
void run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
         const at::Tensor& table, const at::Tensor& lens, at::Tensor& out,
         const Shape& s) {
  const T* q = query.data_ptr<T>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  const int64_t* blocks = table.data_ptr<int64_t>();
  const int64_t* seq_lens = lens.data_ptr<int64_t>();
  T* o = out.data_ptr<T>();
  const int64_t items = query.size(0) * s.kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.kv_heads, kv_head = item % s.kv_heads;
      attend_group<T>(q + seq * s.query_stride, k, v, blocks + seq * s.width, seq_lens[seq],
                      kv_head, s, o + seq * s.heads * s.dim);
    }
  });
}

at::Tensor paged_decode(at::Tensor query, at::Tensor key, at::Tensor value,
                           at::Tensor table, at::Tensor lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && value.sizes() == key.sizes(),
              "paged_decode: query [seqs, heads, dim], key/value [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_decode: query heads and dims must be contiguous");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous(), "paged_decode: cache must be contiguous");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "paged_decode: query and cache dtypes differ");
  TORCH_CHECK(query.size(2) == key.size(3) && query.size(1) % key.size(2) == 0,
              "paged_decode: head shapes do not match");
  table = table.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  TORCH_CHECK(table.size(0) == query.size(0) && lens.size(0) == query.size(0),
              "paged_decode: one block table row and length per sequence");
  const Shape s{query.size(1), key.size(2), query.size(2), key.size(1), table.size(1),
                query.stride(0), static_cast<float>(scale)};
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  switch (query.scalar_type()) {
    case at::kFloat: run<float>(query, key, value, table, lens, out, s); break;
    case at::kBFloat16: run<c10::BFloat16>(query, key, value, table, lens, out, s); break;
    case at::kHalf: run<c10::Half>(query, key, value, table, lens, out, s); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(conveyor, m) {
  m.def("paged_decode(Tensor query, Tensor key, Tensor value, Tensor table, Tensor lens, float scale) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
