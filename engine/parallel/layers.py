"""The layers that tie a rank's share of a model to the others: a row-parallel projection whose
partial sums are added over the ranks, the embedding and LM head split by vocabulary, and the
norms of q and k over all heads with the heads split.

Each wraps the rank's own module (in whatever kernel form it took), so the model code calls
them as it calls any projection.
"""

from __future__ import annotations

from typing import Any

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


# The RMSNorms that scale by their weight in fp32, before the cast back (OLMo 2's and 3's);
# the others cast back, then scale (Llama's: OLMoE's, MiniMax M2's).
SCALED_IN_FP32 = frozenset({"Olmo2RMSNorm", "Olmo3RMSNorm"})


class SplitHeadsNorms(nn.Module):
    """q's and k's RMSNorms over all their heads at once (OLMo 2's), each rank holding its own
    heads and their part of the weights: one all-reduce adds the ranks' sums of squares of q and
    of k, so every rank normalises by the whole row's mean square. A KV head kept by several
    ranks is counted once by each, as its part of the sum is too: dividing by the rank's width
    times the ranks gives the mean either way."""

    def __init__(self, q_norm: Any, k_norm: Any, group: ParallelGroup) -> None:
        super().__init__()
        self.q_norm, self.k_norm = q_norm, k_norm
        self.in_fp32 = type(q_norm).__name__ in SCALED_IN_FP32
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q32, k32 = q.float(), k.float()
        squares = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1)
        self.group.all_reduce(squares)
        size = self.group.size
        q_mean = squares[:, :1] / (q.shape[-1] * size)
        k_mean = squares[:, 1:] / (k.shape[-1] * size)
        return self._normed(q, q32, q_mean, self.q_norm), self._normed(k, k32, k_mean, self.k_norm)

    def _normed(
        self, x: torch.Tensor, x32: torch.Tensor, mean: torch.Tensor, norm: Any
    ) -> torch.Tensor:
        h = x32 * torch.rsqrt(mean + norm.variance_epsilon)
        weight = norm.weight
        return (weight * h).to(x.dtype) if self.in_fp32 else weight * h.to(x.dtype)


class SplitGatedNorm(nn.Module):
    """A Mamba2 mixer's gated RMSNorm over one group of channels that lies across the ranks
    (each holds its heads' channels and their part of the weight): one all-reduce adds the
    ranks' sums of squares, so each rank divides by the whole group's mean square. As the
    model's own norm: gated before the norm and the weight applied after the cast back
    (Granite 4's, Bamba's), or Falcon-H1's, the weight applied in fp32 and the gate before or
    after the norm as its `norm_before_gate` says."""

    def __init__(self, norm: Any, group: ParallelGroup) -> None:
        super().__init__()
        self.norm = norm
        self.group = group
        self.falcon = hasattr(norm, "norm_before_gate")
        self.gate_after = self.falcon and bool(norm.norm_before_gate)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if not self.gate_after:
            h = h * F.silu(gate.float())
        squares = h.pow(2).sum(-1, keepdim=True)
        self.group.all_reduce(squares)
        h = h * torch.rsqrt(squares / (h.shape[-1] * self.group.size) + self.norm.variance_epsilon)
        if not self.falcon:
            return self.norm.weight * h.to(x.dtype)
        h = self.norm.weight * h
        if self.gate_after:
            h = h * F.silu(gate.float())
        return h.to(x.dtype)


def reduced(projection: nn.Module, group: ParallelGroup | None) -> nn.Module:
    """`projection` summed over the ranks, where there are several."""
    if group is None or not group.is_parallel:
        return projection
    return ReducedLinear(projection, group)
