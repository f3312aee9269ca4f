// Structured outputs' token mask applied to a step's logits: every token a row's format does
// not allow next becomes -inf.
//
// logits [rows, vocab] fp32, contiguous (changed in place)
// bits   [masked, words] int32, bit j of word w allows token 32 * w + j (llguidance's layout)
// rows   [masked] int64: the logits row each mask row applies to
//
// Most words of a mask are all ones (a JSON string allows nearly every token), so a word is
// skipped whole unless it holds a zero, and only its zero bits are visited. Rows are split over
// torch's threads. numpy's unpackbits and a masked fill took 3.6 ms for 64 rows of the default
// model's 49152 tokens.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

void mask_row(float* row, const uint32_t* words, int64_t num_words, int64_t vocab) {
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  for (int64_t w = 0; w < num_words; ++w) {
    uint32_t zeros = ~words[w];
    while (zeros != 0) {
      const int64_t token = w * 32 + __builtin_ctz(zeros);
      if (token >= vocab) break;
      row[token] = kBanned;
      zeros &= zeros - 1;
    }
  }
  for (int64_t token = num_words * 32; token < vocab; ++token) row[token] = kBanned;
}

}  // namespace

namespace conveyor {

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bits, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "apply_token_bitmask: logits must be contiguous fp32 [rows, vocab]");
  TORCH_CHECK(bits.dim() == 2 && bits.scalar_type() == at::kInt && bits.is_contiguous(),
              "apply_token_bitmask: bits must be contiguous int32 [masked, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bits.size(0),
              "apply_token_bitmask: rows must be int64 [masked]");
  const int64_t masked = bits.size(0), num_words = bits.size(1), vocab = logits.size(1);
  const int64_t* row_index = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < masked; ++r)
    TORCH_CHECK(0 <= row_index[r] && row_index[r] < logits.size(0),
                "apply_token_bitmask: a row index is out of range");
  float* lp = logits.data_ptr<float>();
  const auto* bp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  at::parallel_for(0, masked, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      mask_row(lp + row_index[r] * vocab, bp + r * num_words, num_words, vocab);
  });
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bits, Tensor rows) -> ()");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("apply_token_bitmask", &conveyor::apply_token_bitmask);
}
