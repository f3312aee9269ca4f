// What a layer's attention does to its scores beyond the plain softmax, shared by the decode and
// prompt kernels (`paged_decode.cpp`, `paged_prefill.cpp`) so that both compute it alike: scores
// capped (Gemma 2's soft cap), and per-head sinks (gpt-oss's logits with no value).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace conveyor {

// scores[0, n) capped in place as softcap * tanh(score / softcap).
inline void cap_scores(float* scores, int64_t n, float softcap) {
  const float inverse = 1.f / softcap;
  for (int64_t i = 0; i < n; ++i) scores[i] = softcap * std::tanh(scores[i] * inverse);
}

// A layer's sinks as the kernels read them: fp32 [heads], contiguous; undefined where it has
// none. `op` names the caller in the error.
inline at::Tensor sink_logits(const std::optional<at::Tensor>& sinks, int64_t heads,
                              const char* op) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  at::Tensor logits = sinks->to(at::kFloat).contiguous();
  TORCH_CHECK(logits.dim() == 1 && logits.size(0) == heads, op, ": one sink per query head");
  return logits;
}

// The sinks' logits, or null where the layer has none.
inline const float* sinks_of(const at::Tensor& logits) {
  return logits.defined() ? logits.data_ptr<float>() : nullptr;
}

}  // namespace conveyor
