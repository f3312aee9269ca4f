// Paged decode attention for the CPU: one query token per sequence attends over its K/V read
// in place from the paged cache, with no gather into a contiguous copy.
//
// query      [seqs, heads, head_dim]            (rows may be strided; heads and dims contiguous)
// key/value  [blocks, block_size, kv_heads, head_dim]   (one layer of the cache, contiguous), in
//            the query's dtype, or bf16/fp16/fp8 (e5m2) under an fp32 query (a narrower cache
//            for a model computed in fp32)
// table      [seqs, width] int64 block ids
// lens       [seqs] int64 tokens to attend to
// window     a sliding window: only each sequence's last `window` tokens are attended to (0:
//            all of them)
// softcap    scores capped as softcap * tanh(score / softcap) before the softmax (0: not)
// sinks      [heads] fp32 logits with no value that join each head's softmax, or undefined
// returns    [seqs, heads, head_dim] in the query's dtype
//
// Work is split over sequences, each to whichever thread is free (or over (sequence, kv head)
// pairs when there are few sequences, a share of them a thread); each task reads its K and V
// once, a block at a time, and serves every query head of each kv head's group (grouped-query
// attention). Scores are kept for the whole sequence, so the softmax is exact rather than
// online. With AVX2, FMA and F16C, the query heads of a kv head (up to
// three at a time) share each K and V load: scores are computed four K rows at a time with one
// reduction for the four, the weighted sums of V rows keep their accumulators in registers for
// a whole block, 16- and 8-bit K/V widen to fp32 as they load, and the next block's cache lines
// are asked for a share at a time while one is computed (blocks lie anywhere in the cache).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "fast_exp.h"
#include "lanes.h"
#include "load8.h"
#include "ops.h"
#include "score_features.h"
#include "scratch.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CONVEYOR_PAGED_SIMD 1
#endif

namespace {

struct Shape {
  int64_t heads, kv_heads, dim, block_size, width, query_stride;
  float scale;
  int64_t window = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;  // [heads], or none

  // Cache elements from one block to the next: its tokens' rows of every kv head.
  int64_t block_stride() const { return block_size * kv_heads * dim; }
};

// What a sequence of `len` tokens attends to: from its block `block` on, `len` tokens counted
// from that block's start, the first `skip` of them outside the window.
struct Span {
  int64_t block, len, skip;
};

inline Span span_of(int64_t len, const Shape& s) {
  const int64_t start = s.window > 0 ? std::max<int64_t>(0, len - s.window) : 0;
  const int64_t block = start / s.block_size;
  return Span{block, len - block * s.block_size, start - block * s.block_size};
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}

#ifdef CONVEYOR_PAGED_SIMD
// Cache elements as floats: a 16-bit cache widens as it loads (`load8.h`).
using conveyor::load8;
#endif

template <typename C>
inline float dot(const float* a, const C* b, int64_t dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) sum += a[d] * static_cast<float>(b[d]);
  return sum;
}

template <typename C>
inline void axpy(float w, const C* x, float* y, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) y[d] += w * static_cast<float>(x[d]);
}

// acc[0, dim) += sum over `count` V rows `stride` elements apart of weights[r] * row r: the
// path for head dims that are not a multiple of 32, or without SIMD.
template <typename C>
inline void weighted_rows(const float* weights, const C* v, int64_t stride, int64_t count,
                          int64_t dim, float* acc) {
  for (int64_t r = 0; r < count; ++r) axpy(weights[r], v + r * stride, acc, dim);
}

#ifdef CONVEYOR_PAGED_SIMD
// Scores of G query heads that share one kv head against 4 K rows `stride` elements apart: each
// K vector is loaded (and widened) once for the G heads, and the 4G accumulators (at most 12)
// keep enough multiply-adds in flight. The four rows' eight-lane sums reduce in one tree.
template <int G, typename C>
inline void group_rows4(const float* q, int64_t dim, const C* k, int64_t stride, float* out,
                        int64_t out_stride) {
  __m256 acc[G][4];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    __m256 rows[4];
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) rows[r] = load8(k + r * stride + d);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      __m256 qv = _mm256_loadu_ps(q + g * dim + d);
      // Held in a register for the four rows: folded into each multiply-add instead, the
      // query's loads outnumbered the multiply-adds.
      __asm__("" : "+v"(qv));
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_fmadd_ps(qv, rows[r], acc[g][r]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const __m256 sums =
        _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    _mm_storeu_ps(out + g * out_stride,
                  _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
  }
}

// acc[g][0, 32) += sum over `count` V rows of weights[g][r] * row r, for G query heads that
// share one kv head: each V vector is loaded (and widened) once for the G heads. Each output is
// summed over the rows in order, as `weighted_rows` sums it.
template <int G, typename C>
inline void group_weighted32(const float* weights, int64_t w_stride, const C* v, int64_t stride,
                             int64_t count, float* acc, int64_t acc_stride) {
  __m256 sum[G][4];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) sum[g][c] = _mm256_loadu_ps(acc + g * acc_stride + 8 * c);
  for (int64_t r = 0; r < count; ++r) {
    const C* row = v + r * stride;
    // One widened vector at a time: three heads' 12 sums, their 3 weights and the vector fill
    // the 16 registers (all four vectors at once spilled a sum to the stack every row).
    __m256 w[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) w[g] = _mm256_broadcast_ss(weights + g * w_stride + r);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256 x = load8(row + 8 * c);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) sum[g][c] = _mm256_fmadd_ps(w[g], x, sum[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + g * acc_stride + 8 * c, sum[g][c]);
}
#endif

// Asks for the next block's cache lines a share at a time while this block is computed: blocks
// lie anywhere in the cache, so the hardware prefetcher cannot guess where the next one starts,
// and the whole block asked for at once came late (a step of 64 sequences at 192 tokens ran 1.5x
// slower than with its lines spread over the block's work). A task reads `rows` rows of
// `row_bytes` each, `stride` bytes apart: whole rows of the block, or one kv head's slice of them.
class Prefetcher {
 public:
  // The next block starts at `base`; its lines are asked for over `calls` calls (at once if 0).
  void start(const void* base, int64_t rows, int64_t stride, int64_t row_bytes, int64_t calls) {
    rest();
    base_ = static_cast<const char*>(base);
    // Whole rows back to back are one run of lines.
    const bool whole = row_bytes == stride;
    rows_ = whole ? 1 : rows;
    stride_ = stride;
    row_bytes_ = whole ? rows * row_bytes : row_bytes;
    row_ = 0;
    line_ = first_line(0);
    const int64_t lines = rows_ * (row_bytes_ / kLine + 1);
    share_ = calls > 0 ? (lines + calls - 1) / calls : lines;
    if (calls == 0) rest();
  }

  // Asks for this call's share.
  void operator()() { ask(share_); }

  // Asks for whatever is left.
  void rest() { ask(std::numeric_limits<int64_t>::max()); }

 private:
  static constexpr int64_t kLine = 64;

  const char* first_line(int64_t row) const {
    const auto at = reinterpret_cast<uintptr_t>(base_ + row * stride_);
    return reinterpret_cast<const char*>(at & ~static_cast<uintptr_t>(kLine - 1));
  }

  const char* row_end(int64_t row) const { return base_ + row * stride_ + row_bytes_; }

  // The row's lines the share has left in one run, then the next row's.
  void ask(int64_t lines) {
    while (lines > 0 && row_ < rows_) {
      const char* end = row_end(row_);
      const int64_t run = std::min<int64_t>(lines, (end - line_ + kLine - 1) / kLine);
      for (int64_t i = 0; i < run; ++i) __builtin_prefetch(line_ + i * kLine, 0, 2);
      line_ += run * kLine;
      lines -= run;
      if (line_ >= end && ++row_ < rows_) line_ = first_line(row_);
    }
  }

  const char* base_ = nullptr;
  const char* line_ = nullptr;
  int64_t rows_ = 0, stride_ = 0, row_bytes_ = 0, row_ = 0, share_ = 0;
};

// How many times `group_scores` over `count` rows asks `ahead` for its share.
inline int64_t score_calls(int64_t count, int64_t group, int64_t dim) {
#ifdef CONVEYOR_PAGED_SIMD
  if (dim % 8 == 0) return count / 4 * ((group + 2) / 3);
#endif
  return 0;
}

// Scores of the `group` query heads of one kv head (queries back to back, `dim` each) against
// `count` K rows, into out[g * out_stride + row], up to three heads sharing each K load.
template <typename C>
inline void group_scores(const float* q, int64_t group, const C* k, int64_t stride, int64_t count,
                         int64_t dim, float* out, int64_t out_stride, Prefetcher& ahead) {
  int64_t r = 0;
#ifdef CONVEYOR_PAGED_SIMD
  if (dim % 8 == 0) {
    for (; r + 4 <= count; r += 4) {
      for (int64_t g = 0; g < group; g += 3) {
        ahead();
        const float* qg = q + g * dim;
        const C* kr = k + r * stride;
        float* o = out + g * out_stride + r;
        switch (std::min<int64_t>(3, group - g)) {
          case 3: group_rows4<3>(qg, dim, kr, stride, o, out_stride); break;
          case 2: group_rows4<2>(qg, dim, kr, stride, o, out_stride); break;
          default: group_rows4<1>(qg, dim, kr, stride, o, out_stride); break;
        }
      }
    }
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = r; i < count; ++i)
      out[g * out_stride + i] = dot(q + g * dim, k + i * stride, dim);
}

// How many times `group_values` asks `ahead` for its share.
inline int64_t value_calls(int64_t group, int64_t dim) {
#ifdef CONVEYOR_PAGED_SIMD
  if (dim % 32 == 0) return (group + 2) / 3 * (dim / 32);
#endif
  return 0;
}

// The weighted V rows of the `group` query heads of one kv head (weights[g * w_stride + row]),
// added to acc[g * dim, (g + 1) * dim), up to three heads sharing each V load.
template <typename C>
inline void group_values(const float* weights, int64_t group, int64_t w_stride, const C* v,
                         int64_t stride, int64_t count, int64_t dim, float* acc,
                         Prefetcher& ahead) {
#ifdef CONVEYOR_PAGED_SIMD
  if (dim % 32 == 0) {
    for (int64_t g = 0; g < group; g += 3) {
      const float* w = weights + g * w_stride;
      for (int64_t d = 0; d < dim; d += 32) {
        ahead();
        float* a = acc + g * dim + d;
        switch (std::min<int64_t>(3, group - g)) {
          case 3: group_weighted32<3>(w, w_stride, v + d, stride, count, a, dim); break;
          case 2: group_weighted32<2>(w, w_stride, v + d, stride, count, a, dim); break;
          default: group_weighted32<1>(w, w_stride, v + d, stride, count, a, dim); break;
        }
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    weighted_rows(weights + g * w_stride, v, stride, count, dim, acc + g * dim);
}

// The largest of s[0, n), eight lanes at a time: one long chain of scalar maxima waited on each
// step's latency (about 6 cycles a key and kv head at 192 keys).
inline float largest(const float* s, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef CONVEYOR_PAGED_SIMD
  if (n >= 8) {
    __m256 lanes = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + i));
    peak = conveyor::horizontal_max(lanes);
  }
#endif
  for (; i < n; ++i) peak = std::max(peak, s[i]);
  return peak;
}

inline void softmax_weights(float* scores, int64_t len, float& total) {
  total = conveyor::exp_shifted_sum(scores, len, largest(scores, len));
}

// The softmax weights of one head's scores as the layer's attention has them: capped first
// (Gemma 2), and with a sink (gpt-oss) that joins the denominator with no value of its own.
inline void featured_weights(float* scores, int64_t len, float softcap, const float* sink,
                             float& total) {
  if (softcap > 0.f) conveyor::cap_scores(scores, len, softcap);
  if (sink == nullptr) {
    softmax_weights(scores, len, total);
    return;
  }
  const float peak = std::max(largest(scores, len), *sink);
  total = conveyor::exp_shifted_sum(scores, len, peak) + std::exp(*sink - peak);
}

// The first K block of the task a thread takes next, asked for while its current task's last V
// block is computed; base is null when no task is left.
struct NextTask {
  const void* base = nullptr;
  int64_t rows = 0;
};

// A thread's buffers for one sequence's scaled query, weighted sums, scores and softmax totals,
// kept from sequence to sequence and grown as needed: four vectors made and zeroed for every
// sequence of every layer took about 1% of a decode step of 64 rows of the default model.
struct SequenceScratch {
  conveyor::Scratch<float> q, acc, scores, total;
  int64_t head_values = 0, score_values = 0, heads = 0;

  void fit(int64_t want_head_values, int64_t want_score_values, int64_t want_heads) {
    if (want_head_values > head_values) {
      head_values = want_head_values;
      q = conveyor::scratch<float>(head_values);
      acc = conveyor::scratch<float>(head_values);
    }
    if (want_score_values > score_values) {
      score_values = want_score_values;
      scores = conveyor::scratch<float>(score_values);
    }
    if (want_heads > heads) {
      heads = want_heads;
      total = conveyor::scratch<float>(heads);
    }
  }
};

// One sequence, the query heads of kv heads [kv_first, kv_last). A block holds its tokens' K (or
// V) for every kv head back to back, so each block is one contiguous read. `claim()` takes the
// thread's next task as the last V block starts, and returns that task's first K block.
template <typename Q, typename C, typename Claim>
void attend_sequence(const Q* query, const C* key, const C* value, const int64_t* blocks,
                     int64_t len, int64_t skip, int64_t kv_first, int64_t kv_last, const Shape& s,
                     Q* out, Claim&& claim) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim, bs = s.block_size;
  const int64_t kv_count = kv_last - kv_first, heads = kv_count * group, row = s.kv_heads * dim;
  const int64_t block_stride = s.block_stride();
  const int64_t stride_bytes = row * sizeof(C), row_bytes = kv_count * dim * sizeof(C);
  query += kv_first * group * dim;
  out += kv_first * group * dim;
  key += kv_first * dim;
  value += kv_first * dim;
  thread_local SequenceScratch buffers;
  buffers.fit(heads * dim, heads * len, heads);
  float *q = buffers.q.get(), *acc = buffers.acc.get();
  float *scores = buffers.scores.get(), *total = buffers.total.get();
  std::fill(acc, acc + heads * dim, 0.f);
  load_row(query, q, heads * dim);
  for (int64_t i = 0; i < heads * dim; ++i) q[i] *= s.scale;
  const int64_t num_blocks = (len + bs - 1) / bs;
  Prefetcher ahead;
  // K blocks, then V blocks, then the next task's first K block, each asked for over the calls
  // that compute the one before it.
  auto ask_next = [&](int64_t b, bool keys, int64_t calls) {
    if (b < num_blocks)
      ahead.start((keys ? key : value) + blocks[b] * block_stride, std::min(bs, len - b * bs),
                  stride_bytes, row_bytes, calls);
    else if (const NextTask next = claim(); next.base != nullptr)
      ahead.start(next.base, next.rows, stride_bytes, row_bytes, calls);
  };
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * bs, count = std::min(bs, len - first);
    const C* k = key + blocks[b] * block_stride;
    const int64_t calls = kv_count * score_calls(count, group, dim);
    if (b + 1 < num_blocks) ask_next(b + 1, true, calls);
    else ask_next(0, false, calls);
    for (int64_t kv = 0; kv < kv_count; ++kv)
      group_scores(q + kv * group * dim, group, k + kv * dim, row, count, dim,
                   scores + kv * group * len + first, len, ahead);
  }
  // Tokens before the window weigh nothing.
  const float* sinks = s.sinks != nullptr ? s.sinks + kv_first * group : nullptr;
  for (int64_t h = 0; h < heads; ++h) {
    float* row_scores = scores + h * len;
    if (s.softcap > 0.f || sinks != nullptr)
      featured_weights(row_scores + skip, len - skip, s.softcap,
                       sinks != nullptr ? sinks + h : nullptr, total[h]);
    else softmax_weights(row_scores + skip, len - skip, total[h]);
    std::fill(row_scores, row_scores + skip, 0.f);
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t first = b * bs, count = std::min(bs, len - first);
    const C* v = value + blocks[b] * block_stride;
    ask_next(b + 1, false, kv_count * value_calls(group, dim));
    for (int64_t kv = 0; kv < kv_count; ++kv)
      group_values(scores + kv * group * len + first, group, len, v + kv * dim, row, count, dim,
                   acc + kv * group * dim, ahead);
  }
  ahead.rest();
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = total[h] > 0.f ? 1.f / total[h] : 0.f;
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = static_cast<Q>(acc[h * dim + d] * inv);
  }
}

// One call's sequences and how their work is cut: whole sequences per task when there are
// enough of them for the threads, else one task per (sequence, kv head).
template <typename Q, typename C>
struct Sequences {
  const Q* q;
  const C* k;
  const C* v;
  const int64_t* blocks;
  const int64_t* seq_lens;
  Q* o;
  Shape s;
  int64_t splits, per_split, tasks;

  Sequences(const Q* q, const C* k, const C* v, const int64_t* blocks, const int64_t* seq_lens,
            Q* o, const Shape& s, int64_t seqs, int threads)
      : q(q), k(k), v(v), blocks(blocks), seq_lens(seq_lens), o(o), s(s),
        splits(seqs >= 4 * threads ? 1 : s.kv_heads), per_split(s.kv_heads / splits),
        tasks(seqs * splits) {}

  NextTask first_block(int64_t task) const {
    const int64_t seq = task / splits, kv_first = task % splits * per_split;
    const Span span = span_of(seq_lens[seq], s);
    return NextTask{k + blocks[seq * s.width + span.block] * s.block_stride() + kv_first * s.dim,
                    std::min(s.block_size, span.len)};
  }

  template <typename Claim>
  void attend(int64_t task, Claim&& claim) const {
    const int64_t seq = task / splits, kv_first = task % splits * per_split;
    const Span span = span_of(seq_lens[seq], s);
    attend_sequence<Q, C>(q + seq * s.query_stride, k, v, blocks + seq * s.width + span.block,
                          span.len, span.skip, kv_first, kv_first + per_split, s,
                          o + seq * s.heads * s.dim, claim);
  }
};

// A thread's share [begin, end) of a few sequences' kv heads, in order: the lines of a
// sequence's next kv head lie beside those of the one before, and the hardware fetches some of
// them along. Handed out one by one, a sequence's kv heads went to both threads: 9% slower at
// 4 sequences.
template <typename Q, typename C>
void attend_share(const Sequences<Q, C>& work, int64_t begin, int64_t end) {
  for (int64_t task = begin; task < end; ++task)
    work.attend(task, [&]() { return task + 1 < end ? work.first_block(task + 1) : NextTask{}; });
}

// This thread's whole sequences, each taken as it frees up. A thread takes its next as its
// current one's last V block starts, whose work then fetches the next one's first K block. A
// static half each left a thread waiting on the other for 16% of the attention's time at 16
// sequences and 5-9% at 64 (the other held up by memory, or started late): 30 layers'
// attention at 192 tokens of context took 6-7% longer.
template <typename Q, typename C>
void take_sequences(const Sequences<Q, C>& work, std::atomic<int64_t>& next) {
  int64_t task = next++;
  while (task < work.tasks) {
    int64_t taken = -1;
    work.attend(task, [&]() {
      if (taken < 0) taken = next++;
      return taken < work.tasks ? work.first_block(taken) : NextTask{};
    });
    task = taken >= 0 ? taken : next++;
  }
}

template <typename Q, typename C = Q>
void run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
         const at::Tensor& table, const at::Tensor& lens, at::Tensor& out, const Shape& s) {
  const Sequences<Q, C> work(query.data_ptr<Q>(), key.data_ptr<C>(), value.data_ptr<C>(),
                             table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<Q>(),
                             s, query.size(0), at::get_num_threads());
  if (work.splits > 1) {
    at::parallel_for(0, work.tasks, 1,
                     [&](int64_t begin, int64_t end) { attend_share(work, begin, end); });
    return;
  }
  std::atomic<int64_t> next{0};
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), work.tasks));
#pragma omp parallel num_threads(threads)
  take_sequences(work, next);
}

// One thread of a team's part, the query fp32 and the cache C.
template <typename C>
void run_team(const conveyor::DecodeRows& rows, const at::Tensor& key, const at::Tensor& value,
              const conveyor::Team& team, std::atomic<int64_t>& next) {
  const Shape s{rows.heads,        key.size(2), key.size(3), key.size(1),  rows.width,
                rows.query_stride, rows.scale,  rows.window, rows.softcap, rows.sinks};
  const Sequences<float, C> work(rows.query, key.data_ptr<C>(), value.data_ptr<C>(), rows.table,
                                 rows.lens, rows.out, s, rows.seqs, team.size);
  if (work.splits > 1) {
    const conveyor::Share part = conveyor::share(team, work.tasks, 1);
    attend_share(work, part.begin, part.end);
    return;
  }
  take_sequences(work, next);
}

}  // namespace

namespace conveyor {

// Every block a sequence reads must exist: a bad table would read outside the cache.
void check_decode_tables(const at::Tensor& table, const at::Tensor& lens, int64_t block_size,
                         int64_t num_blocks) {
  const int64_t* blocks = table.data_ptr<int64_t>();
  const int64_t* seq_lens = lens.data_ptr<int64_t>();
  const int64_t width = table.size(1);
  for (int64_t seq = 0; seq < table.size(0); ++seq) {
    const int64_t used = (seq_lens[seq] + block_size - 1) / block_size;
    TORCH_CHECK(seq_lens[seq] >= 1 && used <= width,
                "paged_decode: sequence length outside its block table");
    for (int64_t b = 0; b < used; ++b) {
      const int64_t block = blocks[seq * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode: block id out of range");
    }
  }
}

void paged_decode_team(const DecodeRows& rows, const at::Tensor& key, const at::Tensor& value,
                       const Team& team, std::atomic<int64_t>& next) {
  switch (key.scalar_type()) {
    case at::kFloat: run_team<float>(rows, key, value, team, next); break;
    case at::kBFloat16: run_team<c10::BFloat16>(rows, key, value, team, next); break;
    case at::kHalf: run_team<c10::Half>(rows, key, value, team, next); break;
    default: run_team<c10::Float8_e5m2>(rows, key, value, team, next); break;
  }
}

at::Tensor paged_decode(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor table,
                        at::Tensor lens, double scale, int64_t window, double softcap,
                        const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(
      query.dim() == 3 && key.dim() == 4 && value.sizes() == key.sizes(),
      "paged_decode: query [seqs, heads, dim], key/value [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_decode: query heads and dims must be contiguous");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous(),
              "paged_decode: cache must be contiguous");
  const auto cache = key.scalar_type();
  const bool widened = query.scalar_type() == at::kFloat &&
                       (cache == at::kBFloat16 || cache == at::kHalf || cache == at::kFloat8_e5m2);
  TORCH_CHECK(query.scalar_type() == cache || widened,
              "paged_decode: the cache must hold the query's dtype, or 16 bits or fp8 (e5m2) "
              "under fp32");
  TORCH_CHECK(query.size(2) == key.size(3) && query.size(1) % key.size(2) == 0,
              "paged_decode: head shapes do not match");
  table = table.to(at::kLong).contiguous();
  lens = lens.to(at::kLong).contiguous();
  TORCH_CHECK(table.size(0) == query.size(0) && lens.size(0) == query.size(0),
              "paged_decode: one block table row and length per sequence");
  const at::Tensor sinks32 = conveyor::sink_logits(sinks, query.size(1), "paged_decode");
  const Shape s{query.size(1),
                key.size(2),
                query.size(2),
                key.size(1),
                table.size(1),
                query.stride(0),
                static_cast<float>(scale),
                std::max<int64_t>(window, 0),
                static_cast<float>(std::max(softcap, 0.0)),
                conveyor::sinks_of(sinks32)};
  check_decode_tables(table, lens, s.block_size, key.size(0));
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  if (widened) {
    if (cache == at::kBFloat16) run<float, c10::BFloat16>(query, key, value, table, lens, out, s);
    else if (cache == at::kHalf) run<float, c10::Half>(query, key, value, table, lens, out, s);
    else run<float, c10::Float8_e5m2>(query, key, value, table, lens, out, s);
    return out;
  }
  switch (query.scalar_type()) {
    case at::kFloat: run<float>(query, key, value, table, lens, out, s); break;
    case at::kBFloat16: run<c10::BFloat16>(query, key, value, table, lens, out, s); break;
    case at::kHalf: run<c10::Half>(query, key, value, table, lens, out, s); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", query.scalar_type());
  }
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "paged_decode(Tensor query, Tensor key, Tensor value, Tensor table, Tensor lens, float "
      "scale, int window=0, float softcap=0., Tensor? sinks=None) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(conveyor::paged_decode));
}
