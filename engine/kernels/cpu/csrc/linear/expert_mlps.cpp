// A layer of experts over a step's rows in one op: each row's chosen experts' gated MLPs, their
// outputs weighed and summed (a mixture of experts' block after its router).
//
// x        [rows, hidden]     fp32, contiguous: the normed rows
// experts  [rows, k]          int64: each row's chosen experts
// weights  [rows, k]          fp32: their weights
// gate_up  one per expert     gated bf16 panels [ceil(inter / 16), 2, hidden / 2, 32]
//                               (`GatedPanelLinear`); or gate then up in one layer's panels:
//                               block panels multiplied in bf16 (`block_bf16_linear`'s,
//                               `mxfp4_bf16_linear`'s), or with `fp32_rows` `panel_linear`'s
//                               fp32, fp16 or block panels over fp32 rows; with an optional
//                               padded bias each
// down     one per expert     bf16 panels [ceil(hidden / 16), inter / 2, 32] beside gated ones,
//                               else panels of the gate/up's kind; bias likewise
// gelu, clamped               the activation: silu(gate) * up unless one of them names another
//                               (`gate_activation` in ops.h)
//
// It computes what `ExpertLinears`' loop over the experts computes, to the bit: the rows taken
// in expert order (a stable sort of the flat choices), each expert that some row chose over its
// own run of them (the gated product writing bf16 rows for the down product; or the gate/up
// product writing fp32 rows that the activation then turns into the down product's input, as
// `silu_mul` or `clamped_swiglu_mul` would, rounded to bf16 for bf16 blocks as that product
// rounds its input; then the down product, each with as many rows as that expert has), and
// each row's outputs times their
// weights added in that order to zero in fp32 (as `index_add_` adds them). Op by op, a layer of
// experts was a sort, a count, a gather and three ops an expert, each product forking and
// joining the threads: at one decode row of a small model each product's fork and join cost
// about what its weights did. Here the threads stay in one parallel region: each expert's
// products are shared as one product's tasks are, a thread that finishes its share of one
// expert going on to the next, with a barrier only between the products' stages and the sums.
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
#include "block_panels.h"
#include "ops.h"
#include "panel_passes.h"
#include "pass_split.h"
#include "scratch.h"
#include "thread_team.h"

namespace conveyor {
namespace {

// How the experts' products run, by their panels (checked expert by expert): gated bf16 panel
// pairs over bf16 down panels, block panels over rows rounded to bf16 (each expert's own
// formats), or `panel_linear`'s panels over fp32 rows.
enum class Form { kGatedBf16, kBf16Blocks, kFp32Rows };

// One expert that some row chose: its panels and biases, and its run [first, first + rows) of
// the rows in expert order.
struct Chosen {
  const at::Tensor *gate_up, *down;
  const float *gate_up_bias, *down_bias;
  int64_t first, rows;
  std::vector<ProductTask> gate_up_tasks, down_tasks;
};

// The step's choices in expert order: `order[j]` the flat choice (row * k + slot) at place j, a
// stable sort by expert; `place[i]` the place of flat choice i.
struct Grouping {
  std::vector<int64_t> order, place, counts;
};

Grouping group_by_expert(const int64_t* experts, int64_t choices, int64_t num_experts) {
  Grouping g{std::vector<int64_t>(choices), std::vector<int64_t>(choices),
             std::vector<int64_t>(num_experts, 0)};
  for (int64_t i = 0; i < choices; ++i) {
    TORCH_CHECK(experts[i] >= 0 && experts[i] < num_experts, "expert_mlps: expert ", experts[i],
                " chosen of ", num_experts);
    ++g.counts[experts[i]];
  }
  std::vector<int64_t> next(num_experts, 0);
  for (int64_t e = 1; e < num_experts; ++e) next[e] = next[e - 1] + g.counts[e - 1];
  for (int64_t i = 0; i < choices; ++i) {
    const int64_t j = next[experts[i]]++;
    g.order[j] = i;
    g.place[i] = j;
  }
  return g;
}

const float* bias_of(const std::optional<at::Tensor>& bias, int64_t values) {
  TORCH_CHECK(padded_bias(bias, values), "expert_mlps: a bias must be fp32 [", values,
              "], zero-padded as the panels hold it");
  return optional_floats(bias);
}

// The form the first chosen expert's gate/up panels name.
Form form_of(const at::Tensor& gate_up, bool fp32_rows) {
  if (fp32_rows) return Form::kFp32Rows;
  return gate_up.scalar_type() == at::kByte ? Form::kBf16Blocks : Form::kGatedBf16;
}

// Whether this build runs the form's products.
bool built_for(Form form) {
  if (form == Form::kFp32Rows) {
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    return true;
#endif
    return false;
  }
#ifdef CONVEYOR_BF16_ROUND
  return true;
#endif
  return false;
}

void check_panels(const at::Tensor& gate_up, const at::Tensor& down, int64_t hidden, int64_t inter,
                  Form form) {
  switch (form) {
    case Form::kFp32Rows:
      TORCH_CHECK(
          fp32_row_panels(gate_up, 2 * inter, hidden) && fp32_row_panels(down, hidden, inter),
          "expert_mlps: with fp32_rows, panels must be panel_linear's contiguous fp32, "
          "fp16 or uint8 block panels, gate/up's out 2 * inter, down's hidden");
      return;
    case Form::kBf16Blocks:
      TORCH_CHECK(
          block_panels_fit(gate_up, 2 * inter, hidden) && block_panels_fit(down, hidden, inter),
          "expert_mlps: block panels must be contiguous uint8 [ceil(out / 16), in / 32, group] "
          "of a format multiplied in bf16 (Q4_1, Q8_0, Q4_K, Q6_K, Q8_K, MXFP4), gate/up's out "
          "2 * inter, down's hidden");
      return;
    case Form::kGatedBf16:
      TORCH_CHECK(gated_panels(gate_up, inter, hidden),
                  "expert_mlps: gate/up panels must be contiguous bf16 [ceil(inter / 16), 2, "
                  "hidden / 2, 32]");
      TORCH_CHECK(bf16_panels(down, hidden, inter),
                  "expert_mlps: down panels must be contiguous bf16 [ceil(hidden / 16), inter / "
                  "2, 32]");
  }
}

// One chosen expert: its panels, biases and tasks for its run of rows.
Chosen chosen_expert(const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_bias,
                     const at::Tensor& down, const std::optional<at::Tensor>& down_bias,
                     int64_t hidden, int64_t inter, Form form, int64_t first, int64_t rows,
                     int threads) {
  check_panels(gate_up, down, hidden, inter, form);
  const int64_t count = form == Form::kGatedBf16 ? 2 * gate_up.size(0) : gate_up.size(0);
  const int64_t down_count = down.size(0);
  Chosen c{&gate_up,
           &down,
           bias_of(gate_up_bias, count * kPanel),
           bias_of(down_bias, down_count * kPanel),
           first,
           rows};
  if (form == Form::kGatedBf16) {
    c.gate_up_tasks = bf16_product_tasks(rows, hidden, count, true, threads);
    c.down_tasks = bf16_product_tasks(rows, inter, down_count, false, threads);
  } else {
    c.gate_up_tasks = panel_runs(rows, count, threads);
    c.down_tasks = panel_runs(rows, down_count, threads);
  }
  return c;
}

// The step's rows and what the products hand on, in expert order: each choice's row (rounded
// to bf16, or in fp32), its gate/up's outputs before the activation (fp32, but for gated bf16
// panels), its activation (the down product's input: bf16, or fp32 over fp32 rows) and its
// output; for bf16 blocks, each bf16 row's block sums too.
struct Rows {
  Form form;
  Scratch<uint16_t> in16, gated16;
  Scratch<float> in32, gate_up32, gated32, outputs, in_sums, gated_sums;

  Rows(Form form, int64_t choices, int64_t hidden, int64_t inter)
      : form(form), in16(scratch<uint16_t>(form == Form::kFp32Rows ? 0 : choices * hidden)),
        gated16(scratch<uint16_t>(form == Form::kFp32Rows ? 0 : choices * inter)),
        in32(scratch<float>(form == Form::kFp32Rows ? choices * hidden : 0)),
        gate_up32(scratch<float>(form == Form::kGatedBf16 ? 0 : choices * 2 * inter)),
        gated32(scratch<float>(form == Form::kFp32Rows ? choices * inter : 0)),
        outputs(scratch<float>(choices * hidden)),
        in_sums(scratch<float>(form == Form::kBf16Blocks ? choices * (hidden / kBlock) : 0)),
        gated_sums(scratch<float>(form == Form::kBf16Blocks ? choices * (inter / kBlock) : 0)) {}
};

// The rows of places [begin, end) in expert order: each choice's row of x, rounded to bf16 as
// the bf16 products round their input rows, or copied.
void take_rows(const float* x, const Grouping& g, int64_t k, int64_t hidden, Rows& rows,
               int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    const float* row = x + g.order[j] / k * hidden;
    if (rows.form == Form::kFp32Rows) {
      std::copy(row, row + hidden, rows.in32.get() + j * hidden);
      continue;
    }
    round_to_bf16(row, hidden, rows.in16.get() + j * hidden);
    if (rows.form == Form::kBf16Blocks)
      block_row_sums(rows.in16.get() + j * hidden, hidden,
                     rows.in_sums.get() + j * (hidden / kBlock));
  }
}

// The activation of places [begin, end): the fp32 values `gate_rows` gives from each row's gate
// and up, rounded to bf16 where the down product takes bf16 rows (over the gate/up's rows, which
// are spent).
void activate_rows(const GateActivation& act, int64_t inter, Rows& rows, int64_t begin,
                   int64_t end) {
  if (rows.form == Form::kFp32Rows) {
    gate_rows(act, rows.gate_up32.get(), rows.gated32.get(), inter, begin, end);
    return;
  }
  for (int64_t j = begin; j < end; ++j) {
    float* row = rows.gate_up32.get() + j * 2 * inter;
    gate_rows(act, row, row, inter, 0, 1);
    round_to_bf16(row, inter, rows.gated16.get() + j * inter);
    block_row_sums(rows.gated16.get() + j * inter, inter,
                   rows.gated_sums.get() + j * (inter / kBlock));
  }
}

// This thread's part of every chosen expert's gate/up product, each taking its tasks in turn.
void gate_up_products(const std::vector<Chosen>& chosen, Form form, const GateActivation& act,
                      int64_t hidden, int64_t inter, Rows& rows, std::atomic<int64_t>* taken) {
  for (size_t i = 0; i < chosen.size(); ++i) {
    const Chosen& c = chosen[i];
    float* out = rows.gate_up32.get() + c.first * 2 * inter;
    switch (form) {
      case Form::kFp32Rows:
        panel_take_tasks(rows.in32.get() + c.first * hidden, c.gate_up_bias, out, c.rows, hidden,
                         2 * inter, *c.gate_up, c.gate_up_tasks, taken[i]);
        break;
      case Form::kBf16Blocks:
        bf16_block_take_tasks(rows.in16.get() + c.first * hidden,
                              rows.in_sums.get() + c.first * (hidden / kBlock), c.gate_up_bias, out,
                              c.rows, hidden, 2 * inter, *c.gate_up, c.gate_up_tasks, taken[i]);
        break;
      case Form::kGatedBf16: {
        Bf16Product pb{rows.in16.get() + c.first * hidden,   c.gate_up_bias, nullptr, nullptr,
                       rows.gated16.get() + c.first * inter, c.rows,         hidden,  inter};
        pb.act = act;
        bf16_take_tasks(pb, panel_bits(*c.gate_up), 2 * c.gate_up->size(0), true, c.gate_up_tasks,
                        taken[i]);
      }
    }
  }
}

// This thread's part of every chosen expert's down product.
void down_products(const std::vector<Chosen>& chosen, Form form, int64_t hidden, int64_t inter,
                   Rows& rows, std::atomic<int64_t>* taken) {
  for (size_t i = 0; i < chosen.size(); ++i) {
    const Chosen& c = chosen[i];
    float* out = rows.outputs.get() + c.first * hidden;
    if (form == Form::kFp32Rows) {
      panel_take_tasks(rows.gated32.get() + c.first * inter, c.down_bias, out, c.rows, inter,
                       hidden, *c.down, c.down_tasks, taken[i]);
      continue;
    }
    const uint16_t* in = rows.gated16.get() + c.first * inter;
    if (form == Form::kBf16Blocks) {
      bf16_block_take_tasks(in, rows.gated_sums.get() + c.first * (inter / kBlock), c.down_bias,
                            out, c.rows, inter, hidden, *c.down, c.down_tasks, taken[i]);
      continue;
    }
    const Bf16Product pb{in, c.down_bias, nullptr, out, nullptr, c.rows, inter, hidden};
    bf16_take_tasks(pb, panel_bits(*c.down), c.down->size(0), false, c.down_tasks, taken[i]);
  }
}

// Each row's weighted outputs summed, rows [begin, end): the row's choices in the order of
// their places, each output times its weight added to the sum so far (from zero), each product
// rounded before its add, as `index_add_` of the weighted outputs adds them.
__attribute__((optimize("fp-contract=off"))) void sum_rows(const float* outputs,
                                                           const float* weights, const Grouping& g,
                                                           int64_t k, int64_t hidden, float* out,
                                                           int64_t begin, int64_t end) {
  std::vector<int64_t> places(k);
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t s = 0; s < k; ++s) places[s] = g.place[r * k + s];
    std::sort(places.begin(), places.end());
    float* sum = out + r * hidden;
    std::fill(sum, sum + hidden, 0.f);
    for (const int64_t j : places) {
      const float w = weights[g.order[j]];
      const float* o = outputs + j * hidden;
      for (int64_t c = 0; c < hidden; ++c) sum[c] = sum[c] + o[c] * w;
    }
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                  at::TensorList gate_up, const c10::List<std::optional<at::Tensor>>& gate_up_bias,
                  at::TensorList down, const c10::List<std::optional<at::Tensor>>& down_bias,
                  int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "expert_mlps: x must be contiguous fp32 [rows, hidden]");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == x.size(0) &&
                  experts.scalar_type() == at::kLong && experts.is_contiguous(),
              "expert_mlps: experts must be contiguous int64 [rows, k]");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "expert_mlps: weights must be contiguous fp32 [rows, k]");
  TORCH_CHECK(!gate_up.empty() && down.size() == gate_up.size() &&
                  gate_up_bias.size() == gate_up.size() && down_bias.size() == gate_up.size(),
              "expert_mlps: one gate/up, down and bias (or None) of each per expert");
  TORCH_CHECK(inter > 0 && x.size(1) > 0 && x.size(1) % 2 == 0 && inter % 2 == 0,
              "expert_mlps: hidden and inter must be even");
}

}  // namespace

at::Tensor expert_mlps(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       at::TensorList gate_up,
                       const c10::List<std::optional<at::Tensor>>& gate_up_bias,
                       at::TensorList down, const c10::List<std::optional<at::Tensor>>& down_bias,
                       int64_t inter, bool gelu,
                       const c10::optional<c10::ArrayRef<double>>& clamped, bool fp32_rows) {
  check_inputs(x, experts, weights, gate_up, gate_up_bias, down, down_bias, inter);
  const GateActivation act = gate_activation(gelu, clamped, "expert_mlps");
  const int64_t M = x.size(0), hidden = x.size(1), num_experts = gate_up.size();
  const int64_t k = experts.size(1), choices = M * k;
  at::Tensor out = at::empty({M, hidden}, x.options());
  if (M == 0) return out;

  const Grouping g = group_by_expert(experts.data_ptr<int64_t>(), choices, num_experts);
  const int threads = std::max(1, at::get_num_threads());
  std::vector<Chosen> chosen;
  Form form = Form::kGatedBf16;
  for (int64_t e = 0, first = 0; e < num_experts; first += g.counts[e], ++e) {
    if (g.counts[e] == 0) continue;
    if (chosen.empty()) form = form_of(gate_up[e], fp32_rows);
    chosen.push_back(chosen_expert(gate_up[e], gate_up_bias.get(e), down[e], down_bias.get(e),
                                   hidden, inter, form, first, g.counts[e], threads));
  }
  TORCH_CHECK(built_for(form), "expert_mlps: ",
              form == Form::kFp32Rows ? "fp32 rows need AVX2, F16C and FMA"
                                      : "bf16 products need AVX-512 BF16");
  const int64_t active = static_cast<int64_t>(chosen.size());
  std::unique_ptr<std::atomic<int64_t>[]> taken(new std::atomic<int64_t>[2 * active]);
  for (int64_t i = 0; i < 2 * active; ++i) taken[i] = 0;
  Rows rows(form, choices, hidden, inter);
  const float* in = x.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* result = out.data_ptr<float>();

#pragma omp parallel num_threads(threads)
  {
    const Team team{omp_get_thread_num(), omp_get_num_threads()};
    Share part = share(team, choices, rows_per_task(hidden));
    take_rows(in, g, k, hidden, rows, part.begin, part.end);
    barrier();
    gate_up_products(chosen, form, act, hidden, inter, rows, taken.get());
    if (form != Form::kGatedBf16) {
      barrier();
      part = share(team, choices, rows_per_task(2 * inter));
      activate_rows(act, inter, rows, part.begin, part.end);
    }
    barrier();
    down_products(chosen, form, hidden, inter, rows, taken.get() + active);
    barrier();
    part = share(team, M, rows_per_task(hidden * k));
    sum_rows(rows.outputs.get(), w, g, k, hidden, result, part.begin, part.end);
  }
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "expert_mlps(Tensor x, Tensor experts, Tensor weights, Tensor[] gate_up, Tensor?[] "
      "gate_up_bias, Tensor[] down, Tensor?[] down_bias, int inter, bool gelu=False, float[]? "
      "clamped=None, bool fp32_rows=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("expert_mlps", &conveyor::expert_mlps); }
