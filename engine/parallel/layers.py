"""The layers that tie a rank's share of a model to the others: a row-parallel projection whose
partial sums are added over the ranks, and the embedding and LM head split by vocabulary.

Each wraps the rank's own module (in whatever kernel form it took), so the model code calls
them as it calls any projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel.group import ParallelGroup


class ReducedLinear(nn.Module):
    """o and down projections: this rank's columns of the product, summed over the ranks."""

    def __init__(self, inner: nn.Module, group: ParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding, `[start, start + rows)`: ids outside them give zero
    rows, and the sum over the ranks is every id's own row."""

    def __init__(self, inner: nn.Embedding, start: int, group: ParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.inner.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.inner.weight)
        return self.group.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


class VocabParallelHead(nn.Module):
    """The LM head's rows split by vocabulary: each rank's logits, gathered side by side on every
    rank, less the padding of the last share."""

    def __init__(self, inner: nn.Module, vocab_size: int, group: ParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_columns(self.inner(hidden))
        if logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size].contiguous()


def reduced(projection: nn.Module, group: ParallelGroup | None) -> nn.Module:
    """`projection` summed over the ranks, where there are several."""
    if group is None or not group.is_parallel:
        return projection
    return ReducedLinear(projection, group)
