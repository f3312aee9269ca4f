// One decode token of each row through the gated delta rule (Qwen3.5's linear attention), each
// row's recurrent state updated in place in the state cache.
//
// q, k     [rows, key heads, key dims]            fp32, contiguous (as projected: not normed)
// v        [rows, value heads, value dims]        fp32, contiguous
// g, beta  [rows, value heads]                    fp32, contiguous
// states   [slots, value heads, key dims, value dims] fp32, contiguous: row i's at slots[i]
// slots    [rows] int64
// sources  [rows] int64, optional: row i reads its state from sources[i] and writes it to
//          slots[i] (a request's rows verifying drafts, each from the state the row before it
//          left); the rows then run in order, so a source may be an earlier row's slot
// out      [rows, value heads, value dims]        fp32
//
// A value head reads key head `head / (value heads / key heads)`. With q and k l2-normed (q also
// scaled by the key dims' root), a = exp(g) and S the state:
//   d = beta (v - a S^T k),  out = a S^T q + (q . k) d,  S <- a S + k d^T
// the same arithmetic as transformers' recurrent reference, which decays S first and reads the
// new S with q. Torch runs it as a handful of ops a row, each reading the state again; here a
// (row, head) task reads its state once for both products and then updates it in the same rows
// while they are still in the core's cache, so a step moves each state through memory once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "state_rows.h"

namespace {

struct RuleArgs {
  const float *q, *k, *v, *g, *beta;
  float* states;
  const int64_t *slots, *sources;  // sources: null where each row reads its own slot
  float* out;
  int64_t heads, key_heads, key_dims, value_dims;
};

// 1 / sqrt(x . x + eps), as the rule's l2 norm.
float inverse_norm(const float* x, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return 1.f / std::sqrt(sum + 1e-6f);
}

// Row `row`'s head `head`; `qn`, `kn`, `known`, `read`, `written` scratch of the dims.
void rule_task(const RuleArgs& a, int64_t row, int64_t head, std::vector<float>& scratch) {
  const int64_t dk = a.key_dims, dv = a.value_dims;
  const int64_t key_head = head / (a.heads / a.key_heads);
  const float* q = a.q + (row * a.key_heads + key_head) * dk;
  const float* k = a.k + (row * a.key_heads + key_head) * dk;
  const float* v = a.v + (row * a.heads + head) * dv;
  const int64_t source = a.sources != nullptr ? a.sources[row] : a.slots[row];
  const float* state = a.states + (source * a.heads + head) * dk * dv;
  float* kept = a.states + (a.slots[row] * a.heads + head) * dk * dv;
  float* out = a.out + (row * a.heads + head) * dv;
  float* qn = scratch.data();
  float* kn = qn + dk;
  float* known = kn + dk;
  float* read = known + dv;
  const float q_scale = inverse_norm(q, dk) / std::sqrt(static_cast<float>(dk));
  const float k_scale = inverse_norm(k, dk);
  float dot = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    qn[i] = q[i] * q_scale;
    kn[i] = k[i] * k_scale;
    dot += qn[i] * kn[i];
  }
  for (int64_t j = 0; j < dv; ++j) known[j] = read[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {  // S^T k and S^T q in one pass over the state's rows
    const float* s = state + i * dv;
    const float ki = kn[i], qi = qn[i];
    for (int64_t j = 0; j < dv; ++j) {
      known[j] += s[j] * ki;
      read[j] += s[j] * qi;
    }
  }
  const float decay = std::exp(a.g[row * a.heads + head]);
  const float beta = a.beta[row * a.heads + head];
  float* written = known;  // d, over S^T k once read
  for (int64_t j = 0; j < dv; ++j) {
    written[j] = (v[j] - decay * known[j]) * beta;
    out[j] = decay * read[j] + dot * written[j];
  }
  for (int64_t i = 0; i < dk; ++i) {
    const float* s = state + i * dv;
    float* t = kept + i * dv;
    const float ki = kn[i];
    for (int64_t j = 0; j < dv; ++j) t[j] = decay * s[j] + ki * written[j];
  }
}

}  // namespace

namespace conveyor {

at::Tensor gated_delta_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& g, const at::Tensor& beta, at::Tensor states,
                              const at::Tensor& slots, const std::optional<at::Tensor>& sources) {
  const int64_t rows = v.size(0);
  const char* op = "gated_delta_decode";
  check_token_rows(op, q, "q", rows, 3);
  check_token_rows(op, k, "k", rows, 3);
  check_token_rows(op, v, "v", rows, 3);
  check_token_rows(op, g, "g", rows, 2);
  check_token_rows(op, beta, "beta", rows, 2);
  const int64_t heads = v.size(1), key_heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes(), "gated_delta_decode: q and k must have one shape");
  TORCH_CHECK(key_heads > 0 && heads % key_heads == 0,
              "gated_delta_decode: the value heads must be a multiple of the key heads");
  TORCH_CHECK(g.size(1) == heads && beta.size(1) == heads,
              "gated_delta_decode: g and beta must have a value per value head");
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 4,
              "gated_delta_decode: states must be contiguous fp32 [slots, heads, dk, dv]");
  TORCH_CHECK(states.size(1) == heads && states.size(2) == dk && states.size(3) == dv,
              "gated_delta_decode: states must be [slots, value heads, key dims, value dims]");
  const StateRows state_rows = checked_state_rows(op, slots, sources, rows, states.size(0));
  at::Tensor out = at::empty({rows, heads, dv}, v.options());
  const RuleArgs args{q.data_ptr<float>(),
                      k.data_ptr<float>(),
                      v.data_ptr<float>(),
                      g.data_ptr<float>(),
                      beta.data_ptr<float>(),
                      states.data_ptr<float>(),
                      state_rows.slots,
                      state_rows.sources,
                      out.data_ptr<float>(),
                      heads,
                      key_heads,
                      dk,
                      dv};
  for_each_row_head(rows, heads, state_rows.sources != nullptr, [&] {
    return [&args, scratch = std::vector<float>(2 * dk + 2 * dv)](
               int64_t row, int64_t head) mutable { rule_task(args, row, head, scratch); };
  });
  return out;
}

}  // namespace conveyor

TORCH_LIBRARY_FRAGMENT(conveyor, m) {
  m.def(
      "gated_delta_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) states, "
      "Tensor slots, Tensor? sources=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(conveyor, CPU, m) {
  m.impl("gated_delta_decode", &conveyor::gated_delta_decode);
}
