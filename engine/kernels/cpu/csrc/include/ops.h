// The CPU kernels' entry points, callable from one another's C++ without the dispatcher: a
// fused decode layer (`decode_layer.cpp`) runs them back to back in one op. Each is also
// registered as `torch.ops.conveyor.<name>` by its own source file.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "gate_activation.h"
#include "layer_args.h"
#include "thread_team.h"

namespace conveyor {

at::Tensor paged_decode(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor table,
                        at::Tensor lens, double scale, int64_t window = 0, double softcap = 0.0,
                        const std::optional<at::Tensor>& sinks = std::nullopt);
// x W^T + bias (+ residual, where given).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features,
                        const c10::optional<at::Tensor>& residual = c10::nullopt);
// panel_linear's product over int8 panels (Q4_1 or Q8_0 blocks times activations rounded to
// 8-bit blocks), its inputs already checked: out [M, out_features] from x [M, K] and a padded bias.
void int8_panel_product(const float* x, int64_t M, int64_t K, const at::Tensor& panels,
                        const float* bias, float* out, int64_t out_features);
// panel_linear's product over bf16 panels (AVX-512 BF16 dot products over x rounded to bf16),
// plus a residual [M, out_features] where not null, its inputs already checked.
void bf16_panel_product(const float* x, int64_t M, int64_t K, const at::Tensor& panels,
                        const float* bias, const float* residual, float* out, int64_t out_features);
// The same over rows already rounded to bf16 (`x` [M, K] bf16 bit patterns).
void bf16_rows_product(const uint16_t* x, int64_t M, int64_t K, const at::Tensor& panels,
                       const float* bias, const float* residual, float* out, int64_t out_features);
// One product over bf16 panels as its threads see it: bf16 rows x [M, K] times the panels, plus
// bias (padded to whole panels) and residual [M, N] where not null, to fp32 rows at out or, where
// out16 is not null, to those rows rounded to bf16.
struct RowBest;
struct Bf16Product {
  const uint16_t* x;
  const float* bias;
  const float* residual;
  float* out;
  uint16_t* out16;
  int64_t M, K, N;
  // A greedy choice instead of an output (`panel_argmax`): this thread's best of each row.
  RowBest* best = nullptr;
  // What gate/up pairs' sums become (silu(gate) * up unless said otherwise).
  GateActivation act{};
};
// A share of a product: rows [m0, m1) times panels [p0, p1).
struct ProductTask {
  int64_t m0, m1, p0, p1;
};
// Whether the bf16 products can run in AMX tiles here (compiled for them, and granted), and the
// switch between tiles and `vdpbf16ps` (on by default; returns what it was).
bool bf16_tiles_available();
bool set_bf16_tiles(bool on);
// A product's tasks for a team of `threads`, over `count` panels (gated: gate/up pairs).
std::vector<ProductTask> bf16_product_tasks(int64_t M, int64_t K, int64_t count, bool gated,
                                            int threads);
// This thread's part of the product, every thread of the region calling it: each takes the
// next task as it frees up, `next` counting the tasks taken (zero before the first call).
void bf16_take_tasks(const Bf16Product& pb, const uint16_t* panels, int64_t count, bool gated,
                     const std::vector<ProductTask>& tasks, std::atomic<int64_t>& next);
// A product's tasks over `count` panels for a team of `threads`, for the products that take
// every row over a run of panels (`panel_take_tasks`, `mxfp4_take_tasks`): about two runs a
// thread, each a whole number of four panels (what a pass of a few rows takes at once).
inline std::vector<ProductTask> panel_runs(int64_t M, int64_t count, int threads) {
  const int64_t run = std::max<int64_t>(4, ((count + 2 * threads - 1) / (2 * threads) + 3) / 4 * 4);
  std::vector<ProductTask> tasks;
  for (int64_t p0 = 0; p0 < count; p0 += run)
    tasks.push_back({0, M, p0, std::min(count, p0 + run)});
  return tasks;
}
// This thread's part of a product split into `tasks` (`panel_runs`), every thread of the region
// calling it: each task's run of panels [p0, p1) through run(p0, p1) as this thread takes it,
// `next` counting the tasks taken (zero before the first call). A column's sums do not depend on
// the panels it was taken with.
template <typename Run>
void take_runs(const std::vector<ProductTask>& tasks, std::atomic<int64_t>& next, Run&& run) {
  const int64_t total = static_cast<int64_t>(tasks.size());
  for (int64_t t = next++; t < total; t = next++) run(tasks[t].p0, tasks[t].p1);
}
// Whether `panels` are `panel_linear`'s over fp32 rows for out x in weights: contiguous fp32 or
// fp16 panels [ceil(out / 16), in, 16], or uint8 block panels [ceil(out / 16), in / 32, group].
bool fp32_row_panels(const at::Tensor& panels, int64_t out, int64_t in);
// This thread's part of `panel_linear`'s product over such panels split into `tasks`
// (`panel_runs`), every thread of the region calling it: fp32 rows x [M, K] times the panels,
// plus bias (padded to whole panels) where not null, to out [M, N]. Each output equals
// `panel_linear`'s to the bit.
void panel_take_tasks(const float* x, const float* bias, float* out, int64_t M, int64_t K,
                      int64_t N, const at::Tensor& panels, const std::vector<ProductTask>& tasks,
                      std::atomic<int64_t>& next);
// This thread's part of a product over MXFP4 block panels (`mxfp4_bf16.cpp`) split into `tasks`
// (`panel_runs`), every thread of the region calling it: bf16 rows x [M, K] times the
// panels, plus bias (padded to whole panels) where not null, to fp32 rows out [M, N].
void mxfp4_take_tasks(const uint16_t* x, const float* bias, float* out, int64_t M, int64_t K,
                      int64_t N, const uint8_t* panels, const std::vector<ProductTask>& tasks,
                      std::atomic<int64_t>& next);
// One bf16 row's sum of each of its blocks of 32 values, in fp32 (sums [K / 32]): what the
// block products over formats with a minimum add it times.
void block_row_sums(const uint16_t* row, int64_t K, float* sums);
// This thread's part of a product over block panels (`block_group`'s formats) split into
// `tasks` (`panel_runs`), every thread of the region calling it: bf16 rows x [M, K] with their
// block sums (`sums` [M, K / 32]) times the panels, plus bias (padded) where not null, to fp32
// rows out [M, N]; each output equals `block_bf16_linear`'s (`mxfp4_bf16_linear`'s) to the bit.
void bf16_block_take_tasks(const uint16_t* x, const float* sums, const float* bias, float* out,
                           int64_t M, int64_t K, int64_t N, const at::Tensor& panels,
                           const std::vector<ProductTask>& tasks, std::atomic<int64_t>& next);
// Each row's argmax of x W^T + bias over bf16 panels (`bf16_panels.cpp`), int64 [rows], as
// `torch.argmax` picks it from panel_linear's output, without writing that output.
at::Tensor panel_argmax(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t out_features);
// The activation that an op's `gelu` and `clamped` ([alpha, limit]: gpt-oss's clamped SwiGLU)
// arguments name; `op` names the op in the error.
inline GateActivation gate_activation(bool gelu,
                                      const c10::optional<c10::ArrayRef<double>>& clamped,
                                      const char* op) {
  if (!clamped.has_value()) return GateActivation::silu_or_gelu(gelu);
  TORCH_CHECK(!gelu && clamped->size() == 2 && (*clamped)[1] > 0, op,
              ": clamped is [alpha, limit] with a positive limit, and not with gelu");
  return GateActivation::clamped((*clamped)[0], (*clamped)[1]);
}
// act(x Wg^T + bg, x Wu^T + bu) over gated bf16 panels (`bf16_panels.cpp`), silu(gate) * up
// unless `act` says otherwise: fp32, or with `bf16_out` rounded to bf16 as a bf16 product rounds
// its input rows.
at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t inter, bool bf16_out = false,
                        const GateActivation& act = {});
at::Tensor gated_linear_op(const at::Tensor& x, const at::Tensor& panels,
                           const c10::optional<at::Tensor>& bias, int64_t inter, bool bf16_out,
                           bool gelu, const c10::optional<c10::ArrayRef<double>>& clamped);
// The input features of panels as `panel_linear` takes them (fp32, fp16, bf16 pairs or GGUF
// blocks).
int64_t panel_in_features(const at::Tensor& panels);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    bool bf16_out = false);
// rms_norm's rows [begin, end) of x [rows, dim]: to out32, or rounded to bf16 at out16 where
// out32 is null (AVX-512 BF16).
void rms_norm_rows(const float* x, const float* weight, float* out32, uint16_t* out16, int64_t dim,
                   float eps, int64_t begin, int64_t end);
// Each head of x [tokens, heads, dim] (rows at any stride, heads and dims contiguous) normed as
// one rms_norm row by its own row of weight [heads, dim]; contiguous fp32.
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// head_rms_norm's rows [begin, end): x rows at x_stride, out rows at out_stride (out may be x).
void rms_norm_heads(const float* x, int64_t x_stride, const float* weight, float* out,
                    int64_t out_stride, int64_t heads, int64_t dim, float eps, int64_t begin,
                    int64_t end);
// q's heads of x [tokens, q heads + kv heads, dim] (rows at any stride, heads and dims contiguous)
// normed as one rms_norm row by the first q_heads * dim values of weight [(q heads + kv heads) *
// dim], k's heads as another by the rest (OLMo 2's q/k norms over all heads); contiguous fp32.
at::Tensor all_heads_rms_norm(const at::Tensor& x, const at::Tensor& weight, int64_t q_heads,
                              double eps);
// all_heads_rms_norm's rows [begin, end): q's q_size values then k's k_size values a row.
void rms_norm_q_and_k(const float* x, int64_t x_stride, const float* weight, float* out,
                      int64_t out_stride, int64_t q_size, int64_t k_size, float eps, int64_t begin,
                      int64_t end);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  bool pairs = false);
// rotary's tokens [begin, end): x rows at x_stride, cos/sin rows at cs_stride, out contiguous;
// each head's first rotary_dim dims turn (the cos/sin rows' width), their halves or, with
// `pairs`, their neighbouring pairs; the rest are copied.
void rotary_rows(const float* x, int64_t x_stride, const float* cos, const float* sin,
                 int64_t cs_stride, float* out, int64_t heads, int64_t dim, int64_t rotary_dim,
                 int64_t begin, int64_t end, bool pairs = false);
// paged_decode under an fp32 query, as one thread of `team` takes part (every thread of the
// region calling it); `next` counts the sequences taken (zero before the first call). The
// table [seqs, width] and lens must already be checked against the cache.
struct DecodeRows {
  const float* query;
  int64_t query_stride, seqs, heads;
  const int64_t* table;
  int64_t width;
  const int64_t* lens;
  float scale;
  float* out;                    // [seqs, heads, dim]
  int64_t window = 0;            // a sliding window (0: none), as paged_decode takes it
  float softcap = 0.f;           // scores capped as paged_decode caps them (0: not)
  const float* sinks = nullptr;  // [heads] logits joining each head's softmax, or none
};
void paged_decode_team(const DecodeRows& rows, const at::Tensor& key, const at::Tensor& value,
                       const Team& team, std::atomic<int64_t>& next);
// Every block each sequence reads lies in a cache of num_blocks (table [seqs, width] int64).
void check_decode_tables(const at::Tensor& table, const at::Tensor& lens, int64_t block_size,
                         int64_t num_blocks);
at::Tensor silu_mul(const at::Tensor& x);
// gelu(gate) * up under tanh's approximation, as `silu_mul` takes its rows (`silu_mul.cpp`).
at::Tensor gelu_tanh_mul(const at::Tensor& x);
// gpt-oss's clamped SwiGLU, as `silu_mul` takes its rows (`silu_mul.cpp`).
at::Tensor clamped_swiglu_mul(const at::Tensor& x, double alpha, double limit);
// One layer's cache as the ops store into it and read it: contiguous K and V of one shape
// [blocks, block_size, kv_heads, dim] and dtype (fp32, bf16, fp16 or fp8 e5m2); and one int64
// slot per row inside it (`kv_store.cpp`). `op` names the caller in the error.
void check_cache(const at::Tensor& key, const at::Tensor& value, const char* op);
void check_slots(const at::Tensor& slots, int64_t rows, const at::Tensor& key, const char* op);
// Rows [begin, end)'s new K and V (`row_size` floats each at key_rows / value_rows plus the row
// times its stride) to their slots of one layer's cache (`kv_store.cpp`), rounded to a 16-
// or 8-bit cache's dtype as torch rounds.
void store_kv(const float* key_rows, int64_t key_stride, const float* value_rows,
              int64_t value_stride, const int64_t* slots, int64_t begin, int64_t end,
              int64_t row_size, at::Tensor& key, at::Tensor& value);

// The decode stack in one parallel region (`decode_stack.cpp`): whether it computes these layers
// (every projection over bf16 panels, gate/up as gated pairs, output norms fp32 where a layer
// has them), and the stack computed so, its inputs already checked as `decode_layers` checks
// them.
bool stack_region_applies(int64_t width, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef heads,
                          const std::vector<LayerForm>& forms);
at::Tensor decode_stack(const at::Tensor& hidden, at::TensorList weights,
                        const std::vector<c10::List<std::optional<at::Tensor>>>& biases,
                        at::IntArrayRef heads, at::TensorList keys, at::TensorList values,
                        const at::Tensor& slots, const at::Tensor& table, const at::Tensor& lens,
                        double eps, double scale, const std::vector<LayerForm>& forms);

}  // namespace conveyor
