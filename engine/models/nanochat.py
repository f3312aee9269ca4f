"""nanochat (`NanoChatForCausalLM`) on Conveyor's decoder: the Llama layer with norms that have
no weights (before the attention and the MLP, on each q and k head after the rotary, on the
embeddings before the first layer and after the last), a rotary that turns the other way, an
MLP without a gate (`fc2(relu²(fc1(x)))`), and soft-capped logits. Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.lora.slots import LoRASlots
from engine.models.layers import soft_capped
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.models.rotary_table import AdaptedRotary, RotaryTable
from engine.parallel.sharding import Shard

NANOCHAT_ARCHITECTURES = frozenset({"NanoChatForCausalLM"})


def weightless_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMSNorm with no weight, in fp32 and cast back, as nanochat computes it."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def backward(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nanochat's rotary turns by minus each angle (`rotate_half` with its signs flipped): the
    Llama rotation with `-sin` computes the same, exactly."""
    return cos, -sin


class NormedEmbedding(nn.Module):
    """The token embedding, each row normed (nanochat norms its embeddings before the first
    layer)."""

    def __init__(self, embedding: nn.Module, eps: float) -> None:
        super().__init__()
        self.embedding = embedding
        self.eps = eps

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight  # type: ignore[return-value]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return weightless_norm(self.embedding(input_ids), self.eps)


class PagedNanoChatLayer(PagedLlamaLayer):
    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        self.eps = float(hf_layer.input_layernorm.variance_epsilon)

    def _qk_norms(self, attn: Any) -> tuple[Any, Any] | None:
        return None  # weightless, after the rotary: in `project_qkv`

    @staticmethod
    def _norm(norm: Any, hidden: torch.Tensor, projection: Any) -> torch.Tensor:
        return weightless_norm(hidden, norm.variance_epsilon)

    def project_qkv(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoRASlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = PagedLlamaLayer.project_qkv(self, hidden, cos, sin, lora)
        return weightless_norm(query, self.eps), weightless_norm(key, self.eps), value


class PagedNanoChatForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "nanochat's layers"
    layer_class = PagedNanoChatLayer

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(hf_model, shard)
        self.eps = float(hf_model.model.norm.variance_epsilon)
        self.embed_tokens = NormedEmbedding(self.embed_tokens, self.eps)
        self.final_softcap = getattr(hf_model.config, "final_logit_softcapping", None)
        self.rotary = RotaryTable(
            AdaptedRotary(hf_model.model.rotary_emb, backward),
            getattr(hf_model.config, "max_position_embeddings", 0),
        )

    def _normed(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return weightless_norm(hidden[logits_indices], self.eps)

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Soft-capped, as nanochat caps them (which leaves each row's argmax where it was)."""
        logits = super().logits(hidden, logits_indices)
        return soft_capped(logits, self.final_softcap) if self.final_softcap else logits
