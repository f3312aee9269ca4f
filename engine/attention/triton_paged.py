"""Paged attention for GPUs: Conveyor's Triton kernels write new K/V, run decode rows in place
over the cache blocks, and run every prompt chunk of a step in one launch that reads the cached
prefix in place.

Triton is imported only when the backend is built, so machines without it can still load
every other backend. It runs on CUDA tensors, or on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`), which the tests use.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np
import torch

from engine.attention.in_place import InPlaceDecodeAttention, InPlaceMetadata
from engine.attention.torch_paged import TorchPagedMetadata
from engine.kv.kv_cache import KVCache
from engine.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def usable(device: str) -> bool:
    """Triton is installed and its kernels compile and run on `device`: Triton builds a small
    launcher with the machine's C compiler on first use, which a bare runtime image lacks."""
    if not available():
        return False
    try:
        kernels = _kernels()
        layer_cache = torch.zeros(1, 1, 1, 8, device=device)
        row = torch.ones(1, 1, 8, device=device)
        slot = torch.zeros(1, dtype=torch.long, device=device)
        kernels.store_kv(row, row, layer_cache, layer_cache.clone(), slot)
        if not bool(layer_cache.eq(1).all()):
            raise RuntimeError("a test write did not land")
    except Exception as error:  # no compiler, no driver support, a broken install
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        logger.warning(
            "Triton kernels unusable on %s (%s); using the torch attention backend", device, message
        )
        return False
    return True


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


@dataclass(slots=True, eq=False)
class TritonMetadata(InPlaceMetadata):
    # The step's multi-token rows as the prefill kernel takes them (`PrefillRows`), if any.
    prefill_rows: Any = None


class TritonPagedAttention(InPlaceDecodeAttention):
    name = "triton"

    @staticmethod
    def metadata_type() -> type[TorchPagedMetadata]:
        return TritonMetadata

    def build_metadata(self, batch: InputBatch, kv_cache: KVCache) -> TorchPagedMetadata:
        meta = super().build_metadata(batch, kv_cache)
        assert isinstance(meta, TritonMetadata)
        rows = np.flatnonzero(batch.query_lens > 1)
        if rows.size:
            meta.prefill_rows = self._kernels.PrefillRows.of(
                batch.query_starts[rows],
                batch.query_lens[rows],
                batch.context_lens[rows],
                batch.block_table[rows],
                kv_cache.device,
            )
        return meta

    def _prefill_rows(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        metadata: TorchPagedMetadata,
        out: torch.Tensor,
    ) -> None:
        """Every multi-token row in one launch, over K/V as the cache holds them."""
        assert isinstance(metadata, TritonMetadata)
        if metadata.prefill_rows is None:
            return
        cache = metadata.kv_cache
        self._kernels.paged_prefill(
            out, query, cache.key(layer), cache.value(layer), metadata.prefill_rows, scale
        )

    def __init__(self) -> None:
        if not available():
            raise RuntimeError(
                "the triton attention backend needs the triton package; "
                "use --attention-backend torch"
            )
        self._kernels = _kernels()

    def decode_kernel(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return self._kernels.paged_decode(
            query, key_cache, value_cache, block_table, seq_lens, scale
        )

    def _store(
        self,
        cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        self._kernels.store_kv(key, value, cache.key(layer), cache.value(layer), slot_mapping)


def _kernels() -> ModuleType:
    from engine.kernels.triton import paged_attention as triton_kernels

    return triton_kernels
