"""The calling convention every runnable model follows."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.backend import AttentionMetadata

# The flattened indices of a step's tokens that image features stand for, and those rows.
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
    return hidden.index_copy(0, rows, features.to(hidden.dtype))
