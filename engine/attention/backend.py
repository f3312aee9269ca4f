"""The small interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.kv.kv_cache import KVCache
from engine.worker.input_batch import InputBatch


class AttentionMetadata:
    """Per-step data shared by all layers. Backends subclass it with what they precompute."""

    backend: AttentionBackend
    kv_cache: KVCache
    slot_mapping: torch.Tensor


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """A step of decode rows only (row i is token i), as a fused decoder layer takes it: each
    row's new K/V go to its slot, then it attends over its blocks up to its length."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What a layer's attention computes beyond `softmax(q k^T * scale) v` over its causal
    past, as Hugging Face's models pass it: a sliding `window` (a token sees its last `window`
    positions, itself included), a `softcap` of the scores (`tanh(s / cap) * cap`, Gemma 2),
    and per-head `sinks`, logits with no value that join each softmax (gpt-oss)."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @classmethod
    def of(
        cls, window: object = None, softcap: object = None, sinks: object = None
    ) -> LayerAttention | None:
        """The features set (None where the layer's attention is plain)."""
        windowed = window if isinstance(window, int) and window > 0 else None
        capped = float(softcap) if isinstance(softcap, int | float) and softcap else None
        sunk = sinks if isinstance(sinks, torch.Tensor) else None
        if windowed is None and capped is None and sunk is None:
            return None
        return cls(windowed, capped, sunk)


def window_of(features: LayerAttention | None) -> int:
    """The window a kernel takes: the layer's, or 0 for none."""
    return features.window or 0 if features is not None else 0


def softcap_of(features: LayerAttention | None) -> float:
    """The score cap a kernel takes: the layer's, or 0 for none."""
    return features.softcap or 0.0 if features is not None else 0.0


class AttentionBackend(ABC):
    """Writes each layer's new K/V into the paged cache and attends over the block tables."""

    name: ClassVar[str]
    # Whether an fp8 cache may hold K/V divided by per-layer scales other than 1.0 here.
    takes_kv_scales: ClassVar[bool] = True

    @abstractmethod
    def build_metadata(self, batch: InputBatch, kv_cache: KVCache) -> AttentionMetadata:
        """Turn host-side batch inputs into device tensors, once per step."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        metadata: AttentionMetadata,
        features: LayerAttention | None = None,
    ) -> torch.Tensor:
        """Attend for all flattened tokens.

        `query` is `[tokens, heads, head_dim]`, `key`/`value` `[tokens, kv_heads, head_dim]`;
        returns `[tokens, heads, head_dim]`. Each token sees its own sequence's cached prefix and
        the new tokens before it (within the layer's window, with its `features`, where the
        backend `takes` them).
        """

    @classmethod
    def takes(cls, features: LayerAttention) -> bool:
        """Whether `forward` computes a layer with these features."""
        return False

    def decode_step(self, metadata: AttentionMetadata) -> DecodeStep | None:
        """The step as a fused decoder layer takes it, where this backend's attention is what
        that layer computes (Conveyor's CPU kernel) and every row decodes; else None, and
        layers call `forward`."""
        return None
