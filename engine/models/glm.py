"""GLM-4 (`GlmForCausalLM`, and `Glm4ForCausalLM` of the 0414 models) on Conveyor's decoder: the
Llama layer whose gate and up are one projection already, whose rotary turns only the first half
of each head and pairs neighbouring dims (`x[0::2]` with `x[1::2]`, each pair by one frequency)
rather than the two halves, and, in GLM-4-0414, whose attention and MLP outputs are normed again
before they join the residual. Decode steps run op by op: the fused C++ stack rotates halves.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.lora.slots import LoRASlots
from engine.models.layers import rms_norm
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.parallel.sharding import Shard

GLM_ARCHITECTURES = frozenset({"GlmForCausalLM", "Glm4ForCausalLM"})


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GLM's rotary over `[tokens, heads, dim]`: the first `cos.shape[-1]` dims turn as
    neighbouring pairs, each by its frequency (the first half of `cos` and `sin`, each value
    twice), the rest pass; the same operations in the same order as transformers' GLM."""
    width = cos.shape[-1]
    part, rest = x[..., :width], x[..., width:]
    cos = cos[..., : width // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : width // 2].repeat_interleave(2, dim=-1)
    turned = torch.stack((-part[..., 1::2], part[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([part * cos + turned * sin, rest], dim=-1)


class PagedGlmLayer(PagedLlamaLayer):
    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        # GLM-4-0414's norms on the attention's and the MLP's outputs (None in GLM-4).
        self.post_attention_out_norm = getattr(hf_layer, "post_self_attn_layernorm", None)
        self.post_mlp_norm = getattr(hf_layer, "post_mlp_layernorm", None)

    @staticmethod
    def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_pairs(qk, cos, sin)

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        projected = self._attention_output(out, lora)
        hidden = residual + _normed(self.post_attention_out_norm, projected)
        normed = self._norm(self.post_attention_norm, hidden, self.gate_up_proj)
        mlp_out = self._mlp_output(normed, lora)
        return hidden + _normed(self.post_mlp_norm, mlp_out)


def _normed(norm: Any, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else rms_norm(x, norm.weight, norm.variance_epsilon)


class PagedGlmForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "GLM's paired rotary"
    layer_class = PagedGlmLayer
