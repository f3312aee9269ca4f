// A whole Llama-family decoder layer for a step of decode rows (one new token per sequence), in
// one op: RMSNorm, the fused q/k/v projection, rotary embedding of q and k, the new K/V stored at
// their slots, paged attention over the cache, the output projection and residual add, RMSNorm,
// the fused gate/up projection, silu(gate) * up, the down projection and residual add; or
// Gemma's layer, whose projections' outputs are normed before each residual add and whose MLP
// gates with GELU; or OLMo 2's, whose outputs are normed and whose inputs are not.
//
// hidden    [rows, hidden] fp32, contiguous
// weights   input norm [hidden], q/k/v panels, output panels, post-attention norm [hidden],
//           gate/up panels, down panels (panels as `panel_linear` takes them; gate/up may be
//           gated bf16 panels as `gated_linear` takes them); both norms empty ([0]): the rows
//           go to q/k/v and to gate/up as they are (OLMo 2's layer); gate/up and down both
//           empty: the layer's MLP is not this op's (a mixture of experts, run by the caller),
//           which returns the rows after the attention's residual add (`decode_layer` only)
// biases    the four projections' padded biases, in that order, each optional
// heads     [query heads, kv heads, head dim]
// cos, sin  [rows, 1, rotary dim] fp32 (a rotary dim short of the head dim: a partial rotary)
// key/value one layer of the cache, [blocks, block_size, kv heads, head dim] fp32, bf16, fp16
//           or fp8 (e5m2), contiguous (new K/V are rounded to its dtype as they are stored)
// slots     [rows] int64 cache slot of each row's new token
// table     [rows, width] int64 block ids; lens [rows] int64 tokens to attend to
// window    a sliding window: each row attends to its last `window` tokens only (0: all)
// qk_norm   optional [query heads + kv heads, head dim] fp32: each q and k head normed by its
//           row before the rotary (Qwen3's per-head norms), with the layer's eps; or
//           [(query heads + kv heads) * head dim]: q's heads normed as one row by the first
//           query heads * head dim values, k's as another by the rest (OLMo 2's)
// rotates   false: q and k are not rotated (SmolLM3's NoPE layers)
// attn_out_norm, mlp_out_norm
//           optional fp32 [hidden], both or neither: the attention's and the MLP's outputs each
//           normed before they join the residual (Gemma's four norms a layer)
// gelu      gelu(gate) * up under tanh's approximation (Gemma's), in place of silu(gate) * up
// residual_scale
//           the attention's and the MLP's outputs multiplied by it before they join the
//           residual (Granite's residual multiplier; 1: added as they are)
// softcap   scores capped as softcap * tanh(score / softcap) before the softmax (Gemma 2's;
//           0: not), as `paged_decode` caps them
// pairs     the rotary turns neighbouring dims as pairs (GLM's), as `rotary(pairs=True)` does
// norms_rotated
//           the q/k norm comes after the rotary (Hunyuan's), not before it
// sinks     optional fp32 [query heads]: a logit per head with no value joining its softmax
//           (gpt-oss's), as `paged_decode` takes them
// returns   [rows, hidden] fp32, the layer's output
//
// It calls the same kernels, in the same order, as the layer does op by op from Python, so the
// result is the same to the bit; what it saves is the dispatch of two dozen small ops a layer
// (about a third of a decode step for one sequence of the default model).
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "layer_args.h"
#include "ops.h"

namespace conveyor {
namespace {

// Whether the layer's MLP is this op's: its gate/up and down weights are given.
bool has_mlp(at::TensorList weights) { return weights[kGateUp].numel() > 0; }

// One layer's weights, cache and form, for rows of `width`.
void check_layer(at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                 at::IntArrayRef heads, const at::Tensor& key, const at::Tensor& value,
                 const LayerForm& form, int64_t width) {
  TORCH_CHECK(weights.size() == kWeights && biases.size() == kBiases && heads.size() == 3,
              "decode_layer: 6 weights, 4 biases and [heads, kv_heads, head_dim]");
  check_cache(key, value, "decode_layer");
  TORCH_CHECK(key.size(2) == heads[1] && key.size(3) == heads[2] && heads[0] % heads[1] == 0,
              "decode_layer: head shapes do not match the cache");
  TORCH_CHECK(qk_norm_fits(form.qk_norm, heads[0] + heads[1], heads[2]),
              "decode_layer: the q/k norm must be contiguous fp32 [heads + kv_heads, head_dim] "
              "or [(heads + kv_heads) * head_dim]");
  TORCH_CHECK(sinks_fit(form.sinks, heads[0]),
              "decode_layer: sinks must be contiguous fp32 [heads]");
  TORCH_CHECK(pre_normed(weights) == (weights[kPostNorm].numel() > 0),
              "decode_layer: the input and the post-attention norm come together");
  TORCH_CHECK((weights[kGateUp].numel() == 0) == (weights[kDown].numel() == 0),
              "decode_layer: gate/up and down come together (both empty: no MLP)");
  // The norms of the attention's and the MLP's outputs: both or neither, each fp32 [hidden] as
  // the layer's own norms.
  TORCH_CHECK(given(form.attn_out_norm) == given(form.mlp_out_norm),
              "decode_layer: the attention's and the MLP's output norms come together");
  TORCH_CHECK(!given(form.attn_out_norm) || form.residual_scale == 1.0,
              "decode_layer: output norms and scaled residual adds do not come together");
  for (const auto& out_norm : {form.attn_out_norm, form.mlp_out_norm})
    TORCH_CHECK(
        !given(out_norm) || (out_norm->scalar_type() == at::kFloat && out_norm->dim() == 1 &&
                             out_norm->size(0) == width && out_norm->is_contiguous()),
        "decode_layer: an output norm must be contiguous fp32 [hidden]");
}

// What every layer of a step shares: the rows and their slots in a cache of `key`'s size.
void check_step(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& key) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "decode_layer: hidden must be contiguous fp32 [rows, hidden]");
  check_slots(slots, hidden.size(0), key, "decode_layer");
}

// silu(gate) * up of the MLP's input x (with `gelu`, gelu(gate) * up under tanh's
// approximation, Gemma's): in one op over gated panels (4-d), else the gate/up projection then
// the activation. Gated panels hand bf16 down panels their rows already rounded to bf16, as
// that product would round them.
at::Tensor gated(const at::Tensor& x, const at::Tensor& panels,
                 const std::optional<at::Tensor>& bias, int64_t inter, const at::Tensor& down,
                 bool gelu) {
  if (panels.dim() == 4)
    return gated_linear(x, panels, bias, inter, down.scalar_type() == at::kBFloat16,
                        GateActivation::silu_or_gelu(gelu));
  const at::Tensor gate_up = panel_linear(x, panels, bias, 2 * inter);
  return gelu ? gelu_tanh_mul(gate_up) : silu_mul(gate_up);
}

// `residual` plus a projection's `out`: normed first where the form has output norms (Gemma's,
// `out_norm`), multiplied by its residual scale where not 1 (Granite's), else added in the
// product's own pass as `panel_linear` adds a residual.
at::Tensor add_output(const at::Tensor& x, const at::Tensor& panels,
                      const std::optional<at::Tensor>& bias, int64_t width,
                      const at::Tensor& residual, const std::optional<at::Tensor>& out_norm,
                      double eps, double scale) {
  if (given(out_norm))
    return residual + rms_norm(panel_linear(x, panels, bias, width), *out_norm, eps);
  if (scale != 1.0) return residual + panel_linear(x, panels, bias, width) * scale;
  return panel_linear(x, panels, bias, width, residual);
}

// q and k [rows, q heads + kv heads, dim] normed by `norm` before the rotary: each head by its
// row of a [heads, dim] norm (Qwen3's), or q's heads as one row and k's as another by a
// [heads * dim] norm's two parts (OLMo 2's, `all_heads_rms_norm`).
at::Tensor normed_qk(const at::Tensor& qk, const at::Tensor& norm, int64_t q_heads, double eps) {
  return norm.dim() == 2 ? head_rms_norm(qk, norm, eps)
                         : all_heads_rms_norm(qk, norm, q_heads, eps);
}

// The rows as the product of `panels` takes them: normed by `norm` (bf16 panels take them already
// rounded to bf16, as they would round them), or as they are where the layer norms nothing there.
at::Tensor normed_rows(const at::Tensor& rows, const at::Tensor& norm, double eps,
                       const at::Tensor& panels) {
  if (norm.numel() == 0) return rows;
  return rms_norm(rows, norm, eps, panels.scalar_type() == at::kBFloat16);
}

// One layer, its inputs already checked.
at::Tensor run_layer(const at::Tensor& hidden, at::TensorList weights,
                     const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef heads,
                     at::Tensor& key, at::Tensor& value, const at::Tensor& slots,
                     const at::Tensor& table, const at::Tensor& lens, double eps, double scale,
                     const LayerForm& form) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  const int64_t num_heads = heads[0], kv_heads = heads[1], dim = heads[2];
  const int64_t qk_heads = num_heads + kv_heads, kv_size = kv_heads * dim;
  const int64_t qkv_size = (qk_heads + kv_heads) * dim;

  at::Tensor x = normed_rows(hidden, weights[kInputNorm], eps, weights[kQkv]);
  at::Tensor qkv = panel_linear(x, weights[kQkv], biases.get(kQkvBias), qkv_size);
  at::Tensor qk = qkv.narrow(1, 0, qk_heads * dim).view({rows, qk_heads, dim});
  const bool qk_normed = given(form.qk_norm);
  if (qk_normed && !form.norms_rotated) qk = normed_qk(qk, *form.qk_norm, num_heads, eps);
  qk = form.rotates ? rotary(qk, form.cos, form.sin, form.pairs) : qk.contiguous();
  if (qk_normed && form.norms_rotated) qk = normed_qk(qk, *form.qk_norm, num_heads, eps);
  store_kv(qk.data_ptr<float>() + num_heads * dim, qk_heads * dim,
           qkv.data_ptr<float>() + qk_heads * dim, qkv_size, slots.data_ptr<int64_t>(), 0, rows,
           kv_size, key, value);
  at::Tensor attended = paged_decode(qk.narrow(1, 0, num_heads), key, value, table, lens, scale,
                                     form.window, form.softcap, form.sinks);
  const at::Tensor residual =
      add_output(attended.view({rows, num_heads * dim}), weights[kOut], biases.get(kOutBias), width,
                 hidden, form.attn_out_norm, eps, form.residual_scale);
  if (!has_mlp(weights)) return residual;

  const int64_t inter = panel_in_features(weights[kDown]);
  x = normed_rows(residual, weights[kPostNorm], eps, weights[kGateUp]);
  const at::Tensor activated =
      gated(x, weights[kGateUp], biases.get(kGateUpBias), inter, weights[kDown], form.gelu);
  return add_output(activated, weights[kDown], biases.get(kDownBias), width, residual,
                    form.mlp_out_norm, eps, form.residual_scale);
}

}  // namespace

at::Tensor decode_layer(const at::Tensor& hidden, at::TensorList weights,
                        const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef heads,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& key,
                        at::Tensor& value, const at::Tensor& slots, const at::Tensor& table,
                        const at::Tensor& lens, double eps, double scale, int64_t window,
                        const std::optional<at::Tensor>& qk_norm, bool rotates,
                        const std::optional<at::Tensor>& attn_out_norm,
                        const std::optional<at::Tensor>& mlp_out_norm, bool gelu,
                        double residual_scale, double softcap, bool pairs, bool norms_rotated,
                        const std::optional<at::Tensor>& sinks) {
  const LayerForm form{cos,     sin,           window,       qk_norm, rotates,
                       softcap, attn_out_norm, mlp_out_norm, gelu,    residual_scale,
                       pairs,   norms_rotated, sinks};
  check_layer(weights, biases, heads, key, value, form, hidden.size(-1));
  check_step(hidden, slots, key);
  return run_layer(hidden, weights, biases, heads, key, value, slots, table, lens, eps, scale,
                   form);
}

// Every layer of a decoder stack in turn, in one op: weights and biases are each layer's
// `decode_layer` arguments back to back (6 and 4 a layer), output norms two a layer (None where
// it has none); rotary rows, keys, values, windows, q/k norms (each optional), whether it
// rotates, whether it gates with GELU, its residual scale, its score cap, whether its rotary
// turns pairs, whether its q/k norm comes after the rotary and its sinks (each optional) each
// layer's own.
// One call instead of one a layer saves the Python and dispatch around each: a decode step for
// one sequence of the default model ran about 0.9 ms (11%) shorter.
at::Tensor decode_layers(const at::Tensor& hidden, at::TensorList weights,
                         const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef heads,
                         at::TensorList cos, at::TensorList sin, at::TensorList keys,
                         at::TensorList values, const at::Tensor& slots, const at::Tensor& table,
                         const at::Tensor& lens, double eps, double scale, at::IntArrayRef windows,
                         const c10::List<std::optional<at::Tensor>>& qk_norms,
                         const c10::List<bool>& rotates,
                         const c10::List<std::optional<at::Tensor>>& out_norms,
                         const c10::List<bool>& gelu, at::ArrayRef<double> residual_scales,
                         at::ArrayRef<double> softcaps, const c10::List<bool>& pairs,
                         const c10::List<bool>& norms_rotated,
                         const c10::List<std::optional<at::Tensor>>& sinks) {
  const size_t layers = keys.size();
  TORCH_CHECK(layers >= 1 && values.size() == layers && weights.size() == layers * kWeights &&
                  biases.size() == layers * kBiases && cos.size() == layers &&
                  sin.size() == layers && windows.size() == layers && qk_norms.size() == layers &&
                  rotates.size() == layers && out_norms.size() == 2 * layers &&
                  gelu.size() == layers && residual_scales.size() == layers &&
                  softcaps.size() == layers && pairs.size() == layers &&
                  norms_rotated.size() == layers && sinks.size() == layers,
              "decode_layers: per layer 6 weights, 4 biases, rotary rows, one key and one value "
              "cache, a window, one q/k norm or None, whether it rotates, two output norms or "
              "None, whether it gates with GELU, its residual scale, its score cap, whether it "
              "turns pairs, whether it norms q and k after the rotary, and its sinks or None");
  std::vector<c10::List<std::optional<at::Tensor>>> layer_biases(layers);
  std::vector<LayerForm> forms;
  for (size_t i = 0; i < layers; ++i) {
    for (size_t b = 0; b < kBiases; ++b) layer_biases[i].push_back(biases.get(i * kBiases + b));
    forms.push_back(LayerForm{cos[i], sin[i], windows[i], qk_norms.get(i), rotates.get(i),
                              softcaps[i], out_norms.get(2 * i), out_norms.get(2 * i + 1),
                              gelu.get(i), residual_scales[i], pairs.get(i), norms_rotated.get(i),
                              sinks.get(i)});
    check_layer(weights.slice(i * kWeights, kWeights), layer_biases[i], heads, keys[i], values[i],
                forms[i], hidden.size(-1));
    TORCH_CHECK(keys[i].sizes() == keys[0].sizes(), "decode_layers: caches of one size");
    TORCH_CHECK(has_mlp(weights.slice(i * kWeights, kWeights)),
                "decode_layers: every layer's MLP is the op's");
  }
  // A layer keeps the hidden size, so the rows and slots are checked once for all.
  check_step(hidden, slots, keys[0]);
  if (stack_region_applies(hidden.size(1), weights, biases, heads, forms))
    return decode_stack(hidden, weights, layer_biases, heads, keys, values, slots, table, lens, eps,
                        scale, forms);
  at::Tensor x = hidden;
  for (size_t i = 0; i < layers; ++i) {
    at::Tensor key = keys[i], value = values[i];
    x = run_layer(x, weights.slice(i * kWeights, kWeights), layer_biases[i], heads, key, value,
                  slots, table, lens, eps, scale, forms[i]);
  }
  return x;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor[] weights, Tensor?[] biases, int[] heads, "
      "Tensor cos, Tensor sin, Tensor(a!) key, Tensor(b!) value, Tensor slots, Tensor table, "
      "Tensor lens, float eps, float scale, int window=0, Tensor? qk_norm=None, "
      "bool rotates=True, Tensor? attn_out_norm=None, Tensor? mlp_out_norm=None, "
      "bool gelu=False, float residual_scale=1.0, float softcap=0., bool pairs=False, "
      "bool norms_rotated=False, Tensor? sinks=None) -> Tensor");
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] biases, int[] heads, "
      "Tensor[] cos, Tensor[] sin, Tensor(a!)[] keys, Tensor(b!)[] values, Tensor slots, "
      "Tensor table, Tensor lens, float eps, float scale, int[] windows, Tensor?[] qk_norms, "
      "bool[] rotates, Tensor?[] out_norms, bool[] gelu, float[] residual_scales, "
      "float[] softcaps, bool[] pairs, bool[] norms_rotated, Tensor?[] sinks) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("decode_layer", &conveyor::decode_layer);
  m.impl("decode_layers", &conveyor::decode_layers);
}
