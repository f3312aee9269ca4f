// The rows of a recurrent layer's decode step over the state cache: each row's slot and, where
// a request verifies drafts, the slot it reads its state from (checked against the cache's
// `num_slots`, `op` naming the kernel in the errors); and the order its (row, head) tasks run
// in; and the check of a per-token input. Shared by the delta rule's, Mamba2's and Mamba1's
// decode kernels and the short convolution.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace conveyor {

// `t`, the input `name` of kernel `op`: contiguous fp32 of `dim` dims, a row per token.
inline void check_token_rows(const char* op, const at::Tensor& t, const char* name, int64_t rows,
                             int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), op, ": ", name,
              " must be contiguous fp32");
  TORCH_CHECK(t.dim() == dim && t.size(0) == rows, op, ": ", name, " must have ", dim,
              " dims and a row per token");
}

struct StateRows {
  const int64_t* slots;
  const int64_t* sources;  // null where each row reads its own slot
};

inline StateRows checked_state_rows(const char* op, const at::Tensor& slots,
                                    const std::optional<at::Tensor>& sources, int64_t rows,
                                    int64_t num_slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == rows &&
                  slots.is_contiguous(),
              op, ": slots must be int64 [rows]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* source = nullptr;
  if (sources.has_value()) {
    TORCH_CHECK(sources->scalar_type() == at::kLong && sources->dim() == 1 &&
                    sources->size(0) == rows && sources->is_contiguous(),
                op, ": sources must be int64 [rows]");
    source = sources->data_ptr<int64_t>();
  }
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(slot[row] >= 0 && slot[row] < num_slots, op, ": slot ", slot[row],
                " is outside the states");
    TORCH_CHECK(source == nullptr || (source[row] >= 0 && source[row] < num_slots), op,
                ": a source is outside the states");
  }
  return {slot, source};
}

// Runs `task(row, head)` for every row and head, `worker()` making each thread's task. Rows
// that read sources (`chained`) run in order within each head, since a row may read the state
// the row before it wrote; otherwise every (row, head) pair is a task of its own.
template <typename Worker>
void for_each_row_head(int64_t rows, int64_t heads, bool chained, const Worker& worker) {
  if (chained) {
    at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
      auto task = worker();
      for (int64_t head = begin; head < end; ++head) {
        for (int64_t row = 0; row < rows; ++row) task(row, head);
      }
    });
    return;
  }
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    auto task = worker();
    for (int64_t pair = begin; pair < end; ++pair) task(pair / heads, pair % heads);
  });
}

}  // namespace conveyor
