// A layer of experts over a step's rows in one op: each row's chosen experts' gated MLPs, their
// outputs weighed and summed (a mixture of experts' block after its router).
//
// x        [rows, hidden]     fp32, contiguous: the normed rows
// experts  [rows, k]          int64: each row's chosen experts
// weights  [rows, k]          fp32: their weights
// gate_up  one per expert     gated bf16 panels [ceil(inter / 16), 2, hidden / 2, 32]
//                               (`GatedPanelLinear`), with an optional padded bias each
// down     one per expert     bf16 panels [ceil(hidden / 16), inter / 2, 32], bias likewise
//
// It computes what `ExpertLinears`' loop over the experts computes, to the bit: the rows taken
// in expert order (a stable sort of the flat choices), each expert that some row chose over its
// own run of them (the gated product writing bf16 rows for the down product, then the down
// product, each with as many rows as that expert has), and each row's outputs times their
// weights added in that order to zero in fp32 (as `index_add_` adds them). Op by op, a layer of
// experts was a sort, a count, a gather and three ops an expert, each product forking and
// joining the threads: at one decode row of a small model each product's fork and join cost
// about what its weights did. Here the threads stay in one parallel region: each expert's
// products are shared as one product's tasks are, a thread that finishes its share of one
// expert going on to the next, with a barrier only between the gated products, the down
// products and the sums.
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
  const uint16_t *gate_up, *down;
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

void check_panels(const at::Tensor& gate_up, const at::Tensor& down, int64_t hidden,
                  int64_t inter) {
  TORCH_CHECK(gated_panels(gate_up, inter, hidden),
              "expert_mlps: gate/up panels must be contiguous bf16 [ceil(inter / 16), 2, hidden / "
              "2, 32]");
  TORCH_CHECK(bf16_panels(down, hidden, inter),
              "expert_mlps: down panels must be contiguous bf16 [ceil(hidden / 16), inter / 2, "
              "32]");
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
                       int64_t inter, bool gelu) {
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
  const int64_t k = experts.size(1), choices = M * k;
  at::Tensor out = at::empty({M, hidden}, x.options());
  if (M == 0) return out;

  const Grouping g = group_by_expert(experts.data_ptr<int64_t>(), choices, num_experts);
  const int threads = std::max(1, at::get_num_threads());
  std::vector<Chosen> chosen;
  for (int64_t e = 0, first = 0; e < num_experts; first += g.counts[e], ++e) {
    if (g.counts[e] == 0) continue;
    check_panels(gate_up[e], down[e], hidden, inter);
    const int64_t rows = g.counts[e];
    const int64_t pairs = gate_up[e].size(0), down_count = down[e].size(0);
    chosen.push_back({panel_bits(gate_up[e]), panel_bits(down[e]),
                      bias_of(gate_up_bias.get(e), pairs * 2 * 16),
                      bias_of(down_bias.get(e), down_count * 16), 2 * pairs, down_count, first,
                      rows, bf16_product_tasks(rows, hidden, 2 * pairs, true, threads),
                      bf16_product_tasks(rows, inter, down_count, false, threads)});
  }
  const int64_t active = static_cast<int64_t>(chosen.size());
  std::unique_ptr<std::atomic<int64_t>[]> taken(new std::atomic<int64_t>[2 * active]);
  for (int64_t i = 0; i < 2 * active; ++i) taken[i] = 0;
  const auto rows16 = scratch<uint16_t>(choices * hidden);
  const auto gated16 = scratch<uint16_t>(choices * inter);
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
    for (int64_t i = 0; i < active; ++i) {
      const Chosen& c = chosen[i];
      Bf16Product pb{rows16.get() + c.first * hidden, c.gate_up_bias, nullptr, nullptr,
                     gated16.get() + c.first * inter, c.rows,         hidden,  inter};
      pb.gelu = gelu;
      bf16_take_tasks(pb, c.gate_up, c.gate_up_count, true, c.gate_up_tasks, taken[2 * i]);
    }
    barrier();
    for (int64_t i = 0; i < active; ++i) {
      const Chosen& c = chosen[i];
      const Bf16Product pb{gated16.get() + c.first * inter,
                           c.down_bias,
                           nullptr,
                           outputs.get() + c.first * hidden,
                           nullptr,
                           c.rows,
                           inter,
                           hidden};
      bf16_take_tasks(pb, c.down, c.down_count, false, c.down_tasks, taken[2 * i + 1]);
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
      "gate_up_bias, Tensor[] down, Tensor?[] down_bias, int inter, bool gelu=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) { m.impl("expert_mlps", &conveyor::expert_mlps); }
