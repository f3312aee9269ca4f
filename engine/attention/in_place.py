"""Paged attention whose decode rows read K/V in place from the cache blocks.

A kernel walks each row's own blocks up to its own length, so decode rows need only their
block tables and lengths: no gathered copy and no padding mask. Such metadata has fixed shapes
for a given number of rows, which is what lets decode steps be captured in CUDA graphs.
Prefill rows keep the pure-torch path unless a subclass hands them to its own kernel
(`_prefill_work`, `_prefill_rows`).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.attention.backend import LayerAttention, softcap_of, window_of
from engine.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata, _to
from engine.kv.kv_cache import KVCache
from engine.worker.input_batch import InputBatch


@dataclass(slots=True, eq=False)
class InPlaceMetadata(TorchPagedMetadata):
    decode_seq_lens: torch.Tensor | None = None
    # The step's multi-token rows as the subclass's prefill kernel takes them, if it has one.
    prefill_rows: Any = None


class InPlaceDecodeAttention(TorchPagedAttention):
    """Subclasses give the kernel: `(query, key_cache, value_cache, block_table, seq_lens,
    scale, kv_scales) -> out`, with the layout of `TorchPagedAttention`'s caches. Their
    kernels attend plainly, unless a subclass says it `takes` more."""

    @classmethod
    def takes(cls, features: LayerAttention) -> bool:
        return False

    @staticmethod
    def metadata_type() -> type[TorchPagedMetadata]:
        return InPlaceMetadata

    def build_metadata(self, batch: InputBatch, kv_cache: KVCache) -> TorchPagedMetadata:
        meta = super().build_metadata(batch, kv_cache)
        assert isinstance(meta, InPlaceMetadata)
        # Rows whose image tokens see past themselves take the torch path (`_prefill_spans`).
        rows = np.array(
            [row for row in np.flatnonzero(batch.query_lens > 1) if row not in batch.key_limits],
            dtype=np.int64,
        )
        if rows.size:
            meta.prefill_rows = self._prefill_work(batch, rows, kv_cache)
        return meta

    def _prefill_work(self, batch: InputBatch, rows: np.ndarray, kv_cache: KVCache) -> Any:
        """The multi-token `rows` of the step as this backend's prefill kernel takes them (None:
        no kernel, the torch path attends them)."""
        return None

    @abstractmethod
    def decode_kernel(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        kv_scales: torch.Tensor,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend each query row over its own blocks, up to its own length (its last `window`
        tokens only, its scores capped by `softcap`, `sinks` in its softmax, where a subclass
        `takes` them); an fp8 cache holds K/V divided by `kv_scales` (the layer's key and value
        scales, on the device)."""

    def decode_metadata(
        self,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> InPlaceMetadata:
        """Metadata over caller-owned tensors for a step of decode rows only (row i is token i),
        as a CUDA graph replays it with new contents in the same tensors."""
        return InPlaceMetadata(
            backend=self,
            kv_cache=kv_cache,
            slot_mapping=slot_mapping,
            num_tokens=int(slot_mapping.shape[0]),
            decode_block_table=block_table,
            all_decode=True,
            decode_seq_lens=seq_lens,
        )

    @staticmethod
    def _decode_lengths(
        meta: TorchPagedMetadata, seq_lens: np.ndarray, span: int, device: torch.device
    ) -> None:
        """The kernel reads each row's length and stops there: no mask."""
        assert isinstance(meta, InPlaceMetadata)
        meta.decode_seq_lens = _to(seq_lens.astype(np.int64), device)

    def _decode(
        self,
        layer: int,
        query: torch.Tensor,
        scale: float,
        meta: TorchPagedMetadata,
        features: LayerAttention | None = None,
    ) -> torch.Tensor:
        assert isinstance(meta, InPlaceMetadata) and meta.decode_seq_lens is not None
        assert meta.decode_block_table is not None
        cache = meta.kv_cache
        q = query if meta.all_decode else query[meta.decode_tokens]
        return self.decode_kernel(
            q,
            cache.key(layer),
            cache.value(layer),
            meta.decode_block_table,
            meta.decode_seq_lens,
            scale,
            cache.layer_scales(layer),
            window_of(features),
            softcap_of(features),
            features.sinks if features is not None else None,
        )
