"""Helium (`HeliumForCausalLM`) on Conveyor's decoder: the Llama layer whose rotary turns
neighbouring dims as pairs over the whole head (GLM's rotation at full width), and whose norms
scale 16-bit rows in fp32 before rounding (as gpt-oss's do). On the CPU, decode steps run the
whole stack as one C++ call (`kernels/cpu/fused_decode.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.layers import fp32_scaled_norm
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer

HELIUM_ARCHITECTURES = frozenset({"HeliumForCausalLM"})


class PagedHeliumLayer(PagedLlamaLayer):
    paired_rotary = True

    @staticmethod
    def _norm(norm: Any, hidden: torch.Tensor, projection: Any) -> torch.Tensor:
        return fp32_scaled_norm(hidden, norm, projection)


class PagedHeliumForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedHeliumLayer

    def _normed(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return fp32_scaled_norm(hidden[logits_indices], self.norm)
