// The shapes of panels as the team-run products take them (`bf16_take_tasks`,
// `bf16_block_take_tasks`, `panel_take_tasks`): bf16 panels, gate/up pairs, block panels and
// their padded biases, checked by the ops that run many products in one parallel region (the
// decode stack, `decode_stack.cpp`; a layer of experts, `expert_mlps.cpp`).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "block_panels.h"

namespace conveyor {

// bf16 panels [ceil(out / 16), in / 2, 32], contiguous.
inline bool bf16_panels(const at::Tensor& p, int64_t out, int64_t in) {
  return p.scalar_type() == at::kBFloat16 && p.dim() == 3 && p.is_contiguous() &&
         p.size(0) == (out + 15) / 16 && p.size(1) * 2 == in && p.size(2) == 32;
}

// Gated bf16 panels [ceil(inter / 16), 2, in / 2, 32], contiguous.
inline bool gated_panels(const at::Tensor& p, int64_t inter, int64_t in) {
  return p.scalar_type() == at::kBFloat16 && p.dim() == 4 && p.is_contiguous() &&
         p.size(0) == (inter + 15) / 16 && p.size(1) == 2 && p.size(2) * 2 == in && p.size(3) == 32;
}

// Block panels [ceil(out / 16), in / 32, group] of a format `block_group` names, contiguous.
inline bool block_panels_fit(const at::Tensor& p, int64_t out, int64_t in) {
  return p.scalar_type() == at::kByte && p.dim() == 3 && p.is_contiguous() &&
         p.size(0) == (out + 15) / 16 && p.size(1) * kBlock == in && block_group(p.size(2));
}

// No bias, or an fp32 one of `values` (padded to the panels).
inline bool padded_bias(const std::optional<at::Tensor>& bias, int64_t values) {
  return !bias.has_value() || !bias->defined() ||
         (bias->dim() == 1 && bias->size(0) == values && bias->scalar_type() == at::kFloat &&
          bias->is_contiguous());
}

// The panels' bf16 values as the products read them.
inline const uint16_t* panel_bits(const at::Tensor& panels) {
  return reinterpret_cast<const uint16_t*>(panels.data_ptr());
}

}  // namespace conveyor
