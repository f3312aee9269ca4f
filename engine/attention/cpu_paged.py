"""Paged attention for the CPU: decode rows go through Conveyor's C++ kernel, which reads K/V
in place from the cache blocks; prefill rows keep the pure-torch path."""

from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.attention.backend import AttentionMetadata, DecodeStep
from engine.attention.in_place import InPlaceDecodeAttention, InPlaceMetadata


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
        if (not metadata.all_decode or cache.spec.dtype != torch.float32
                or metadata.decode_block_table is None or metadata.decode_seq_lens is None):
            return None
        return DecodeStep(kv_cache=cache, slot_mapping=metadata.slot_mapping,
                          block_table=metadata.decode_block_table,
                          seq_lens=metadata.decode_seq_lens)
