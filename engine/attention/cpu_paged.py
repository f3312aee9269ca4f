"""Paged attention for the CPU: decode rows and prefill chunks go through Conveyor's C++
kernels (`csrc/paged_decode.cpp`, `csrc/paged_prefill.cpp`), which read K/V in place from the
cache blocks. A step of decode rows only can also run whole layers as one op each
(`decode_step`, `csrc/decode_layer.cpp`)."""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.attention.backend import AttentionMetadata, DecodeStep
from engine.attention.in_place import InPlaceDecodeAttention, InPlaceMetadata
from engine.attention.torch_paged import PrefillSpan
from engine.kv_cache import KVCache

# What the fused decode layer and the prefill kernel read (and store) under fp32 compute.
_FUSED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2)


class CpuPagedAttention(InPlaceDecodeAttention):
    name = "cpu"
    prefill_block_ids = True

    def __init__(self) -> None:
        if not cpu_kernels.load():
            raise RuntimeError("the cpu attention backend needs its C++ kernel, which did not "
                               "build here; use --attention-backend torch")

    def decode_kernel(self, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return cpu_kernels.paged_decode(query, key_cache, value_cache, block_table, seq_lens,
                                       scale)

    def _prefill(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float, span: PrefillSpan, cache: KVCache) -> torch.Tensor:
        """The chunk's tokens over their sequence's K/V, already stored, read in place: a fresh
        prompt and a chunk after cached tokens alike. Shapes the kernel does not take (head
        dims not a multiple of 16, a 16-bit model) keep the torch path."""
        q = query[span.start:span.end]
        if (q.dtype != torch.float32 or q.shape[-1] % 16
                or cache.spec.dtype not in _FUSED_CACHE_DTYPES):
            return super()._prefill(layer, query, key, value, scale, span, cache)
        assert span.block_ids is not None  # prefill_block_ids: every span carries them
        context = span.seq_len - q.shape[0]
        return cpu_kernels.paged_prefill(q, cache.key(layer), cache.value(layer),
                                         span.block_ids, context, scale)

    def decode_step(self, metadata: AttentionMetadata) -> DecodeStep | None:
        assert isinstance(metadata, InPlaceMetadata)
        cache = metadata.kv_cache
        if (not metadata.all_decode or cache.spec.dtype not in _FUSED_CACHE_DTYPES
                or metadata.decode_block_table is None or metadata.decode_seq_lens is None):
            return None
        return DecodeStep(kv_cache=cache, slot_mapping=metadata.slot_mapping,
                          block_table=metadata.decode_block_table,
                          seq_lens=metadata.decode_seq_lens)
