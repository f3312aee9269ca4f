// Linear layers over GGUF Q4_1 or Q8_0 blocks multiplied against activations rounded to 8-bit
// blocks, as llama.cpp multiplies them: y = x w^T + bias with x, bias and y in fp32.
// `panel_linear` checks the inputs and calls this product for int8 panels.
//
// x       [rows, in]                      fp32, contiguous
// panels  [ceil(out / 16), in / 32, G]    int8: block panels laid out for 8-bit products
//                                         (`block_panels.h`: `Q41Int8`, G = 320, or `Q80Int8`,
//                                         G = 544)
// bias    [panels * 16]                   fp32, optional, zero-padded like the panels
//
// Each row of x is first rounded, per block of 32 input features, to int8 q with one fp32 scale
// d = max|x| / 127 (q = round(x * 127 / max|x|), ties to even), and s = d * sum(q) is kept. A
// Q4_1 weight block is d_w * q_w + m_w (q_w in 0..15), so the block's share of an output is
// d_w * d_x * sum(q_w * q_x) + m_w * s: the weights times the rounded inputs d_x * q_x. The
// integer sums run in AVX2's 8-bit multiply-adds, four input features of eight columns per
// instruction, and stay exact in 16 bits over a whole block (each 16-bit lane sums 16 products,
// at most 16 * 15 * 127); each block then adds its two terms to fp32 accumulators in input
// order. A Q8_0 block (d_w * q_w, q_w signed) adds d_w * d_x * sum(q_w * q_x), its integer sum
// widened to 32 bits as it goes (`micro_q80`). With AVX-512 VNNI, one `vpdpbusd` replaces each
// multiply-add and its widening (`add_products`), with the same exact integer sums.
//
// This is not the exact product of the dequantized weights: the activations are rounded to
// about 2 decimal digits per block, which is why a model uses these panels only when asked to.
// It doubles the arithmetic rate of the fp32 multiply-adds for Q4_1 on CPUs without native 8-bit
// dot products or bf16 (Q8_0, with twice the weight bits, gains less). A row's result still
// does not depend on the rows batched with it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "block_panels.h"
#include "lanes.h"
#include "ops.h"
#include "panel_passes.h"
#include "scratch.h"
#include "pass_split.h"

namespace {

using conveyor::chunk_rows;
using conveyor::kPanel;
using conveyor::near_equal_passes;

// Rows of rounded x handled per pass over the weight: about this many bytes, kept in L2.
constexpr int64_t kInt8ChunkBytes = 128 * 1024;

#ifdef CONVEYOR_BLOCK_PANELS
using conveyor::kBlock;
using conveyor::Q41Int8;
using conveyor::Q80Int8;

// x rounded to 8-bit blocks: q [rows, in] int8, and per row and block its scale d and d * sum(q).
struct RoundedRows {
  conveyor::Scratch<int8_t> q;
  conveyor::Scratch<float> d, s;
  int64_t K;
};

using conveyor::horizontal_max;
using conveyor::horizontal_sum;

// One block of 32 features of a row: q (32 bytes), its scale d and s = d * sum(q).
void round_block(const float* x, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  const float top = horizontal_max(amax);
  *d = top / 127.0f;
  const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
  // The sum of the rounded block (exact in fp32: at most 32 * 127), so that a weight block's
  // minimum multiplies the same rounded inputs as its d * q does.
  const __m256i total =
      _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  *s = *d * horizontal_sum(_mm256_cvtepi32_ps(total));
  // packs interleave 128-bit lanes: [0-3 4-7 | ...] comes back in order after the permute.
  const __m256i packed =
      _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
}

RoundedRows round_rows(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / kBlock;
  RoundedRows rows{conveyor::scratch<int8_t>(M * K), conveyor::scratch<float>(M * blocks),
                   conveyor::scratch<float>(M * blocks), K};
  at::parallel_for(0, M, conveyor::rows_per_task(K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b)
        round_block(x + m * K + b * kBlock, rows.q.get() + m * K + b * kBlock,
                    rows.d.get() + m * blocks + b, rows.s.get() + m * blocks + b);
  });
  return rows;
}

// With AVX-512 VNNI, one `vpdpbusd` adds four unsigned-by-signed byte products straight into
// 32-bit sums; AVX2 alone multiplies pairs into 16-bit sums (`vpmaddubsw`) and adds those. Both
// are exact, so the two give the same results to the bit.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
CONVEYOR_INLINE __m256i add_products(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
// A block's sums as 32-bit lanes: already so.
CONVEYOR_INLINE __m256i block_sums(__m256i acc) { return acc; }
// The 32-bit sums of four products each, for Q8_0's pairs that may reach 2 * 128 * 127:
// `add_products` is already wide.
CONVEYOR_INLINE __m256i add_wide_products(__m256i acc, __m256i u, __m256i s) {
  return add_products(acc, u, s);
}
#else
CONVEYOR_INLINE __m256i add_products(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
}
CONVEYOR_INLINE __m256i block_sums(__m256i acc) {
  return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
}
CONVEYOR_INLINE __m256i add_wide_products(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// acc[m][h] += the 8-bit products of 4 rounded features of MR rows (at q, row stride ldq) with
// the same 4 features of columns 8h..8h+7 in w[h].
template <int MR>
CONVEYOR_INLINE void dot_step(__m256i (&acc)[MR][2], const int8_t* q, int64_t ldq,
                              const __m256i (&w)[2]) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    int32_t four;
    std::memcpy(&four, q + m * ldq, 4);
    const __m256i xb = _mm256_set1_epi32(four);
    acc[m][0] = add_products(acc[m][0], w[0], xb);
    acc[m][1] = add_products(acc[m][1], w[1], xb);
    // Keeps each sum a chain in input order: reassociated, the products all wait in registers.
    asm("" : "+x"(acc[m][0]), "+x"(acc[m][1]));
  }
}

// The panel's first `cols` columns of MR rows of sums, plus bias, to out (row stride ldo).
template <int MR>
CONVEYOR_INLINE void store_rows(const float (&total)[MR][kPanel], float* out, int64_t ldo,
                                int64_t cols, const float* bias) {
  if (cols == kPanel) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 low = bias == nullptr ? zero : _mm256_loadu_ps(bias);
    const __m256 high = bias == nullptr ? zero : _mm256_loadu_ps(bias + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      _mm256_storeu_ps(out + m * ldo, _mm256_add_ps(_mm256_load_ps(total[m]), low));
      _mm256_storeu_ps(out + m * ldo + 8, _mm256_add_ps(_mm256_load_ps(total[m] + 8), high));
    }
    return;
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t j = 0; j < cols; ++j)
      out[m * ldo + j] = total[m][j] + (bias == nullptr ? 0.0f : bias[j]);
}

// MR rows of rounded x (from row `row`) times one Q4_1 panel: out rows (stride ldo) get the
// panel's first `cols` columns plus bias. Kept out of line: inlined into the loop over passes, it
// ran 15% slower (GCC kept fewer of its values in registers).
template <int MR>
__attribute__((noinline)) void micro_q41(const RoundedRows& x, int64_t row, const int8_t* panel,
                                         float* out, int64_t ldo, int64_t cols, const float* bias) {
  const int64_t K = x.K, blocks = K / kBlock;
  const int8_t* q = x.q.get() + row * K;
  const float* xd = x.d.get() + row * blocks;
  const float* xs = x.s.get() + row * blocks;
  alignas(32) float total[MR][kPanel] = {};
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* group = reinterpret_cast<const uint8_t*>(panel) + b * Q41Int8::kGroupBytes;
    const uint8_t* packed = group + Q41Int8::kScaleBytes;
    __m256i acc[MR][2];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int step = 0; step < 4; ++step) {
      const __m256i both[2] = {
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + step * 32)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + (4 + step) * 32))};
      const __m256i first[2] = {_mm256_and_si256(both[0], low), _mm256_and_si256(both[1], low)};
      dot_step<MR>(acc, q + b * kBlock + 4 * step, K, first);
      const __m256i second[2] = {_mm256_and_si256(_mm256_srli_epi16(both[0], 4), low),
                                 _mm256_and_si256(_mm256_srli_epi16(both[1], 4), low)};
      dot_step<MR>(acc, q + b * kBlock + 16 + 4 * step, K, second);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 dw =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16 * h)));
      const __m256 mw =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 32 + 16 * h)));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 dots = _mm256_mul_ps(_mm256_cvtepi32_ps(block_sums(acc[m][h])),
                                          _mm256_broadcast_ss(xd + m * blocks + b));
        __m256 sum = _mm256_load_ps(total[m] + 8 * h);
        sum = _mm256_fmadd_ps(dots, dw, sum);
        sum = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(xs + m * blocks + b), sum);
        _mm256_store_ps(total[m] + 8 * h, sum);
      }
    }
  }
  store_rows<MR>(total, out, ldo, cols, bias);
}

// MR rows of rounded x times one Q8_0 panel, as `micro_q41` does. Signed weights times signed
// inputs: AVX2's 8-bit multiply-add takes one operand unsigned, so it multiplies |w| by x with
// w's sign moved onto it. A pair of such products reaches 2 * 128 * 127, so each pass is widened
// to 32 bits at once and the block sums there (exact: at most 32 * 128 * 127).
template <int MR>
__attribute__((noinline)) void micro_q80(const RoundedRows& x, int64_t row, const int8_t* panel,
                                         float* out, int64_t ldo, int64_t cols, const float* bias) {
  const int64_t K = x.K, blocks = K / kBlock;
  const int8_t* q = x.q.get() + row * K;
  const float* xd = x.d.get() + row * blocks;
  alignas(32) float total[MR][kPanel] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* group = reinterpret_cast<const uint8_t*>(panel) + b * Q80Int8::kGroupBytes;
    const uint8_t* packed = group + Q80Int8::kScaleBytes;
    __m256i acc[MR][2];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int step = 0; step < 8; ++step) {
      const __m256i w[2] = {
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + step * 32)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + (8 + step) * 32))};
      const __m256i size[2] = {_mm256_abs_epi8(w[0]), _mm256_abs_epi8(w[1])};
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        int32_t four;
        std::memcpy(&four, q + m * K + b * kBlock + 4 * step, 4);
        const __m256i xb = _mm256_set1_epi32(four);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          acc[m][h] = add_wide_products(acc[m][h], size[h], _mm256_sign_epi8(xb, w[h]));
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 dw =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16 * h)));
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 dots =
            _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][h]), _mm256_broadcast_ss(xd + m * blocks + b));
        _mm256_store_ps(total[m] + 8 * h,
                        _mm256_fmadd_ps(dots, dw, _mm256_load_ps(total[m] + 8 * h)));
      }
    }
  }
  store_rows<MR>(total, out, ldo, cols, bias);
}

// The two panel layouts: their group size, rows per pass and micro kernels.
struct Q41Product {
  static constexpr int64_t kGroupBytes = Q41Int8::kGroupBytes;
  static constexpr int kMaxRows = 4;
  template <int MR>
  static void micro(const RoundedRows& x, int64_t row, const int8_t* panel, float* out, int64_t ldo,
                    int64_t cols, const float* bias) {
    micro_q41<MR>(x, row, panel, out, ldo, cols, bias);
  }
};

struct Q80Product {
  static constexpr int64_t kGroupBytes = Q80Int8::kGroupBytes;
  static constexpr int kMaxRows = 4;
  template <int MR>
  static void micro(const RoundedRows& x, int64_t row, const int8_t* panel, float* out, int64_t ldo,
                    int64_t cols, const float* bias) {
    micro_q80<MR>(x, row, panel, out, ldo, cols, bias);
  }
};

struct Int8Problem {
  const RoundedRows& x;
  const float* bias;
  float* out;
  int64_t M, N;
};

// Rows [m0, m0 + rows) times panel p, in passes of at most F::kMaxRows rows of near-equal size.
template <typename F>
void rows_by_panel(const Int8Problem& pb, int64_t m0, int64_t rows, const int8_t* panel,
                   int64_t p) {
  const int64_t n0 = p * kPanel;
  const int64_t cols = std::min(kPanel, pb.N - n0);
  const float* bias = pb.bias == nullptr ? nullptr : pb.bias + n0;
  near_equal_passes(m0, rows, F::kMaxRows, [&](int64_t m, int64_t mr) {
    float* out = pb.out + m * pb.N + n0;
    switch (mr) {
      case 4: F::template micro<4>(pb.x, m, panel, out, pb.N, cols, bias); break;
      case 3: F::template micro<3>(pb.x, m, panel, out, pb.N, cols, bias); break;
      case 2: F::template micro<2>(pb.x, m, panel, out, pb.N, cols, bias); break;
      default: F::template micro<1>(pb.x, m, panel, out, pb.N, cols, bias); break;
    }
  });
}

// Panels [p0, p1) for all rows, a chunk of rows at a time.
template <typename F>
void panel_range(const Int8Problem& pb, const int8_t* panels, int64_t p0, int64_t p1) {
  const int64_t panel_bytes = pb.x.K / kBlock * F::kGroupBytes;
  const int64_t chunk = chunk_rows(pb.x.K, kInt8ChunkBytes, F::kMaxRows);
  for (int64_t m0 = 0; m0 < pb.M; m0 += chunk) {
    const int64_t rows = std::min(chunk, pb.M - m0);
    for (int64_t p = p0; p < p1; ++p) rows_by_panel<F>(pb, m0, rows, panels + p * panel_bytes, p);
  }
}

template <typename F>
void run_int8(const Int8Problem& pb, const at::Tensor& panels) {
  const int8_t* w = panels.data_ptr<int8_t>();
  at::parallel_for(0, panels.size(0), 4,
                   [&](int64_t p0, int64_t p1) { panel_range<F>(pb, w, p0, p1); });
}
#endif

}  // namespace

namespace conveyor {

void int8_panel_product(const float* x, int64_t M, int64_t K, const at::Tensor& panels,
                        const float* bias, float* out, int64_t out_features) {
#ifndef CONVEYOR_BLOCK_PANELS
  TORCH_CHECK(false, "int8 block panels need AVX2, F16C and FMA");
#else
  const RoundedRows rounded = round_rows(x, M, K);
  const Int8Problem pb{rounded, bias, out, M, out_features};
  if (panels.size(2) == conveyor::Q80Int8::kGroupBytes) run_int8<Q80Product>(pb, panels);
  else run_int8<Q41Product>(pb, panels);
#endif
}

}  // namespace conveyor
