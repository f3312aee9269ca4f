"""Plugs Conveyor's paged attention into unchanged Hugging Face models.

The function is registered with transformers' `AttentionInterface` under one name; a model loaded
with that `attn_implementation` calls it in every layer. Per-step batch metadata travels as the
forward keyword argument `METADATA_KWARG`, never as module state.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from engine.attention.backend import AttentionMetadata, LayerAttention

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
    """HF calling convention: `[1, heads, tokens, dim]` in, `[1, tokens, heads, dim]` out. A
    layer's `sliding_window`, `softcap` and sinks (`s_aux`) go to the backend with it."""
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
        LayerAttention.of(kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")),
    )
    return out.unsqueeze(0), None


def register() -> str:
    """Register the paged attention with transformers (idempotent); return its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


def attention_features(hf_model: Any, max_model_len: int) -> list[LayerAttention]:
    """The distinct features of the model's attention layers beyond plain causal attention
    over `max_model_len` tokens (a sliding window shorter than that, soft-capped scores,
    sinks); empty where there are none."""
    found: dict[tuple[Any, ...], LayerAttention] = {}
    for module in hf_model.modules():
        if not hasattr(module, "layer_idx"):  # the attention modules (and decoder layers)
            continue
        window = layer_window(module)
        features = LayerAttention.of(
            window if isinstance(window, int) and window < max_model_len else None,
            getattr(module, "attn_logit_softcapping", None),
            getattr(module, "sinks", None),
        )
        if features is not None:
            key = (features.window, features.softcap, features.sinks is not None)
            found.setdefault(key, features)
    return list(found.values())


def describe(features: list[LayerAttention]) -> str:
    """The features in words, each once."""
    words: dict[str, None] = {}
    for feature in features:
        if feature.window is not None:
            words[f"sliding window of {feature.window} tokens"] = None
        if feature.softcap is not None:
            words["soft-capped attention scores"] = None
        if feature.sinks is not None:
            words["attention sinks"] = None
    return ", ".join(words)


def layer_window(attention: Any) -> Any:
    """An attention module's sliding window: its own (Qwen2's, Gemma's: None on full layers),
    else its config's (Mistral's, the same for every layer)."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(getattr(attention, "config", None), "sliding_window", None)
