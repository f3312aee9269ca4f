"""gpt-oss (`GptOssForCausalLM`) on Conveyor's decoder: the Llama layer with biases on q, k, v
and o, a learned sink per head joining each softmax, sliding and full layers in turn, and a
mixture of experts whose router softmaxes over its top-k logits and whose experts run a clamped
SwiGLU with biases (`models.experts`). Its rotary hands out cos and sin for half of each head
(the two halves turn by the same frequencies); they are widened once to the whole head, which
turns the halves with the same operations. Its norms scale in fp32 before rounding to the
rows' dtype. On the CPU its decode steps run each layer's attention (sinks, biases, window) as
one fused op and its router and experts between them, the experts one op
(`ExpertLinears.group`).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.models.layers import fp32_scaled_norm
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.models.rotary_table import AdaptedRotary, RotaryTable
from engine.parallel.sharding import Shard

GPT_OSS_ARCHITECTURES = frozenset({"GptOssForCausalLM"})


def whole_head(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for half a head's dims (gpt-oss's rotary), given for the whole head (each half
    by the same frequencies), as the Llama layer rotates: `x * cos + rotate_half(x) * sin`
    computes gpt-oss's `x1 * cos - x2 * sin`, `x2 * cos + x1 * sin` exactly."""
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


class PagedGptOssLayer(PagedLlamaLayer):
    @staticmethod
    def _norm(norm: Any, hidden: torch.Tensor, projection: Any) -> torch.Tensor:
        return fp32_scaled_norm(hidden, norm, projection)  # the Llama norm rounds, then scales


class PagedGptOssForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedGptOssLayer

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(hf_model, shard)
        self.rotary = RotaryTable(
            AdaptedRotary(hf_model.model.rotary_emb, whole_head),
            getattr(hf_model.config, "max_position_embeddings", 0),
        )

    def _normed(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return fp32_scaled_norm(hidden[logits_indices], self.norm)
