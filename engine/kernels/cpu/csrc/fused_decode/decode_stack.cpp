// A decode step's whole layer stack in one parallel region, for layers whose projections are
// all bf16 panels (gate/up as gated pairs, under silu or Gemma's GELU; Gemma's output norms
// too, or OLMo 2's in place of the input norms, each layer with its own window and rotary rows):
// every kernel of every layer runs as the team's threads' parts (`thread_team.h`), with a barrier
// between kernels, over buffers made once for the step. Called by `decode_layers`
// (`decode_layer.cpp`), it computes what the layers' ops compute one after the other, to the bit:
// the same routines over the same rows, each output summed in the same order whichever thread
// computes it.
//
// Op by op, each kernel forked the threads and joined them, and between kernels the calling
// thread made the next op's tensors and stored the new K/V alone while the others waited: at 16
// decode rows of the default model the other thread sat idle for 13% of the stack's time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "panel_shapes.h"
#include "bf16_round.h"
#include "layer_args.h"
#include "ops.h"
#include "scratch.h"
#include "pass_split.h"
#include "thread_team.h"

namespace conveyor {
namespace {

bool fp32_norm(const at::Tensor& w, int64_t width) {
  return w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == width && w.is_contiguous();
}

// The input and post-attention norms of a layer: fp32 [width] both, or both empty (OLMo 2's
// layer norms nothing before the attention and the MLP).
bool pre_norms_fit(at::TensorList w, int64_t width) {
  if (!pre_normed(w)) return w[kPostNorm].numel() == 0;
  return fp32_norm(w[kInputNorm], width) && fp32_norm(w[kPostNorm], width);
}

// fp32 rotary rows [rows, 1, width] of an even width up to the head's, cos and sin alike.
bool rotary_rows_fit(const at::Tensor& cos, const at::Tensor& sin, int64_t dim) {
  return cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == 1 && cos.size(2) <= dim &&
         cos.size(2) % 2 == 0 && cos.scalar_type() == at::kFloat &&
         sin.scalar_type() == at::kFloat && cos.stride(2) == 1 && sin.stride(2) == 1 &&
         cos.stride(0) == sin.stride(0);
}

// A product of the stack: its panels, how many, and whether they come in gate/up pairs.
struct Product {
  const uint16_t* panels;
  int64_t count;
  bool gated;
};

// What every layer of the step shares, and the buffers its kernels pass rows through.
struct Stack {
  int64_t rows, width, heads, kv_heads, dim, inter;
  int64_t qk_size, qkv_size, attn_size;
  float eps;
  const int64_t *slots, *table, *lens;
  int64_t table_width;
  float scale;
  std::vector<ProductTask> qkv_tasks, out_tasks, gated_tasks, down_tasks;
  conveyor::Scratch<uint16_t> normed, attended16, gated16;
  conveyor::Scratch<float> qkv, qk, attended, residual;
  // A projection's rows before their output norm, and those rows normed (Gemma's layers).
  conveyor::Scratch<float> projected, normed32;
};

// One layer's tensors (`input_norm` and `post_norm` null where nothing is normed before the
// attention and the MLP, `qk_norm` null where its q and k heads are not normed, with
// `qk_all_heads` q's heads normed as one row and k's as another, the output norms null where it
// has none), its rotary rows (`rotary_dim` 0: a NoPE layer, which rotates
// nothing), its window (0: none), whether it gates with GELU and what its outputs are multiplied
// by before they join the residual (Granite's; 1: nothing).
struct Layer {
  const float *input_norm, *post_norm, *qk_norm, *attn_out_norm, *mlp_out_norm;
  bool qk_all_heads, gelu;
  // The rotary turns neighbouring pairs (GLM's); the q/k norm comes after it (Hunyuan's).
  bool pairs, norms_rotated;
  float residual_scale, softcap;
  const float *cos, *sin;
  int64_t cs_stride, rotary_dim, window;
  Product qkv, out, gate_up, down;
  const float *qkv_bias, *out_bias, *gate_up_bias, *down_bias;
  at::Tensor key, value;
};

// This thread's rows of a pass over rows of `row_values` values, split as the op's own
// `at::parallel_for` splits them.
Share rows_of(const Team& team, const Stack& st, int64_t row_values) {
  return share(team, st.rows, rows_per_task(row_values));
}

void product(const Bf16Product& pb, const Product& p, const std::vector<ProductTask>& tasks,
             std::atomic<int64_t>& next) {
  bf16_take_tasks(pb, p.panels, p.count, p.gated, tasks, next);
}

// out = residual + projected * scale over [begin, end), each product rounded before the add, as
// torch's mul then add compute it (no fused multiply-add).
__attribute__((optimize("fp-contract=off"))) void add_scaled(const float* residual,
                                                             const float* projected, float scale,
                                                             float* out, int64_t begin,
                                                             int64_t end) {
  for (int64_t i = begin; i < end; ++i) out[i] = residual[i] + projected[i] * scale;
}

// A projection's output onto `residual` [rows, width] at `out`, as this thread takes part: the
// product adds the residual as it stores its sums; or, with an output norm (Gemma's) or a
// residual scale (Granite's), it stores them alone, and each of this thread's rows is normed or
// scaled, then added to the residual, as the layer computes `residual + norm(projection(x))`
// or `residual + projection(x) * scale` op by op.
void add_output(const Team& team, Stack& st, Bf16Product pb, const Product& p,
                const std::vector<ProductTask>& tasks, std::atomic<int64_t>& taken,
                const float* residual, float* out, const float* out_norm, float scale) {
  if (out_norm == nullptr && scale == 1.f) {
    pb.residual = residual;
    pb.out = out;
    product(pb, p, tasks, taken);
    barrier();
    return;
  }
  pb.out = st.projected.get();
  product(pb, p, tasks, taken);
  barrier();
  const Share part = rows_of(team, st, st.width);
  const float* added = st.projected.get();
  if (out_norm != nullptr) {
    rms_norm_rows(st.projected.get(), out_norm, st.normed32.get(), nullptr, st.width, st.eps,
                  part.begin, part.end);
    added = st.normed32.get();
  }
  // A normed output's scale is 1 (`decode_layer` refuses both in a layer): times 1 is exact.
  add_scaled(residual, added, scale, out, part.begin * st.width, part.end * st.width);
  barrier();
}

// This thread's rows of `in` [rows, width] as a product takes them: normed by `norm` and rounded
// to bf16, or only rounded where the layer norms nothing there (as the product rounds fp32 rows).
void product_rows(const Team& team, Stack& st, const float* in, const float* norm) {
  const Share part = rows_of(team, st, st.width);
  if (norm != nullptr) {
    rms_norm_rows(in, norm, nullptr, st.normed.get(), st.width, st.eps, part.begin, part.end);
    return;
  }
  for (int64_t r = part.begin; r < part.end; ++r)
    round_to_bf16(in + r * st.width, st.width, st.normed.get() + r * st.width);
}

// This thread's rows [begin, end) of q and k heads (rows at `stride` from `qk`) normed in place,
// where the layer norms them: each head by its row, or q's and k's heads each as one row.
void norm_qk(const Stack& st, const Layer& layer, float* qk, int64_t stride, Share part) {
  if (layer.qk_norm == nullptr) return;
  if (layer.qk_all_heads)
    rms_norm_q_and_k(qk, stride, layer.qk_norm, qk, stride, st.attn_size, st.qk_size - st.attn_size,
                     st.eps, part.begin, part.end);
  else
    rms_norm_heads(qk, stride, layer.qk_norm, qk, stride, st.heads + st.kv_heads, st.dim, st.eps,
                   part.begin, part.end);
}

// One layer from `in` to `out` [rows, width], as this thread takes part; `taken` are the
// layer's five counters (four products, the attention), zero before it starts.
void run_layer(const Team& team, Stack& st, const Layer& layer, const float* in, float* out,
               std::atomic<int64_t>* taken) {
  const int64_t M = st.rows;
  product_rows(team, st, in, layer.input_norm);
  barrier();
  product(
      {st.normed.get(), layer.qkv_bias, nullptr, st.qkv.get(), nullptr, M, st.width, st.qkv_size},
      layer.qkv, st.qkv_tasks, taken[0]);
  barrier();
  // q and k normed (where the layer norms them) and rotated, then this thread's rows' new K
  // (rotated) and V to their slots.
  const int64_t qk_heads = st.heads + st.kv_heads;
  Share part = rows_of(team, st, st.qk_size);
  if (!layer.norms_rotated) norm_qk(st, layer, st.qkv.get(), st.qkv_size, part);
  rotary_rows(st.qkv.get(), st.qkv_size, layer.cos, layer.sin, layer.cs_stride, st.qk.get(),
              qk_heads, st.dim, layer.rotary_dim, part.begin, part.end, layer.pairs);
  if (layer.norms_rotated) norm_qk(st, layer, st.qk.get(), st.qk_size, part);
  at::Tensor key = layer.key, value = layer.value;
  store_kv(st.qk.get() + st.attn_size, st.qk_size, st.qkv.get() + st.qk_size, st.qkv_size, st.slots,
           part.begin, part.end, st.kv_heads * st.dim, key, value);
  barrier();
  paged_decode_team({st.qk.get(), st.qk_size, M, st.heads, st.table, st.table_width, st.lens,
                     st.scale, st.attended.get(), layer.window, layer.softcap},
                    key, value, team, taken[1]);
  barrier();
  part = rows_of(team, st, st.attn_size);
  for (int64_t r = part.begin; r < part.end; ++r)
    round_to_bf16(st.attended.get() + r * st.attn_size, st.attn_size,
                  st.attended16.get() + r * st.attn_size);
  barrier();
  add_output(
      team, st,
      {st.attended16.get(), layer.out_bias, nullptr, nullptr, nullptr, M, st.attn_size, st.width},
      layer.out, st.out_tasks, taken[2], in, st.residual.get(), layer.attn_out_norm,
      layer.residual_scale);
  product_rows(team, st, st.residual.get(), layer.post_norm);
  barrier();
  product({st.normed.get(), layer.gate_up_bias, nullptr, nullptr, st.gated16.get(), M, st.width,
           st.inter, nullptr, GateActivation::silu_or_gelu(layer.gelu)},
          layer.gate_up, st.gated_tasks, taken[3]);
  barrier();
  add_output(team, st,
             {st.gated16.get(), layer.down_bias, nullptr, nullptr, nullptr, M, st.inter, st.width},
             layer.down, st.down_tasks, taken[4], st.residual.get(), out, layer.mlp_out_norm,
             layer.residual_scale);
}

Layer layer_of(at::TensorList w, const c10::List<std::optional<at::Tensor>>& b,
               const at::Tensor& key, const at::Tensor& value, const LayerForm& form) {
  auto plain = [](const at::Tensor& p) { return Product{panel_bits(p), p.size(0), false}; };
  const bool normed = pre_normed(w);
  return Layer{normed ? w[kInputNorm].data_ptr<float>() : nullptr,
               normed ? w[kPostNorm].data_ptr<float>() : nullptr,
               optional_floats(form.qk_norm),
               optional_floats(form.attn_out_norm),
               optional_floats(form.mlp_out_norm),
               given(form.qk_norm) && form.qk_norm->dim() == 1,
               form.gelu,
               form.pairs,
               form.norms_rotated,
               static_cast<float>(form.residual_scale),
               static_cast<float>(std::max(form.softcap, 0.0)),
               form.cos.data_ptr<float>(),
               form.sin.data_ptr<float>(),
               form.cos.stride(0),
               form.rotates ? form.cos.size(2) : 0,
               std::max<int64_t>(form.window, 0),
               plain(w[kQkv]),
               plain(w[kOut]),
               Product{panel_bits(w[kGateUp]), 2 * w[kGateUp].size(0), true},
               plain(w[kDown]),
               optional_floats(b.get(kQkvBias)),
               optional_floats(b.get(kOutBias)),
               optional_floats(b.get(kGateUpBias)),
               optional_floats(b.get(kDownBias)),
               key,
               value};
}

}  // namespace

bool stack_region_applies(int64_t width, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef heads,
                          const std::vector<LayerForm>& forms) {
#ifndef CONVEYOR_BF16_ROUND
  return false;
#else
  const int64_t layers = static_cast<int64_t>(weights.size()) / kWeights;
  const int64_t num_heads = heads[0], kv_heads = heads[1], dim = heads[2];
  if (layers < 1 || dim % 2 != 0 || static_cast<int64_t>(forms.size()) != layers) return false;
  const int64_t qkv_size = (num_heads + 2 * kv_heads) * dim, attn_size = num_heads * dim;
  if (weights[kDown].dim() != 3) return false;
  const int64_t inter = weights[kDown].size(1) * 2;
  const int64_t gated_panel_count = (inter + 15) / 16;
  for (int64_t i = 0; i < layers; ++i) {
    at::TensorList w = weights.slice(i * kWeights, kWeights);
    auto bias = [&](int b) { return biases.get(i * kBiases + b); };
    const LayerForm& form = forms[i];
    if (given(form.sinks)) return false;  // the region's attention takes none
    const bool out_norms = !given(form.attn_out_norm) || (fp32_norm(*form.attn_out_norm, width) &&
                                                          fp32_norm(*form.mlp_out_norm, width));
    if (!out_norms || !rotary_rows_fit(form.cos, form.sin, dim)) return false;
    if (!(pre_norms_fit(w, width) && bf16_panels(w[kQkv], qkv_size, width) &&
          bf16_panels(w[kOut], width, attn_size) && gated_panels(w[kGateUp], inter, width) &&
          bf16_panels(w[kDown], width, inter) &&
          padded_bias(bias(kQkvBias), w[kQkv].size(0) * 16) &&
          padded_bias(bias(kOutBias), w[kOut].size(0) * 16) &&
          padded_bias(bias(kGateUpBias), gated_panel_count * 2 * 16) &&
          padded_bias(bias(kDownBias), w[kDown].size(0) * 16) &&
          qk_norm_fits(form.qk_norm, num_heads + kv_heads, dim)))
      return false;
  }
  return true;
#endif
}

at::Tensor decode_stack(const at::Tensor& hidden, at::TensorList weights,
                        const std::vector<c10::List<std::optional<at::Tensor>>>& biases,
                        at::IntArrayRef heads, at::TensorList keys, at::TensorList values,
                        const at::Tensor& slots, const at::Tensor& table, const at::Tensor& lens,
                        double eps, double scale, const std::vector<LayerForm>& forms) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  const int64_t M = hidden.size(0), width = hidden.size(1);
  const at::Tensor blocks = table.to(at::kLong).contiguous();
  const at::Tensor lengths = lens.to(at::kLong).contiguous();
  for (const LayerForm& form : forms)
    TORCH_CHECK(form.cos.size(0) == M,
                "rotary: x [tokens, heads, dim] and cos/sin [tokens, 1, dim] do not match");
  TORCH_CHECK(
      blocks.dim() == 2 && blocks.size(0) == M && lengths.dim() == 1 && lengths.size(0) == M,
      "paged_decode: one block table row and length per sequence");
  // Every layer's cache has one size: its blocks are checked once for all.
  check_decode_tables(blocks, lengths, keys[0].size(1), keys[0].size(0));
  at::Tensor out = at::empty({M, width}, hidden.options());
  if (M == 0) return out;

  Stack st;
  st.rows = M;
  st.width = width;
  st.heads = heads[0];
  st.kv_heads = heads[1];
  st.dim = heads[2];
  st.inter = weights[kDown].size(1) * 2;
  st.attn_size = st.heads * st.dim;
  st.qk_size = (st.heads + st.kv_heads) * st.dim;
  st.qkv_size = st.qk_size + st.kv_heads * st.dim;
  st.eps = static_cast<float>(eps);
  st.slots = slots.data_ptr<int64_t>();
  st.table = blocks.data_ptr<int64_t>();
  st.lens = lengths.data_ptr<int64_t>();
  st.table_width = blocks.size(1);
  st.scale = static_cast<float>(scale);
  const int threads = std::max(1, at::get_num_threads());
  std::vector<Layer> stack;
  for (int64_t i = 0; i < layers; ++i)
    stack.push_back(
        layer_of(weights.slice(i * kWeights, kWeights), biases[i], keys[i], values[i], forms[i]));
  const Layer& first = stack[0];
  st.qkv_tasks = bf16_product_tasks(M, width, first.qkv.count, false, threads);
  st.out_tasks = bf16_product_tasks(M, st.attn_size, first.out.count, false, threads);
  st.gated_tasks = bf16_product_tasks(M, width, first.gate_up.count, true, threads);
  st.down_tasks = bf16_product_tasks(M, st.inter, first.down.count, false, threads);
  st.normed = scratch<uint16_t>(M * width);
  st.attended16 = scratch<uint16_t>(M * st.attn_size);
  st.gated16 = scratch<uint16_t>(M * st.inter);
  st.qkv = scratch<float>(M * st.qkv_size);
  st.qk = scratch<float>(M * st.qk_size);
  st.attended = scratch<float>(M * st.attn_size);
  st.residual = scratch<float>(M * width);
  st.projected = scratch<float>(M * width);
  st.normed32 = scratch<float>(M * width);
  std::unique_ptr<std::atomic<int64_t>[]> taken(new std::atomic<int64_t>[layers * 5]);
  for (int64_t i = 0; i < layers * 5; ++i) taken[i] = 0;

  const float* in = hidden.data_ptr<float>();
  float* result = out.data_ptr<float>();
#pragma omp parallel num_threads(threads)
  {
    const Team team{omp_get_thread_num(), omp_get_num_threads()};
    // The first layer reads the step's rows; each after it the one before's, in `out`.
    for (int64_t i = 0; i < layers; ++i)
      run_layer(team, st, stack[i], i == 0 ? in : result, result, taken.get() + i * 5);
  }
  return out;
}

namespace {

// `stack_region_applies` as an op: each layer's form from its rotary rows, q/k norm, output
// norms (two a layer) and whether it gates with GELU.
bool region_applies_op(int64_t width, at::TensorList weights,
                       const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef heads,
                       at::TensorList cos, at::TensorList sin,
                       const c10::List<std::optional<at::Tensor>>& qk_norms,
                       const c10::List<std::optional<at::Tensor>>& out_norms,
                       const c10::List<bool>& gelu) {
  const size_t layers = weights.size() / kWeights;
  TORCH_CHECK(cos.size() == layers && sin.size() == layers && qk_norms.size() == layers &&
                  out_norms.size() == 2 * layers && gelu.size() == layers,
              "stack_region_applies: per layer rotary rows, a q/k norm or None, two output norms "
              "or None and whether it gates with GELU");
  std::vector<LayerForm> forms;
  for (size_t i = 0; i < layers; ++i)
    forms.push_back(LayerForm{cos[i], sin[i], 0, qk_norms.get(i), true, 0.0, out_norms.get(2 * i),
                              out_norms.get(2 * i + 1), gelu.get(i)});
  return stack_region_applies(width, weights, biases, heads, forms);
}

}  // namespace
}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "stack_region_applies(int width, Tensor[] weights, Tensor?[] biases, int[] heads, "
      "Tensor[] cos, Tensor[] sin, Tensor?[] qk_norms, Tensor?[] out_norms, bool[] gelu) -> bool");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("stack_region_applies", &conveyor::region_applies_op);
}
