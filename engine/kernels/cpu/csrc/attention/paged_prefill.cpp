// Paged prefill attention for the CPU: the query tokens of each sequence of a step (a whole
// prompt, or a chunk of one after tokens already cached) attend causally over K/V read in place
// from the paged cache. Query token i of a sequence sits at position context + i and sees keys
// [0, context + i].
//
// query   [tokens, heads, head_dim] fp32 (rows may be strided; heads and dims contiguous)
// key/value  [blocks, block_size, kv_heads, head_dim]  one layer of the cache: fp32, or
//         bf16/fp16/fp8 (e5m2), widened as read
// `paged_prefill` takes one sequence (blocks [n] int64, its block ids covering context + tokens
// positions) and returns [tokens, heads, head_dim] fp32; `paged_prefill_rows` takes a step's
// sequences, each a run of query rows (starts, lens, contexts [n] int64, table [n, width] int64),
// and writes their rows of out [tokens, heads, head_dim] fp32. With a `window` (sliding-window
// layers), the token at position pos sees keys [pos - window + 1, pos] only: tiles of keys
// before an item's first token's window are skipped, and each row's keys before its own are
// masked as the keys after it are. With a `softcap` (Gemma 2) each score is capped as
// softcap * tanh(score / softcap) before the softmax, and with `sinks` ([heads] fp32, gpt-oss)
// each head's sink logit joins its rows' softmax denominators with no value, as `paged_decode`
// computes both.
//
// Flash-style, in fp32, every sequence of the call in one parallel region. First, every tile of
// 64 keys of every kv head of every sequence is widened once, K transposed to [head_dim][64] and
// V as [64][head_dim]. Then a work item is one sequence's kv head and a tile of its query
// tokens, whose rows (the tokens times the kv head's query heads) share each K and V tile up to
// their last token's; the scores and the weighted V sums are both register-tiled products (6
// rows by 16 columns, 12 accumulators), and the softmax is online (a running max and sum per
// row, earlier sums rescaled when the max grows). Tiles, then items, are claimed as threads free
// up, the costliest items (those that see the most keys) first.
//
// With `bf16` (a bf16 model over a bf16 cache, AVX-512 BF16), the two products are bf16 dot
// products instead, as torch's flash attention computes in bf16: query rows and softmax weights
// rounded to bf16, sums in fp32, the softmax in fp32; the tiles are laid out as pairs, not
// widened (`bf16_pairs.h`).
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
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "bf16_pairs.h"
#include "fast_exp.h"
#include "lanes.h"
#include "load8.h"
#include "ops.h"
#include "score_features.h"

#if defined(CONVEYOR_LOAD8) && defined(CONVEYOR_EXP8)
#define CONVEYOR_PREFILL_SIMD 1
#if defined(CONVEYOR_BF16_ROUND)
#define CONVEYOR_PREFILL_BF16 1
#endif
#endif

namespace {

constexpr int64_t kKeys = 64;      // keys per tile
constexpr int64_t kCols = 16;      // output columns of one micro-kernel call
constexpr int64_t kItemRows = 48;  // query rows (tokens times group) an item aims for
constexpr int kMaxRows = 6;        // rows per micro-kernel call

struct Problem {
  const float* query;
  int64_t token_stride;  // query elements from one token to the next
  int64_t heads, kv_heads, group, dim, block_size, tokens, context;
  const int64_t* blocks;
  float scale;
  float* out;
  int64_t window;      // a sliding window (0: none)
  float softcap;       // scores capped (0: not)
  const float* sinks;  // [heads] logits joining each head's softmax, or null

  int64_t token_tile() const { return std::max<int64_t>(1, kItemRows / group); }
  // The first key the token at sequence position pos sees.
  int64_t first_key(int64_t pos) const {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  }
  // The first tile of keys any of the tokens from token t0 on sees, as its first key.
  int64_t first_tile_key(int64_t t0) const { return first_key(context + t0) / kKeys * kKeys; }
  // Where the row of kv head g at sequence position pos starts in one layer's cache.
  int64_t row_offset(int64_t pos, int64_t g) const {
    return (blocks[pos / block_size] * block_size + pos % block_size) * kv_heads * dim + g * dim;
  }
};

#ifdef CONVEYOR_PREFILL_SIMD
using conveyor::load8;

// c[MR][16] (row stride ldc) = or += a[MR][k] (row stride lda) times b[k][16] (row stride ldb):
// each b row is loaded once for MR rows, a's elements are broadcast.
template <int MR, bool Accumulate>
__attribute__((noinline)) void tile_product(const float* a, int64_t lda, const float* b,
                                            int64_t ldb, int64_t k, float* c, int64_t ldc) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = Accumulate ? _mm256_loadu_ps(c + m * ldc) : _mm256_setzero_ps();
    acc[m][1] = Accumulate ? _mm256_loadu_ps(c + m * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < k; ++i) {
    const __m256 b0 = _mm256_loadu_ps(b + i * ldb), b1 = _mm256_loadu_ps(b + i * ldb + 8);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const __m256 x = _mm256_broadcast_ss(a + m * lda + i);
      acc[m][0] = _mm256_fmadd_ps(x, b0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(x, b1, acc[m][1]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(c + m * ldc, acc[m][0]);
    _mm256_storeu_ps(c + m * ldc + 8, acc[m][1]);
  }
}

// c[rows][cols] (cols a multiple of 16) = or += a[rows][k] times b[k][cols].
template <bool Accumulate>
void product(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k, float* c,
             int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t j = 0; j < cols; j += kCols)
    for (int64_t m = 0; m < rows; m += kMaxRows) {
      const float* am = a + m * lda;
      float* cm = c + m * ldc + j;
      switch (std::min<int64_t>(kMaxRows, rows - m)) {
        case 6: tile_product<6, Accumulate>(am, lda, b + j, ldb, k, cm, ldc); break;
        case 5: tile_product<5, Accumulate>(am, lda, b + j, ldb, k, cm, ldc); break;
        case 4: tile_product<4, Accumulate>(am, lda, b + j, ldb, k, cm, ldc); break;
        case 3: tile_product<3, Accumulate>(am, lda, b + j, ldb, k, cm, ldc); break;
        case 2: tile_product<2, Accumulate>(am, lda, b + j, ldb, k, cm, ldc); break;
        default: tile_product<1, Accumulate>(am, lda, b + j, ldb, k, cm, ldc); break;
      }
    }
}

// Eight rows of eight floats transposed in registers.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Keys [k0, k0 + n) of kv head g transposed into kt [columns][kKeys], eight keys by eight
// columns at a time, `load(row, c)` giving columns c to c + 7 of a key's row as eight 32-bit
// lanes; keys past n, up to a multiple of 16, are zero.
template <typename C, typename Load>
void transpose_keys(const Problem& p, const C* key, int64_t g, int64_t k0, int64_t n,
                    int64_t columns, float* kt, Load&& load) {
  const int64_t padded = (n + kCols - 1) / kCols * kCols;
  for (int64_t j0 = 0; j0 < padded; j0 += 8) {
    const C* rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = j0 + r < n ? key + p.row_offset(k0 + j0 + r, g) : nullptr;
    for (int64_t c = 0; c < columns; c += 8) {
      __m256 block[8];
      for (int r = 0; r < 8; ++r)
        block[r] = rows[r] != nullptr ? load(rows[r], c) : _mm256_setzero_ps();
      transpose8(block);
      for (int r = 0; r < 8; ++r) _mm256_storeu_ps(kt + (c + r) * kKeys + j0, block[r]);
    }
  }
}

// Keys [k0, k0 + n) of kv head g: K widened and transposed into kt [dim][kKeys] (columns past
// n up to a multiple of 16 zeroed), V widened into v [n][dim].
template <typename C>
void load_tile(const Problem& p, const C* key, const C* value, int64_t g, int64_t k0, int64_t n,
               float* kt, float* v) {
  transpose_keys(p, key, g, k0, n, p.dim, kt,
                 [](const C* row, int64_t d) { return load8(row + d); });
  for (int64_t j = 0; j < n; ++j) {
    const C* row = value + p.row_offset(k0 + j, g);
    for (int64_t d = 0; d < p.dim; d += 8) _mm256_storeu_ps(v + j * p.dim + d, load8(row + d));
  }
}

// Every K/V tile of one sequence, widened once and read by every item of its kv head: per kv
// head and tile, K as [dim][kKeys] then V as [kKeys][dim], contiguous, in a buffer shared by
// the call's sequences.
struct Tiles {
  float* data;
  int64_t count, dim;
  float* key(int64_t g, int64_t tile) const { return data + (g * count + tile) * 2 * kKeys * dim; }
  float* value(int64_t g, int64_t tile) const { return key(g, tile) + kKeys * dim; }
};

// One thread's buffers, reused from item to item: the query rows and the softmax weights in
// fp32, or rounded to bf16 (q16, p16) for bf16 products.
struct Workspace {
  std::vector<float> q, scores, acc, max, sum;
  std::vector<uint16_t> q16, p16;
  explicit Workspace(const Problem& p) : Workspace(p, p.token_tile() * p.group) {}
  Workspace(const Problem& p, int64_t rows)
      : q(rows * p.dim), scores(rows * kKeys), acc(rows * p.dim), max(rows), sum(rows),
        q16(rows * p.dim), p16(rows * kKeys) {}

  // Before an item's first tile of keys: nothing summed, no max yet.
  void reset(int64_t rows, int64_t dim) {
    std::fill(acc.begin(), acc.begin() + rows * dim, 0.f);
    std::fill(max.begin(), max.begin() + rows, -std::numeric_limits<float>::infinity());
    std::fill(sum.begin(), sum.begin() + rows, 0.f);
  }
};

inline float row_max(const float* s, int64_t n) {
  __m256 lanes = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(s + j));
  alignas(32) float each[8];
  _mm256_store_ps(each, lanes);
  float top = each[0];
  for (int i = 1; i < 8; ++i) top = std::max(top, each[i]);
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

// A row's running max raised to take in the first `seen` scores of a tile; its running sum and
// accumulator are rescaled to match. Returns the new max.
float raise_max(const float* s, int64_t seen, float* acc, int64_t dim, float& max, float& sum) {
  const float top = std::max(max, row_max(s, seen));
  if (top > max) {
    const float rescale =
        max == -std::numeric_limits<float>::infinity() ? 0.f : conveyor::exp_clamped(max - top);
    sum *= rescale;
    for (int64_t d = 0; d < dim; ++d) acc[d] *= rescale;
    max = top;
  }
  return top;
}

// Row r's scores for a tile with keys [from, seen) visible (the rest masked) become its softmax
// weights under the running max.
void online_softmax(float* s, int64_t n, int64_t from, int64_t seen, float* acc, int64_t dim,
                    float& max, float& sum) {
  if (seen <= from) {
    std::fill(s, s + n, 0.f);
    return;
  }
  const float top = raise_max(s + from, seen - from, acc, dim, max, sum);
  sum += conveyor::exp_shifted_sum(s + from, seen - from, top);
  std::fill(s, s + from, 0.f);
  std::fill(s + seen, s + n, 0.f);
}

// Row r of an item of kv head g from token t0: its query row, and where its output goes.
const float* query_row(const Problem& p, int64_t g, int64_t t0, int64_t r) {
  return p.query + (t0 + r / p.group) * p.token_stride + (g * p.group + r % p.group) * p.dim;
}
float* out_row(const Problem& p, int64_t g, int64_t t0, int64_t r) {
  return p.out + ((t0 + r / p.group) * p.heads + g * p.group + r % p.group) * p.dim;
}

// The keys of the n from k0 that row r of an item from token t0 sees: [from, seen) of them
// (seen <= from: none).
struct Seen {
  int64_t from, seen;
};
Seen seen_keys(const Problem& p, int64_t t0, int64_t r, int64_t k0, int64_t n) {
  const int64_t pos = p.context + t0 + r / p.group;
  return {std::clamp<int64_t>(p.first_key(pos) - k0, 0, n), std::min(n, pos + 1 - k0)};
}

// A row's visible scores [from, seen) capped, where the layer caps them (Gemma 2), as the decode
// kernel caps them.
void cap_visible(const Problem& p, float* s, Seen seen) {
  if (p.softcap > 0.f && seen.seen > seen.from)
    conveyor::cap_scores(s + seen.from, seen.seen - seen.from, p.softcap);
}

// Each row's scores for the tile of keys from k0 become its softmax weights.
void softmax_rows(const Problem& p, int64_t t0, int64_t rows, int64_t k0, int64_t n, Workspace& w) {
  for (int64_t r = 0; r < rows; ++r) {
    const Seen seen = seen_keys(p, t0, r, k0, n);
    cap_visible(p, w.scores.data() + r * kKeys, seen);
    online_softmax(w.scores.data() + r * kKeys, n, seen.from, seen.seen, w.acc.data() + r * p.dim,
                   p.dim, w.max[r], w.sum[r]);
  }
}

// The item's rows, their sums of weighted values divided by the sums of their weights (each
// head's sink, where the layer has them, joining its rows' sums with no value).
void finish_item(const Problem& p, int64_t g, int64_t t0, int64_t rows, Workspace& w) {
  for (int64_t r = 0; r < rows; ++r) {
    if (p.sinks != nullptr) {
      const float sink = p.sinks[g * p.group + r % p.group];
      raise_max(&sink, 1, w.acc.data() + r * p.dim, p.dim, w.max[r], w.sum[r]);
      w.sum[r] += std::exp(sink - w.max[r]);
    }
    float* dst = out_row(p, g, t0, r);
    const float inverse = 1.f / w.sum[r];
    for (int64_t d = 0; d < p.dim; ++d) dst[d] = w.acc[r * p.dim + d] * inverse;
  }
}

// Query tokens [t0, t1) of kv head g's query heads over every key they see.
void attend_item(const Problem& p, const Tiles& tiles, int64_t g, int64_t t0, int64_t t1,
                 Workspace& w) {
  const int64_t rows = (t1 - t0) * p.group, dim = p.dim;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = query_row(p, g, t0, r);
    for (int64_t d = 0; d < dim; ++d) w.q[r * dim + d] = src[d] * p.scale;
  }
  w.reset(rows, dim);
  const int64_t keys = p.context + t1;  // the last token sees this many
  for (int64_t k0 = p.first_tile_key(t0); k0 < keys; k0 += kKeys) {
    const int64_t n = std::min(kKeys, keys - k0);
    const int64_t padded = (n + kCols - 1) / kCols * kCols;
    const float* kt = tiles.key(g, k0 / kKeys);
    product<false>(w.q.data(), dim, kt, kKeys, dim, w.scores.data(), kKeys, rows, padded);
    softmax_rows(p, t0, rows, k0, n, w);
    product<true>(w.scores.data(), kKeys, tiles.value(g, k0 / kKeys), dim, n, w.acc.data(), dim,
                  rows, dim);
  }
  finish_item(p, g, t0, rows, w);
}

#ifdef CONVEYOR_PREFILL_BF16
// bf16 products, for a bf16 model over a bf16 cache, as torch's flash attention computes a bf16
// model's: the query rows rounded to bf16, scores summed in fp32 and then scaled, the softmax in
// fp32, its weights rounded to bf16 for the product with V. K and V are already bf16, so tiles
// are only laid out, not widened: K as pairs of dims, word [d / 2][j] holding K[j][d] and
// K[j][d + 1] (keys past n, up to a multiple of 16, zero), V as pairs of keys, word [j / 2][d]
// holding V[j][d] and V[j + 1][d] (a zero row after an odd n).
void pack_tile(const Problem& p, const c10::BFloat16* key, const c10::BFloat16* value, int64_t g,
               int64_t k0, int64_t n, float* kt, float* v) {
  // A key's pairs i to i + 7, as 32-bit words.
  transpose_keys(p, key, g, k0, n, p.dim / 2, kt, [](const c10::BFloat16* row, int64_t i) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  });
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t j = 0; j < n; j += 2) {
    const auto* even = reinterpret_cast<const __m256i*>(value + p.row_offset(k0 + j, g));
    const auto* odd =
        j + 1 < n ? reinterpret_cast<const __m256i*>(value + p.row_offset(k0 + j + 1, g)) : nullptr;
    auto* dst = reinterpret_cast<__m256i*>(v + j / 2 * p.dim);
    for (int64_t d = 0; d < p.dim / 16; ++d) {
      const __m256i a = _mm256_loadu_si256(even + d);
      const __m256i b = odd != nullptr ? _mm256_loadu_si256(odd + d) : zero;
      const __m256i low = _mm256_unpacklo_epi16(a, b), high = _mm256_unpackhi_epi16(a, b);
      _mm256_storeu_si256(dst + 2 * d, _mm256_permute2x128_si256(low, high, 0x20));
      _mm256_storeu_si256(dst + 2 * d + 1, _mm256_permute2x128_si256(low, high, 0x31));
    }
  }
}

// Lanes [i, i + 8) of a row's tile that fall in its visible keys [from, seen), as a mask.
inline __mmask8 visible_lanes(int64_t i, int64_t from, int64_t seen) {
  const int64_t left = std::clamp<int64_t>(seen - i, 0, 8),
                masked = std::clamp<int64_t>(from - i, 0, 8);
  return static_cast<__mmask8>(((1u << left) - 1) & ~((1u << masked) - 1));
}

// online_softmax for bf16 products: the weights of a row's visible keys [from, seen) summed in
// fp32 and, in the same pass, rounded to bf16 into w16[0, n rounded up to 8), masked keys zero.
void online_softmax_bf16(const float* s, int64_t n, int64_t from, int64_t seen, uint16_t* w16,
                         float* acc, int64_t dim, float& max, float& sum) {
  const int64_t end = (n + 7) / 8 * 8;  // within the row's kKeys scores
  if (seen <= from) {
    std::fill(w16, w16 + end, uint16_t{0});
    return;
  }
  const __m256 top = _mm256_set1_ps(raise_max(s + from, seen - from, acc, dim, max, sum));
  __m256 sums = _mm256_setzero_ps();
  for (int64_t i = 0; i < end; i += 8) {
    const __mmask8 visible = visible_lanes(i, from, seen);
    const __m256 e = _mm256_maskz_mov_ps(
        visible, conveyor::exp8_clamped(_mm256_sub_ps(_mm256_loadu_ps(s + i), top)));
    sums = _mm256_add_ps(sums, e);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w16 + i),
                     reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(e)));
  }
  sum += conveyor::horizontal_sum(sums);
}

// attend_item in bf16 products over tiles laid out by pack_tile.
void attend_item_bf16(const Problem& p, const Tiles& tiles, int64_t g, int64_t t0, int64_t t1,
                      Workspace& w) {
  const int64_t rows = (t1 - t0) * p.group, dim = p.dim;
  for (int64_t r = 0; r < rows; ++r)
    conveyor::round_to_bf16(query_row(p, g, t0, r), dim, w.q16.data() + r * dim);
  w.reset(rows, dim);
  const int64_t keys = p.context + t1;
  for (int64_t k0 = p.first_tile_key(t0); k0 < keys; k0 += kKeys) {
    const int64_t n = std::min(kKeys, keys - k0);
    const int64_t padded = (n + kCols - 1) / kCols * kCols;
    const auto* kt = reinterpret_cast<const uint32_t*>(tiles.key(g, k0 / kKeys));
    conveyor::bf16_pair_product<false>(w.q16.data(), dim, kt, kKeys, dim / 2, p.scale,
                                       w.scores.data(), kKeys, rows, padded);
    for (int64_t r = 0; r < rows; ++r) {
      const Seen seen = seen_keys(p, t0, r, k0, n);
      cap_visible(p, w.scores.data() + r * kKeys, seen);
      online_softmax_bf16(w.scores.data() + r * kKeys, n, seen.from, seen.seen,
                          w.p16.data() + r * kKeys, w.acc.data() + r * dim, dim, w.max[r],
                          w.sum[r]);
    }
    const auto* vt = reinterpret_cast<const uint32_t*>(tiles.value(g, k0 / kKeys));
    conveyor::bf16_pair_product<true>(w.p16.data(), kKeys, vt, dim, (n + 1) / 2, 1.f, w.acc.data(),
                                      dim, rows, dim);
  }
  finish_item(p, g, t0, rows, w);
}
#endif

// One tile of keys made ready for the items: widened to fp32, or laid out for bf16 products.
template <typename C, bool Bf16>
void prepare_tile(const Problem& p, const C* key, const C* value, int64_t g, int64_t k0, int64_t n,
                  float* kt, float* v) {
#ifdef CONVEYOR_PREFILL_BF16
  if constexpr (Bf16) {
    pack_tile(p, key, value, g, k0, n, kt, v);
    return;
  }
#endif
  load_tile(p, key, value, g, k0, n, kt, v);
}

template <bool Bf16>
void attend(const Problem& p, const Tiles& tiles, int64_t g, int64_t t0, int64_t t1, Workspace& w) {
#ifdef CONVEYOR_PREFILL_BF16
  if constexpr (Bf16) {
    attend_item_bf16(p, tiles, g, t0, t1, w);
    return;
  }
#endif
  attend_item(p, tiles, g, t0, t1, w);
}

// A tile of keys to widen, or a tile of query tokens to attend: sequence, kv head, first key or
// token.
struct Work {
  int64_t seq, g, first;
};

// Every sequence's tiles of keys, each sequence's after the one before in one buffer, and the
// tiles to widen.
struct KeyTiles {
  std::vector<Tiles> of;  // per sequence
  std::vector<Work> loads;
  std::unique_ptr<float[]> data;

  explicit KeyTiles(const std::vector<Problem>& ps) {
    int64_t floats = 0;
    for (const Problem& p : ps) floats += p.kv_heads * count(p) * 2 * kKeys * p.dim;
    data.reset(new float[floats]);
    float* next = data.get();
    for (int64_t seq = 0; seq < static_cast<int64_t>(ps.size()); ++seq) {
      const Problem& p = ps[seq];
      of.push_back(Tiles{next, count(p), p.dim});
      next += p.kv_heads * count(p) * 2 * kKeys * p.dim;
      // Tiles before the first token's window are never read.
      for (int64_t g = 0; g < p.kv_heads; ++g)
        for (int64_t t = p.first_tile_key(0) / kKeys; t < count(p); ++t)
          loads.push_back(Work{seq, g, t * kKeys});
    }
  }

  static int64_t count(const Problem& p) { return (p.context + p.tokens + kKeys - 1) / kKeys; }
};

// Every sequence's items, the costliest first: the tiles of last tokens see the most keys, so
// the short ones fill in the end.
std::vector<Work> attend_items(const std::vector<Problem>& ps) {
  std::vector<Work> items;
  for (int64_t seq = 0; seq < static_cast<int64_t>(ps.size()); ++seq) {
    const Problem& p = ps[seq];
    for (int64_t t0 = 0; t0 < p.tokens; t0 += p.token_tile())
      for (int64_t g = 0; g < p.kv_heads; ++g) items.push_back(Work{seq, g, t0});
  }
  auto keys = [&](const Work& w) { return ps[w.seq].context + w.first; };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Work& a, const Work& b) { return keys(a) > keys(b); });
  return items;
}

template <typename C, bool Bf16>
void run(const std::vector<Problem>& ps, const at::Tensor& key, const at::Tensor& value) {
  const C* k = key.data_ptr<C>();
  const C* v = value.data_ptr<C>();
  const KeyTiles tiles(ps);
  const std::vector<Work> items = attend_items(ps);
  const int64_t loads = static_cast<int64_t>(tiles.loads.size());
  const int64_t count = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_load{0}, next_item{0};
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), count));
#pragma omp parallel num_threads(threads)
  {
    for (int64_t i = next_load++; i < loads; i = next_load++) {
      const Work& w = tiles.loads[i];
      const Problem& p = ps[w.seq];
      const Tiles& t = tiles.of[w.seq];
      const int64_t n = std::min(kKeys, p.context + p.tokens - w.first);
      prepare_tile<C, Bf16>(p, k, v, w.g, w.first, n, t.key(w.g, w.first / kKeys),
                            t.value(w.g, w.first / kKeys));
    }
#pragma omp barrier
    Workspace space(ps.front());
    for (int64_t i = next_item++; i < count; i = next_item++) {
      const Work& w = items[i];
      const Problem& p = ps[w.seq];
      attend<Bf16>(p, tiles.of[w.seq], w.g, w.first, std::min(p.tokens, w.first + p.token_tile()),
                   space);
    }
  }
}

// With bf16, bf16 products over a bf16 cache (checked by check_shapes).
template <typename... Args>
void run_cache(at::ScalarType cache, bool bf16, Args&&... args) {
#ifdef CONVEYOR_PREFILL_BF16
  if (bf16) return run<c10::BFloat16, true>(args...);
#endif
  switch (cache) {
    case at::kFloat: run<float, false>(args...); break;
    case at::kBFloat16: run<c10::BFloat16, false>(args...); break;
    case at::kHalf: run<c10::Half, false>(args...); break;
    default: run<c10::Float8_e5m2, false>(args...); break;
  }
}
#endif

}  // namespace

namespace conveyor {

namespace {

#ifdef CONVEYOR_PREFILL_SIMD
// The query and the cache as both ops take them (a bf16 cache for bf16 products); the cache's
// dtype.
at::ScalarType check_shapes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            bool bf16) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 4 && value.sizes() == key.sizes(),
              "paged_prefill: query [tokens, heads, dim], key/value [blocks, block_size, "
              "kv_heads, dim]");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "paged_prefill: query must be fp32");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_prefill: query heads and dims must be contiguous");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous(),
              "paged_prefill: cache must be contiguous");
  const auto cache = key.scalar_type();
  TORCH_CHECK(cache == at::kFloat || cache == at::kBFloat16 || cache == at::kHalf ||
                  cache == at::kFloat8_e5m2,
              "paged_prefill: the cache must be fp32, bf16, fp16 or fp8 (e5m2)");
  TORCH_CHECK(value.scalar_type() == cache, "paged_prefill: key and value dtypes differ");
#ifndef CONVEYOR_PREFILL_BF16
  TORCH_CHECK(!bf16, "paged_prefill: bf16 products need AVX-512 BF16");
#endif
  TORCH_CHECK(!bf16 || cache == at::kBFloat16, "paged_prefill: bf16 products need a bf16 cache");
  const int64_t heads = query.size(1), kv_heads = key.size(2);
  TORCH_CHECK(query.size(2) == key.size(3) && kv_heads > 0 && heads % kv_heads == 0,
              "paged_prefill: head shapes do not match");
  TORCH_CHECK(query.size(2) % kCols == 0, "paged_prefill: head_dim must be a multiple of 16");
  return cache;
}

// One sequence's query rows [start, start + tokens) after `context` cached tokens, its block ids
// checked to cover it inside the cache; its output rows at out (row `start` first).
Problem sequence(const at::Tensor& query, const at::Tensor& key, int64_t start, int64_t tokens,
                 int64_t context, const int64_t* blocks, int64_t width, double scale, float* out,
                 int64_t window, double softcap, const float* sinks) {
  TORCH_CHECK(context >= 0, "paged_prefill: context must not be negative");
  TORCH_CHECK(window >= 0, "paged_prefill: the window must not be negative");
  const int64_t heads = query.size(1), kv_heads = key.size(2), dim = query.size(2);
  const int64_t block_size = key.size(1);
  const int64_t used = (context + tokens + block_size - 1) / block_size;
  TORCH_CHECK(width >= used, "paged_prefill: blocks do not cover the sequence");
  for (int64_t b = 0; b < used; ++b)
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < key.size(0), "paged_prefill: block id out of range");
  return Problem{query.data_ptr<float>() + start * query.stride(0),
                 query.stride(0),
                 heads,
                 kv_heads,
                 heads / kv_heads,
                 dim,
                 block_size,
                 tokens,
                 context,
                 blocks,
                 static_cast<float>(scale),
                 out,
                 window,
                 static_cast<float>(std::max(softcap, 0.0)),
                 sinks};
}
#endif

}  // namespace

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const at::Tensor& blocks, int64_t context, double scale, bool bf16,
                         int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
#ifndef CONVEYOR_PREFILL_SIMD
  TORCH_CHECK(false, "paged_prefill needs AVX2, F16C and FMA");
#else
  const auto cache = check_shapes(query, key, value, bf16);
  const at::Tensor sinks32 = sink_logits(sinks, query.size(1), "paged_prefill");
  const at::Tensor ids = blocks.to(at::kLong).contiguous();
  TORCH_CHECK(ids.dim() == 1, "paged_prefill: blocks must be 1-d");
  at::Tensor out = at::empty(query.sizes(), query.options());
  const Problem p =
      sequence(query, key, 0, query.size(0), context, ids.data_ptr<int64_t>(), ids.size(0), scale,
               out.data_ptr<float>(), window, softcap, sinks_of(sinks32));
  if (query.size(0) > 0) run_cache(cache, bf16, std::vector<Problem>{p}, key, value);
  return out;
#endif
}

void paged_prefill_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        at::Tensor& out, const at::Tensor& starts, const at::Tensor& lens,
                        const at::Tensor& contexts, const at::Tensor& table, double scale,
                        bool bf16, int64_t window, double softcap,
                        const std::optional<at::Tensor>& sinks) {
#ifndef CONVEYOR_PREFILL_SIMD
  TORCH_CHECK(false, "paged_prefill needs AVX2, F16C and FMA");
#else
  const auto cache = check_shapes(query, key, value, bf16);
  const at::Tensor sinks32 = sink_logits(sinks, query.size(1), "paged_prefill");
  TORCH_CHECK(
      out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == query.sizes(),
      "paged_prefill_rows: out must be contiguous fp32 of the query's shape");
  const int64_t n = starts.numel();
  for (const at::Tensor* t : {&starts, &lens, &contexts})
    TORCH_CHECK(
        t->dim() == 1 && t->numel() == n && t->scalar_type() == at::kLong && t->is_contiguous(),
        "paged_prefill_rows: starts, lens and contexts are int64 [sequences]");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == n && table.scalar_type() == at::kLong &&
                  table.is_contiguous(),
              "paged_prefill_rows: table is int64 [sequences, width]");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* context = contexts.data_ptr<int64_t>();
  const int64_t width = table.size(1), row = query.size(1) * query.size(2);
  std::vector<Problem> ps;
  int64_t end = 0;  // where the sequence before ends: the runs are in order and apart
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(start[i] >= end && len[i] >= 1 && start[i] + len[i] <= query.size(0),
                "paged_prefill_rows: each sequence's rows lie in the query, in order, apart");
    end = start[i] + len[i];
    ps.push_back(sequence(
        query, key, start[i], len[i], context[i], table.data_ptr<int64_t>() + i * width, width,
        scale, out.data_ptr<float>() + start[i] * row, window, softcap, sinks_of(sinks32)));
  }
  if (!ps.empty()) run_cache(cache, bf16, ps, key, value);
#endif
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "paged_prefill(Tensor query, Tensor key, Tensor value, Tensor blocks, int context, "
      "float scale, bool bf16=False, int window=0, float softcap=0., Tensor? sinks=None) -> "
      "Tensor");
  m.def(
      "paged_prefill_rows(Tensor query, Tensor key, Tensor value, Tensor(a!) out, "
      "Tensor starts, Tensor lens, Tensor contexts, Tensor table, float scale, "
      "bool bf16=False, int window=0, float softcap=0., Tensor? sinks=None) -> ()");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("paged_prefill", &conveyor::paged_prefill);
  m.impl("paged_prefill_rows", &conveyor::paged_prefill_rows);
}
