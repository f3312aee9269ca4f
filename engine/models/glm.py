"""GLM-4 (`GlmForCausalLM`, and `Glm4ForCausalLM` of the 0414 models) on Conveyor's decoder: the
Llama layer whose gate and up are one projection already, whose rotary turns only the first half
of each head and pairs neighbouring dims (`x[0::2]` with `x[1::2]`, each pair by one frequency)
rather than the two halves, and, in GLM-4-0414, whose attention and MLP outputs are normed again
before they join the residual. On the CPU, decode steps run the whole stack as one C++ call
(`kernels/cpu/fused_decode.py`), its rotary turning pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.lora.slots import LoRASlots
from engine.models.layers import rms_norm
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.parallel.sharding import Shard

GLM_ARCHITECTURES = frozenset({"GlmForCausalLM", "Glm4ForCausalLM"})


class PagedGlmLayer(PagedLlamaLayer):
    paired_rotary = True

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        # GLM-4-0414's norms on the attention's and the MLP's outputs (None in GLM-4).
        self.post_attention_out_norm = getattr(hf_layer, "post_self_attn_layernorm", None)
        self.post_mlp_norm = getattr(hf_layer, "post_mlp_layernorm", None)
        if self.post_attention_out_norm is not None and self.post_mlp_norm is not None:
            self.output_norms = (self.post_attention_out_norm, self.post_mlp_norm)

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
    layer_class = PagedGlmLayer
