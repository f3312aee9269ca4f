// How `decode_layer` and `decode_layers` take a layer's tensors: six weights and four biases a
// layer, in this order (`decode_layer.cpp`, and the stack in one region, `decode_stack.cpp`),
// and what makes a layer other than the plain Llama layer (`LayerForm`).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace conveyor {

// The input and post-attention norms may both be empty ([0]): nothing is normed before the
// attention or the MLP (OLMo 2's layer, which norms their outputs instead).
enum Weight { kInputNorm, kQkv, kOut, kPostNorm, kGateUp, kDown, kWeights };
enum Bias { kQkvBias, kOutBias, kGateUpBias, kDownBias, kBiases };

// One layer's own rotary rows, window and optional parts.
struct LayerForm {
  // [rows, 1, rotary dim] fp32: the step's rotary rows for this layer's type.
  at::Tensor cos, sin;
  // A sliding window (0: the whole context).
  int64_t window = 0;
  // Each q and k head's norm, [heads + kv heads, head dim] fp32 (Qwen3's, Gemma 3's); or q's
  // and k's norms side by side, [(heads + kv heads) * head dim] fp32, q's heads then normed as
  // one row and k's as another (OLMo 2's).
  std::optional<at::Tensor> qk_norm;
  // False: q and k are not rotated (SmolLM3's NoPE layers).
  bool rotates = true;
  // Scores capped as softcap * tanh(score / softcap) before the softmax (Gemma 2's; 0: not).
  double softcap = 0.0;
  // The attention's and the MLP's output norms before the residual adds (Gemma's), or neither.
  std::optional<at::Tensor> attn_out_norm, mlp_out_norm;
  // gelu(gate) * up, tanh's approximation (Gemma's), instead of silu(gate) * up.
  bool gelu = false;
  // The attention's and the MLP's outputs multiplied by this before they join the residual
  // (Granite's `residual_multiplier`; 1: added as they are).
  double residual_scale = 1.0;
  // The rotary turns neighbouring dims as pairs (GLM's, ERNIE 4.5's, Helium's), not halves.
  bool pairs = false;
  // The q/k norm comes after the rotary (Hunyuan's), not before it.
  bool norms_rotated = false;
  // A logit per query head with no value that joins each head's softmax (gpt-oss's sinks), fp32
  // [heads], contiguous; or none.
  std::optional<at::Tensor> sinks;
};

inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// An optional fp32 tensor's values (a bias, a q/k norm), or null.
inline const float* optional_floats(const std::optional<at::Tensor>& t) {
  return given(t) ? t->data_ptr<float>() : nullptr;
}

// No q/k norm, or a contiguous fp32 one of [qk_heads, dim] (a head a row) or [qk_heads * dim]
// (q's heads as one row, k's as another).
inline bool qk_norm_fits(const std::optional<at::Tensor>& norm, int64_t qk_heads, int64_t dim) {
  if (!given(norm)) return true;
  const bool shaped = norm->dim() == 2 ? norm->size(0) == qk_heads && norm->size(1) == dim
                                       : norm->dim() == 1 && norm->size(0) == qk_heads * dim;
  return shaped && norm->scalar_type() == at::kFloat && norm->is_contiguous();
}

// No sinks, or contiguous fp32 [heads].
inline bool sinks_fit(const std::optional<at::Tensor>& sinks, int64_t heads) {
  return !given(sinks) || (sinks->dim() == 1 && sinks->size(0) == heads &&
                           sinks->scalar_type() == at::kFloat && sinks->is_contiguous());
}

// Whether a layer's weights norm the rows before the attention and the MLP.
inline bool pre_normed(at::TensorList weights) { return weights[kInputNorm].numel() > 0; }

}  // namespace conveyor
