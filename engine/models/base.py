"""The calling convention every runnable model follows."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.backend import AttentionMetadata


class CausalLM(Protocol):
    name: str

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits `[len(logits_indices), vocab]` of one flattened step."""
        ...

    def greedy_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The argmax of each row of those logits, int64 `[len(logits_indices)]` (the first of
        equal maxima), where every row samples greedily from its raw logits."""
        ...
