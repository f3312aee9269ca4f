// A layer of experts over a step's rows in one op: each row's chosen experts' gated MLPs, their
// outputs weighed and summed (a mixture of experts' block after its router).
//
// x        [rows, hidden]     fp32, contiguous: the normed rows
// experts  [rows, k]          int64: each row's chosen experts
// weights  [rows, k]          fp32: their weights
// gate_up  one per expert     gated bf16 panels [ceil(inter / 16), 2, hidden / 2, 32]
//                               (`GatedPanelLinear`), or MXFP4 block panels [ceil(2 * inter /
//                               16), hidden / 32, 272] of gate then up (`mxfp4_bf16_linear`'s);
//                               with an optional padded bias each
// down     one per expert     bf16 panels [ceil(hidden / 16), inter / 2, 32], or MXFP4 block
//                               panels [ceil(hidden / 16), inter / 32, 272] beside MXFP4
//                               gate/up panels; bias likewise
// gelu, clamped               the activation: silu(gate) * up unless one of them names another
//                               (`gate_activation` in ops.h)
//
// It computes what `ExpertLinears`' loop over the experts computes, to the bit: the rows taken
// in expert order (a stable sort of the flat choices), each expert that some row chose over its
// own run of them (the gated product writing bf16 rows for the down product, or the MXFP4
// gate/up product writing fp32 rows that the activation then turns into the down product's bf16
// rows, as `clamped_swiglu_mul` and the rounding of the down product's input would; then the
// down product, each with as many rows as that expert has), and each row's outputs times their
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

#include "bf16_panel_shapes.h"
#include "block_panels.h"
#include "block_rows.h"
#include "bf16_round.h"
#include "ops.h"
#include "pass_split.h"
#include "scratch.h"
#include "thread_team.h"

namespace conveyor {
namespace {

// One expert that some row chose: its panels and biases, and its run [first, first + rows) of
// the rows in expert order.
struct Chosen {
  const void *gate_up, *down;
  const float *gate_up_bias, *down_bias;
  int64_t gate_up_count, down_count;
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

// Whether the experts' panels are MXFP4 blocks (else gated bf16 panels over bf16 ones), by the
// first chosen expert's; each expert's are then checked for that form.
bool mxfp4_panels(const at::Tensor& gate_up) { return gate_up.scalar_type() == at::kByte; }

bool mxfp4_shaped(const at::Tensor& panels, int64_t out, int64_t in) {
  return panels.dim() == 3 && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
         panels.size(0) == (out + kPanel - 1) / kPanel && panels.size(1) * kBlock == in &&
         panels.size(2) == MXFP4::kGroupBytes;
}

void check_panels(const at::Tensor& gate_up, const at::Tensor& down, int64_t hidden, int64_t inter,
                  bool mxfp4) {
  if (mxfp4) {
    TORCH_CHECK(mxfp4_shaped(gate_up, 2 * inter, hidden) && mxfp4_shaped(down, hidden, inter),
                "expert_mlps: MXFP4 panels must be contiguous uint8 [ceil(out / 16), in / 32, ",
                MXFP4::kGroupBytes, "], gate/up's out 2 * inter, down's hidden");
    return;
  }
  TORCH_CHECK(gated_panels(gate_up, inter, hidden),
              "expert_mlps: gate/up panels must be contiguous bf16 [ceil(inter / 16), 2, hidden / "
              "2, 32]");
  TORCH_CHECK(bf16_panels(down, hidden, inter),
              "expert_mlps: down panels must be contiguous bf16 [ceil(hidden / 16), inter / 2, "
              "32]");
}

// One chosen expert: its panels, biases and tasks for its run of rows.
Chosen chosen_expert(const at::Tensor& gate_up, const std::optional<at::Tensor>& gate_up_bias,
                     const at::Tensor& down, const std::optional<at::Tensor>& down_bias,
                     int64_t hidden, int64_t inter, bool mxfp4, int64_t first, int64_t rows,
                     int threads) {
  check_panels(gate_up, down, hidden, inter, mxfp4);
  const int64_t down_count = down.size(0);
  const float* down_b = bias_of(down_bias, down_count * kPanel);
  if (mxfp4) {
    const int64_t count = gate_up.size(0);
    return {gate_up.data_ptr<uint8_t>(),
            down.data_ptr<uint8_t>(),
            bias_of(gate_up_bias, count * kPanel),
            down_b,
            count,
            down_count,
            first,
            rows,
            block_product_tasks(rows, count, threads),
            block_product_tasks(rows, down_count, threads)};
  }
  const int64_t pairs = gate_up.size(0);
  return {panel_bits(gate_up),
          panel_bits(down),
          bias_of(gate_up_bias, pairs * 2 * kPanel),
          down_b,
          2 * pairs,
          down_count,
          first,
          rows,
          bf16_product_tasks(rows, hidden, 2 * pairs, true, threads),
          bf16_product_tasks(rows, inter, down_count, false, threads)};
}

// The activation of rows [begin, end) of gate_up [rows, 2 * inter] (fp32, each row's gate then
// its up; overwritten) rounded to bf16 at out [rows, inter]: the fp32 values `gate_rows` gives,
// rounded as the down product rounds its input rows.
void activate_rows(const GateActivation& act, float* gate_up, int64_t inter, uint16_t* out,
                   int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    float* row = gate_up + j * 2 * inter;
    gate_rows(act, row, row, inter, 0, 1);
    round_to_bf16(row, inter, out + j * inter);
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

}  // namespace

at::Tensor expert_mlps(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       at::TensorList gate_up,
                       const c10::List<std::optional<at::Tensor>>& gate_up_bias,
                       at::TensorList down, const c10::List<std::optional<at::Tensor>>& down_bias,
                       int64_t inter, bool gelu,
                       const c10::optional<c10::ArrayRef<double>>& clamped) {
#ifndef CONVEYOR_BF16_ROUND
  TORCH_CHECK(false, "expert_mlps needs AVX-512 BF16");
#else
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "expert_mlps: x must be contiguous fp32 [rows, hidden]");
  const int64_t M = x.size(0), hidden = x.size(1);
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == M && experts.scalar_type() == at::kLong &&
                  experts.is_contiguous(),
              "expert_mlps: experts must be contiguous int64 [rows, k]");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "expert_mlps: weights must be contiguous fp32 [rows, k]");
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(num_experts > 0 && down.size() == gate_up.size() &&
                  gate_up_bias.size() == gate_up.size() && down_bias.size() == gate_up.size(),
              "expert_mlps: one gate/up, down and bias (or None) of each per expert");
  TORCH_CHECK(inter > 0 && hidden > 0 && hidden % 2 == 0 && inter % 2 == 0,
              "expert_mlps: hidden and inter must be even");
  const GateActivation act = gate_activation(gelu, clamped, "expert_mlps");
  const int64_t k = experts.size(1), choices = M * k;
  at::Tensor out = at::empty({M, hidden}, x.options());
  if (M == 0) return out;

  const Grouping g = group_by_expert(experts.data_ptr<int64_t>(), choices, num_experts);
  const int threads = std::max(1, at::get_num_threads());
  std::vector<Chosen> chosen;
  bool mxfp4 = false;
  for (int64_t e = 0, first = 0; e < num_experts; first += g.counts[e], ++e) {
    if (g.counts[e] == 0) continue;
    if (chosen.empty()) mxfp4 = mxfp4_panels(gate_up[e]);
    chosen.push_back(chosen_expert(gate_up[e], gate_up_bias.get(e), down[e], down_bias.get(e),
                                   hidden, inter, mxfp4, first, g.counts[e], threads));
  }
  const int64_t active = static_cast<int64_t>(chosen.size());
  std::unique_ptr<std::atomic<int64_t>[]> taken(new std::atomic<int64_t>[2 * active]);
  for (int64_t i = 0; i < 2 * active; ++i) taken[i] = 0;
  const auto rows16 = scratch<uint16_t>(choices * hidden);
  const auto gated16 = scratch<uint16_t>(choices * inter);
  // MXFP4 gate/up products' fp32 rows, before the activation.
  const auto gate_up32 = scratch<float>(mxfp4 ? choices * 2 * inter : 0);
  const auto outputs = scratch<float>(choices * hidden);
  const float* in = x.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* result = out.data_ptr<float>();

#pragma omp parallel num_threads(threads)
  {
    const Team team{omp_get_thread_num(), omp_get_num_threads()};
    // The rows in expert order, rounded to bf16 as the gated product rounds its input rows.
    Share part = share(team, choices, rows_per_task(hidden));
    for (int64_t j = part.begin; j < part.end; ++j)
      round_to_bf16(in + g.order[j] / k * hidden, hidden, rows16.get() + j * hidden);
    barrier();
    if (mxfp4) {
      for (int64_t i = 0; i < active; ++i) {
        const Chosen& c = chosen[i];
        mxfp4_take_tasks(rows16.get() + c.first * hidden, c.gate_up_bias,
                         gate_up32.get() + c.first * 2 * inter, c.rows, hidden, 2 * inter,
                         static_cast<const uint8_t*>(c.gate_up), c.gate_up_tasks, taken[2 * i]);
      }
      barrier();
      part = share(team, choices, rows_per_task(2 * inter));
      activate_rows(act, gate_up32.get(), inter, gated16.get(), part.begin, part.end);
    } else {
      for (int64_t i = 0; i < active; ++i) {
        const Chosen& c = chosen[i];
        Bf16Product pb{rows16.get() + c.first * hidden, c.gate_up_bias, nullptr, nullptr,
                       gated16.get() + c.first * inter, c.rows,         hidden,  inter};
        pb.act = act;
        bf16_take_tasks(pb, static_cast<const uint16_t*>(c.gate_up), c.gate_up_count, true,
                        c.gate_up_tasks, taken[2 * i]);
      }
    }
    barrier();
    for (int64_t i = 0; i < active; ++i) {
      const Chosen& c = chosen[i];
      const uint16_t* rows = gated16.get() + c.first * inter;
      float* outs = outputs.get() + c.first * hidden;
      if (mxfp4) {
        mxfp4_take_tasks(rows, c.down_bias, outs, c.rows, inter, hidden,
                         static_cast<const uint8_t*>(c.down), c.down_tasks, taken[2 * i + 1]);
        continue;
      }
      const Bf16Product pb{rows, c.down_bias, nullptr, outs, nullptr, c.rows, inter, hidden};
      bf16_take_tasks(pb, static_cast<const uint16_t*>(c.down), c.down_count, false, c.down_tasks,
                      taken[2 * i + 1]);
    }
    barrier();
    part = share(team, M, rows_per_task(hidden * k));
    sum_rows(outputs.get(), w, g, k, hidden, result, part.begin, part.end);
  }
  return out;
#endif
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "expert_mlps(Tensor x, Tensor experts, Tensor weights, Tensor[] gate_up, Tensor?[] "
      "gate_up_bias, Tensor[] down, Tensor?[] down_bias, int inter, bool gelu=False, float[]? "
      "clamped=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("expert_mlps", &conveyor::expert_mlps); }
