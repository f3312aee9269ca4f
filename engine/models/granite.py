"""Granite (IBM's Granite 3, dense and its mixtures of experts) on Conveyor's decoder: the Llama
layer with four scalars from its config. The embeddings are multiplied by
`embedding_multiplier`; attention scales its scores by `attention_multiplier` (the layer's own
`scaling`, read as any model's); each sublayer's output is multiplied by `residual_multiplier`
before it joins the residual; the logits are divided by `logits_scaling`. The fused CPU decode
scales the residual adds as the layer does (`LayerForm.residual_scale`). GraniteMoe's experts are
weighed by a softmax of their top-k logits; GraniteMoeShared adds an MLP every token runs beside
them (each layer's attention decodes as one fused op there, its experts between).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.lora.slots import LoRASlots
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.parallel.layers import reduced
from engine.parallel.sharding import Shard

GRANITE_ARCHITECTURES = frozenset(
    {"GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"}
)


class PagedGraniteLayer(PagedLlamaLayer):
    joins_then_mlp_block = True

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        self.residual_multiplier = float(hf_layer.residual_multiplier)
        # GraniteMoeShared's MLP every token runs beside the experts (None elsewhere), its
        # rank's channels summed over the ranks.
        shared_mlp = getattr(hf_layer, "shared_mlp", None)
        group = shard.group if shard is not None else None
        self.shared_mlp = None if shared_mlp is None else reduced(shared_mlp, group)

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        projected = self._attention_output(out, lora)
        return self.mlp_block(residual + projected * self.residual_multiplier, lora)

    def mlp_block(self, hidden: torch.Tensor, lora: LoRASlots | None = None) -> torch.Tensor:
        """`hidden` plus the MLP's (or the experts' and the shared MLP's) output for them
        normed, scaled by the residual multiplier."""
        mlp_input = self.gate_up_proj if self.moe is None else self.moe
        normed = self._norm(self.post_attention_norm, hidden, mlp_input)
        out = self._mlp_output(normed, lora)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(normed)
        return hidden + out * self.residual_multiplier


class ScaledEmbedding(nn.Module):
    """An embedding whose rows are multiplied by a constant (Granite's `embedding_multiplier`)."""

    def __init__(self, embedding: nn.Module, multiplier: float) -> None:
        super().__init__()
        self.embedding = embedding
        self.multiplier = multiplier

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight  # type: ignore[return-value]  # an embedding's weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids) * self.multiplier


class PagedGraniteForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedGraniteLayer

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(hf_model, shard)
        config = hf_model.config
        self.embed_tokens = ScaledEmbedding(self.embed_tokens, float(config.embedding_multiplier))
        self.logits_scaling = float(config.logits_scaling)

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The LM head's output divided by `logits_scaling` (each row's argmax stays)."""
        return super().logits(hidden, logits_indices) / self.logits_scaling
