"""Gemma 2 and Gemma 3 (text) on Conveyor's decoder: the Llama family's layer with Gemma's
differences. Each norm scales by one plus its weight; the attention's and the MLP's outputs are
normed again before they join the residual (four norms a layer); the MLP gates with GELU; the
embeddings are scaled by the square root of the hidden size. Gemma 2 caps its attention scores
and its logits; Gemma 3 normalises each q and k head instead, and rotates local (windowed) and
global layers with their own frequencies. On the CPU, Gemma 3's decode steps run the whole stack
as one C++ call (`kernels/cpu/fused_decode.py`), Gemma 2's scores capped there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.backend import LayerAttention
from engine.attention.hf import layer_window
from engine.lora.slots import LoRASlots
from engine.models.layers import fp32_scaled_norm, soft_capped
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer, norm_eps
from engine.parallel.sharding import Shard

GEMMA_ARCHITECTURES = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM"})


class ShiftedNorm(nn.Module):
    """A Gemma RMSNorm as Conveyor's norm takes it: its weight plus one, in fp32."""

    def __init__(self, norm: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + norm.weight.detach().float(), requires_grad=False)
        self.variance_epsilon = norm_eps(norm)


class PagedGemmaLayer(PagedLlamaLayer):
    qk_scaled_in_fp32 = True

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        attn = hf_layer.self_attn
        self.input_norm = ShiftedNorm(hf_layer.input_layernorm)
        # On the attention's output, before it joins the residual (the Llama layer's norm of
        # that name comes before the MLP instead).
        self.post_attention_norm = ShiftedNorm(hf_layer.post_attention_layernorm)
        self.pre_mlp_norm = ShiftedNorm(hf_layer.pre_feedforward_layernorm)
        self.post_mlp_norm = ShiftedNorm(hf_layer.post_feedforward_layernorm)
        self.output_norms = (self.post_attention_norm, self.post_mlp_norm)
        self.attention = LayerAttention.of(
            layer_window(attn), getattr(attn, "attn_logit_softcapping", None)
        )

    def _qk_norm_weight(self, attn: Any) -> torch.Tensor | None:
        weight = super()._qk_norm_weight(attn)
        return None if weight is None else 1.0 + weight.float()

    @staticmethod
    def _norm(norm: Any, hidden: torch.Tensor, projection: nn.Module) -> torch.Tensor:
        return fp32_scaled_norm(hidden, norm, projection)

    @property
    def mlp_norm(self) -> Any:
        return self.pre_mlp_norm

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        """The output projection normed onto `residual`, then the MLP between its two norms."""
        projected = self._attention_output(out, lora)
        hidden = residual + fp32_scaled_norm(projected, self.post_attention_norm)
        normed = fp32_scaled_norm(hidden, self.pre_mlp_norm, self.gate_up_proj)
        mlp_out = self._mlp_output(normed, lora)
        return hidden + fp32_scaled_norm(mlp_out, self.post_mlp_norm)


class PagedGemmaForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedGemmaLayer

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(hf_model, shard)
        config = hf_model.config
        self.norm = ShiftedNorm(hf_model.model.norm)
        # transformers' scaled embedding scales itself; a model with a plain embedding scales
        # its output in its forward (as Gemma's first modelling did), and so does this (as
        # does a rank's share, whose embedding is its rows of the vocabulary, unscaled).
        self.embed_scale = (
            None if hasattr(self.embed_tokens, "embed_scale") else config.hidden_size**0.5
        )
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def _normed(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return fp32_scaled_norm(hidden[logits_indices], self.norm)

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Gemma 2 caps its logits (which leaves each row's argmax where it was)."""
        logits = super().logits(hidden, logits_indices)
        return soft_capped(logits, self.final_softcap) if self.final_softcap else logits

    def _embedded(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden
