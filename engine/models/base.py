"""The calling convention every runnable model follows."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.backend import AttentionMetadata

# The flattened indices of a step's tokens that image features stand for, and those rows:
# `[tokens, hidden]`, or `[tokens, (1 + layers) * hidden]` where the encoder also gives rows the
# first `layers` decoder layers add to their outputs (`with_layer_rows`).
ImageRows = tuple[torch.Tensor, torch.Tensor]


class CausalLM(Protocol):
    name: str

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        image_features: ImageRows | None = None,
    ) -> torch.Tensor:
        """Logits `[len(logits_indices), vocab]` of one flattened step; `image_features` (an
        image-text model's) replace those tokens' embeddings."""
        ...

    def greedy_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        image_features: ImageRows | None = None,
    ) -> torch.Tensor:
        """The argmax of each row of those logits, int64 `[len(logits_indices)]` (the first of
        equal maxima), where every row samples greedily from its raw logits."""
        ...


def with_image_rows(hidden: torch.Tensor, image_features: ImageRows | None) -> torch.Tensor:
    """The step's embeddings with image features in place of their tokens' (if any)."""
    if image_features is None:
        return hidden
    rows, features = image_features
    width = hidden.shape[-1]
    return hidden.index_copy(0, rows, features[:, :width].to(hidden.dtype))


def with_layer_rows(
    hidden: torch.Tensor, image_features: ImageRows | None, layer: int
) -> torch.Tensor:
    """Decoder layer `layer`'s output with the image rows the encoder gives it added at their
    tokens (Qwen3-VL's first layers; unchanged where there are none)."""
    if image_features is None:
        return hidden
    rows, features = image_features
    width = hidden.shape[-1]
    start = (layer + 1) * width
    if features.shape[-1] <= start:
        return hidden
    return hidden.index_add(0, rows, features[:, start : start + width].to(hidden.dtype))
