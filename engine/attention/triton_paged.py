"""Paged attention for GPUs: Conveyor's Triton kernels write new K/V, run decode rows in place
over the cache blocks, and run every prompt chunk of a step in one launch that reads the cached
prefix in place.

Triton is imported only when the backend is built, so machines without it can still load
every other backend. It runs on CUDA tensors, or on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`), which the tests use.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np
import torch

from engine.attention.backend import LayerAttention, window_of
from engine.attention.in_place import InPlaceDecodeAttention, InPlaceMetadata
from engine.attention.torch_paged import TorchPagedMetadata
from engine.kernels.triton import self_test
from engine.kv.kv_cache import KVCache
from engine.worker.input_batch import InputBatch


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


@cache
def usable(device: str) -> bool:
    """Triton is installed and every kernel compiles, runs and gives the right answer on
    `device`: Triton builds a small launcher with the machine's C compiler on first use, which
    a bare runtime image lacks, and a Triton or driver version may reject a kernel."""
    return available() and self_test.passes(
        lambda: _self_test(_kernels(), torch.device(device)),
        "Triton kernels",
        device,
        "using the torch attention backend",
    )


def _self_test(kernels: ModuleType, device: torch.device) -> None:
    """Store two tokens of one sequence, then attend over them as a prompt chunk and as decode
    rows in one and in two splits; raises where a kernel fails or answers wrongly. Key 1
    outweighs key 0 for the query, so the answers mix the two values unevenly."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    key_cache = torch.zeros(1, 16, 1, 16, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    keys = torch.zeros(2, 1, 16, dtype=dtype, device=device)
    keys[1, 0, 0] = 1.0
    values = torch.stack([torch.zeros(1, 16), torch.ones(1, 16)]).to(device, dtype)
    kernels.store_kv(keys, values, key_cache, value_cache, torch.arange(2, device=device))
    if not bool(value_cache[0, 1].eq(1).all()):
        raise RuntimeError("a test write did not land")
    query = keys[1:].clone()  # [1 token, 1 head, 16]
    table = torch.zeros(1, 1, dtype=torch.long, device=device)
    length = torch.tensor([2], device=device)
    weight = 1 / (1 + torch.exp(torch.tensor(-1.0))).item()  # softmax of scores 0 and 1
    for splits in (1, 2):
        out = kernels.paged_decode(query, key_cache, value_cache, table, length, 1.0, splits)
        _expect(out, weight, f"decode in {splits} splits")
    rows = kernels.PrefillRows.of(
        np.array([0]), np.array([2]), np.array([0]), np.zeros((1, 1)), device
    )
    out = torch.zeros(2, 1, 16, dtype=dtype, device=device)
    kernels.paged_prefill(out, keys.clone(), key_cache, value_cache, rows, 1.0)
    _expect(out[0], 0.0, "prefill")  # token 0 sees only itself, value 0
    _expect(out[1], weight, "prefill")


def _expect(out: torch.Tensor, value: float, what: str) -> None:
    if not torch.allclose(out.float().cpu(), torch.full(out.shape, value), atol=1e-2):
        raise RuntimeError(f"the {what} kernel gave a wrong answer")


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


class TritonPagedAttention(InPlaceDecodeAttention):
    name = "triton"

    def __init__(self) -> None:
        if not available():
            raise RuntimeError(
                "the triton attention backend needs the triton package; "
                "use --attention-backend torch"
            )
        self._kernels = _kernels()

    @classmethod
    def takes(cls, features: LayerAttention) -> bool:
        """A sliding window (both kernels start each row's keys at its window) and sinks (each
        head's joins its softmax); not soft caps."""
        return features.softcap is None

    def _prefill_work(self, batch: InputBatch, rows: np.ndarray, kv_cache: KVCache) -> Any:
        return self._kernels.PrefillRows.of(
            batch.query_starts[rows],
            batch.query_lens[rows],
            batch.context_lens[rows],
            batch.block_table[rows],
            kv_cache.device,
        )

    def _prefill_rows(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        metadata: TorchPagedMetadata,
        out: torch.Tensor,
        features: LayerAttention | None = None,
    ) -> None:
        """Every multi-token row in one launch, over K/V as the cache holds them (but those whose
        image tokens see past themselves, which take the torch path)."""
        assert isinstance(metadata, InPlaceMetadata)
        cache = metadata.kv_cache
        if metadata.prefill_rows is not None:
            self._kernels.paged_prefill(
                out,
                query,
                cache.key(layer),
                cache.value(layer),
                metadata.prefill_rows,
                scale,
                cache.layer_scales(layer),
                window=window_of(features),
                sinks=features.sinks if features is not None else None,
            )
        self._prefill_spans(
            layer, query, key, value, scale, metadata, out, features, limited_only=True
        )

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
        assert not softcap, "the Triton kernels take windows and sinks, not soft caps (`takes`)"
        return self._kernels.paged_decode(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            scale,
            kv_scales=kv_scales,
            window=window,
            sinks=sinks,
        )

    def _store(
        self,
        cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        keys, values, scales = cache.key(layer), cache.value(layer), cache.layer_scales(layer)
        self._kernels.store_kv(key, value, keys, values, slot_mapping, scales)


def _kernels() -> ModuleType:
    from engine.kernels.triton import paged_attention as triton_kernels

    return triton_kernels
