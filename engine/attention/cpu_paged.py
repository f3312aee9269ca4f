"""Paged attention for the CPU: decode rows go through Conveyor's C++ kernel, which reads K/V
in place from the cache blocks; prefill rows keep the pure-torch path."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import cpu_kernel
from engine.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata, _to


@dataclass(slots=True, eq=False)
class CpuPagedMetadata(TorchPagedMetadata):
    decode_seq_lens: torch.Tensor | None = None


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_kernel.load():
            raise RuntimeError("the cpu attention backend needs its C++ kernel, which did not "
                               "build here; use --attention-backend torch")

    @staticmethod
    def metadata_type() -> type[TorchPagedMetadata]:
        return CpuPagedMetadata

    @staticmethod
    def _decode_lengths(meta: TorchPagedMetadata, seq_lens: np.ndarray, span: int,
                        device: torch.device) -> None:
        """The kernel reads each row's length and stops there: no mask."""
        assert isinstance(meta, CpuPagedMetadata)
        meta.decode_seq_lens = _to(seq_lens.astype(np.int64), device)

    @staticmethod
    def _decode(layer: int, query: torch.Tensor, scale: float,
                meta: TorchPagedMetadata) -> torch.Tensor:
        assert isinstance(meta, CpuPagedMetadata) and meta.decode_seq_lens is not None
        cache = meta.kv_cache
        q = query if meta.all_decode else query[meta.decode_tokens]
        return cpu_kernel.paged_decode(q, cache.key(layer), cache.value(layer),
                                       meta.decode_block_table, meta.decode_seq_lens, scale)
