"""ERNIE 4.5's dense models (`Ernie4_5ForCausalLM`) on Conveyor's decoder: the Llama layer whose
rotary turns neighbouring dims as pairs over the whole head (GLM's rotation at full width),
computed in fp32 as transformers computes it. Decode steps run op by op: the fused C++ stack
rotates halves.
"""

from __future__ import annotations

import torch

from engine.models.glm import rotate_pairs
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer

ERNIE_ARCHITECTURES = frozenset({"Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"})


class PagedErnieLayer(PagedLlamaLayer):
    @staticmethod
    def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if qk.dtype == torch.float32:
            return rotate_pairs(qk, cos, sin)
        return rotate_pairs(qk.float(), cos.float(), sin.float()).to(qk.dtype)


class PagedErnieForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "ERNIE 4.5's paired rotary"
    layer_class = PagedErnieLayer
