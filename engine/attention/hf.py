"""Plugs Conveyor's paged attention into unchanged Hugging Face models.

The function is registered with transformers' `AttentionInterface` under one name; a model loaded
with that `attn_implementation` calls it in every layer. Per-step batch metadata travels as the
forward keyword argument `METADATA_KWARG`, never as module state.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from engine.attention.backend import AttentionMetadata

ATTN_IMPLEMENTATION = "conveyor_paged"
METADATA_KWARG = "conveyor_attention"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF calling convention: `[1, heads, tokens, dim]` in, `[1, tokens, heads, dim]` out."""
    metadata: AttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if metadata is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} attention needs the `{METADATA_KWARG}` forward argument"
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = metadata.backend.forward(
        int(module.layer_idx),  # type: ignore[arg-type]  # HF attention modules hold an int
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        scaling,
        metadata,
    )
    return out.unsqueeze(0), None


def register() -> str:
    """Register the paged attention with transformers (idempotent); return its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
