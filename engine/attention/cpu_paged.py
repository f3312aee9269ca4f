"""Paged attention for the CPU: decode rows go through Conveyor's C++ kernel, which reads K/V
in place from the cache blocks; prefill rows keep the pure-torch path. A step of decode rows
only can also run whole layers as one op each (`decode_step`, `csrc/decode_layer.cpp`)."""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.attention.backend import AttentionMetadata, DecodeStep
from engine.attention.in_place import InPlaceDecodeAttention, InPlaceMetadata

# What the fused decode layer stores and reads under its fp32 compute.
_FUSED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2)


class CpuPagedAttention(InPlaceDecodeAttention):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_kernels.load():
            raise RuntimeError("the cpu attention backend needs its C++ kernel, which did not "
                               "build here; use --attention-backend torch")

    def decode_kernel(self, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return cpu_kernels.paged_decode(query, key_cache, value_cache, block_table, seq_lens,
                                       scale)

    def decode_step(self, metadata: AttentionMetadata) -> DecodeStep | None:
        assert isinstance(metadata, InPlaceMetadata)
        cache = metadata.kv_cache
        if (not metadata.all_decode or cache.spec.dtype not in _FUSED_CACHE_DTYPES
                or metadata.decode_block_table is None or metadata.decode_seq_lens is None):
            return None
        return DecodeStep(kv_cache=cache, slot_mapping=metadata.slot_mapping,
                          block_table=metadata.decode_block_table,
                          seq_lens=metadata.decode_seq_lens)
