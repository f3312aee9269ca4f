"""Paged attention for the CPU: decode rows and prefill chunks go through Conveyor's C++ kernels
(`csrc/attention/paged_decode.cpp`, `csrc/attention/paged_prefill.cpp`), which read K/V in place
from the cache blocks. A step's prefill chunks attend in one call per layer, written straight into
the layer's output, and new K/V are stored by one op per layer. A bf16 model's prompt chunks over a
bf16 cache attend in bf16 dot products, as torch's flash attention computes a bf16 model's (query
rows and softmax weights rounded to bf16, sums and softmax in fp32), where the CPU has AVX-512
BF16. A step of decode rows only can also run whole layers as one op each (`decode_step`,
`csrc/fused_decode/decode_layer.cpp`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.backend import (
    AttentionMetadata,
    DecodeStep,
    LayerAttention,
    softcap_of,
    window_of,
)
from engine.attention.in_place import InPlaceDecodeAttention, InPlaceMetadata
from engine.attention.torch_paged import TorchPagedMetadata, _to
from engine.kernels.cpu import ops as cpu_ops
from engine.kv.kv_cache import KVCache
from engine.worker.input_batch import InputBatch

# What the fused decode layer and the prefill kernel read (and store) under fp32 compute.
_FUSED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2)


@dataclass(slots=True)
class PrefillRows:
    """A step's prefill chunks as the prefill kernel takes them: each one's first query row,
    its rows, the tokens cached before it and its block ids (int64)."""

    starts: torch.Tensor
    lens: torch.Tensor
    contexts: torch.Tensor
    table: torch.Tensor


class CpuPagedAttention(InPlaceDecodeAttention):
    name = "cpu"
    # The kernels read an fp8 (e5m2) cache as the top bytes of fp16, unscaled (as vLLM's CPU).
    takes_kv_scales = False

    def __init__(self, model_dtype: torch.dtype = torch.float32) -> None:
        if not cpu_ops.has("attention"):
            raise RuntimeError(
                "the cpu attention backend needs its C++ kernel, which did not "
                "build here; use --attention-backend torch"
            )
        self.bf16_prompts = model_dtype == torch.bfloat16 and cpu_ops.bf16_prefill_available()

    @classmethod
    def takes(cls, features: LayerAttention) -> bool:
        """All of them: its decode and prompt kernels start each row at its window, cap the
        scores and add the sinks to each softmax."""
        return True

    def _prefill_work(self, batch: InputBatch, rows: np.ndarray, kv_cache: KVCache) -> PrefillRows:
        return _kernel_rows(batch, rows, kv_cache.block_size, kv_cache.device)

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
        # Caches here are never scaled (`takes_kv_scales`): the scales are 1.0.
        return cpu_ops.paged_decode(
            query, key_cache, value_cache, block_table, seq_lens, scale, window, softcap, sinks
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
        """Prefill chunks in one kernel call over K/V already stored, read in place: fresh
        prompts and chunks after cached tokens alike, with the layer's window, score cap and
        sinks, written straight into `out`. Shapes the kernel does not take (head dims not a
        multiple of 16, a 16-bit model) and chunks whose image tokens see past themselves keep
        the torch path."""
        assert isinstance(metadata, InPlaceMetadata)
        rows, cache = metadata.prefill_rows, metadata.kv_cache
        if rows is None or not _kernel_takes(query, cache):
            super()._prefill_rows(layer, query, key, value, scale, metadata, out, features)
            return
        bf16 = self.bf16_prompts and cache.spec.dtype == torch.bfloat16
        cpu_ops.paged_prefill_rows(
            query,
            cache.key(layer),
            cache.value(layer),
            out,
            rows.starts,
            rows.lens,
            rows.contexts,
            rows.table,
            scale,
            bf16,
            window_of(features),
            softcap_of(features),
            features.sinks if features is not None else None,
        )
        self._prefill_spans(
            layer, query, key, value, scale, metadata, out, features, limited_only=True
        )

    @staticmethod
    def _store(
        cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        if _stores(key, value, cache):
            cpu_ops.store_kv(key, value, cache.key(layer), cache.value(layer), slot_mapping)
        else:
            cache.write(layer, slot_mapping, key, value)

    def decode_step(self, metadata: AttentionMetadata) -> DecodeStep | None:
        assert isinstance(metadata, InPlaceMetadata)
        cache = metadata.kv_cache
        if (
            not metadata.all_decode
            or cache.spec.dtype not in _FUSED_CACHE_DTYPES
            or metadata.decode_block_table is None
            or metadata.decode_seq_lens is None
        ):
            return None
        return DecodeStep(
            kv_cache=cache,
            slot_mapping=metadata.slot_mapping,
            block_table=metadata.decode_block_table,
            seq_lens=metadata.decode_seq_lens,
        )


def _kernel_takes(query: torch.Tensor, cache: KVCache) -> bool:
    return (
        query.dtype == torch.float32
        and query.shape[-1] % 16 == 0
        and cache.spec.dtype in _FUSED_CACHE_DTYPES
    )


def _stores(key: torch.Tensor, value: torch.Tensor, cache: KVCache) -> bool:
    """The store op takes these rows: fp32, heads and dims contiguous, a cache it writes."""
    return cache.spec.dtype in _FUSED_CACHE_DTYPES and all(
        x.dtype == torch.float32 and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
        for x in (key, value)
    )


def _kernel_rows(
    batch: InputBatch, rows: np.ndarray, block_size: int, device: torch.device
) -> PrefillRows:
    seq_lens = batch.context_lens[rows] + batch.query_lens[rows]
    width = int(-(-seq_lens.max() // block_size))
    return PrefillRows(
        starts=_to(batch.query_starts[rows].astype(np.int64), device),
        lens=_to(batch.query_lens[rows].astype(np.int64), device),
        contexts=_to(batch.context_lens[rows].astype(np.int64), device),
        table=_to(batch.block_table[rows, :width].astype(np.int64), device),
    )
