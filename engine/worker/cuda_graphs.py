"""Decode steps on fixed-size inputs, captured once as CUDA graphs and replayed.

A decode step of a small model launches hundreds of small kernels; on a GPU the step is then
bound by Python and launch latency, not by arithmetic, and costs the same for 1 row or 64.
Capturing the model's forward once per padded batch size and replaying it makes a step one
graph launch.

Each step's rows are copied into static input tensors padded to the next captured size. Padded
rows have length 0 and slot -1: the attention kernels skip them, so they read and write no KV
block, and their logits are dropped. Steps with a prefill chunk, prompt logprobs or more rows
than the largest size run eagerly. Without capture (`capture()` not called, or on a CPU) the
same padded path runs eagerly, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import InPlaceDecodeAttention
from engine.kv.kv_cache import KVCache
from engine.models import CausalLM
from engine.worker.input_batch import InputBatch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

PAD_SLOT = -1
# Larger decode batches run eagerly: their launches are a small share of the step, and each
# size captured costs start-up time and graph memory.
MAX_CAPTURE_SIZE = 512


def capture_sizes(
    max_num_seqs: int, chosen: tuple[int, ...] = (), largest: int | None = None
) -> list[int]:
    """The decode batch sizes captured: those `chosen` (vLLM's `cudagraph_capture_sizes`) up
    to `max_num_seqs`; else 1, 2, 4, then every multiple of 8, up to and including
    `max_num_seqs` or `largest` (vLLM's `max_cudagraph_capture_size`; default 512)."""
    if chosen:
        return sorted({n for n in chosen if n <= max_num_seqs} or {max_num_seqs})
    largest = min(max_num_seqs, largest or MAX_CAPTURE_SIZE)
    sizes = [n for n in (1, 2, 4) if n < largest]
    sizes += range(8, largest, 8)
    return sorted({*sizes, largest})


class DecodeGraphs:
    """Static inputs sized for `max_num_seqs` decode rows of up to `max_model_len` tokens."""

    def __init__(
        self,
        model: CausalLM,
        backend: InPlaceDecodeAttention,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        sizes: list[int] | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.sizes = sizes or capture_sizes(max_num_seqs)
        rows, device = self.sizes[-1], kv_cache.device
        self.width = -(-max_model_len // kv_cache.block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), PAD_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(rows, self.width, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(rows, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def supports(self, batch: InputBatch, logits_indices: np.ndarray) -> bool:
        """A step of decode rows only, each sampling its one token, that fits the buffers."""
        rows = len(batch.requests)
        return (
            0 < rows <= self.sizes[-1]
            and batch.num_tokens == rows
            and batch.block_table.shape[1] <= self.width
            and np.array_equal(logits_indices, np.arange(rows))
        )

    @torch.inference_mode()
    def capture(self) -> _POOL_HANDLE | None:
        """One graph per size, largest first, all sharing one memory pool (returned, for
        other graphs that never run at the same time)."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: compiles kernels and settles the allocator
            torch.cuda.synchronize(self.kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.kv_cache.device)
        logger.info(
            "captured decode CUDA graphs for %d batch sizes up to %d in %.1f s",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
        )
        return pool

    def run(self, batch: InputBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits `[rows, vocab]` of a step that `supports` accepts (`input_ids`: its ids on
        the device)."""
        rows = len(batch.requests)
        size = self.sizes[bisect.bisect_left(self.sizes, rows)]
        self._fill(batch, input_ids, rows, size)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:rows]
        graph.replay()
        return self.outputs[size][:rows]

    def _fill(self, batch: InputBatch, input_ids: torch.Tensor, rows: int, size: int) -> None:
        self.input_ids[:rows].copy_(input_ids)
        self.input_ids[rows:size].zero_()
        copy_padded(self.positions, batch.positions, size)
        copy_padded(self.slot_mapping, batch.slot_mapping, size, PAD_SLOT)
        copy_padded(self.seq_lens, batch.seq_lens, size)
        table = batch.block_table
        _copy(self.block_table[:rows, : table.shape[1]], table)

    def _forward(self, size: int) -> torch.Tensor:
        metadata = self.backend.decode_metadata(
            self.kv_cache, self.slot_mapping[:size], self.block_table[:size], self.seq_lens[:size]
        )
        return self.model(
            self.input_ids[:size], self.positions[:size], metadata, self.logits_indices[:size]
        )


def copy_padded(target: torch.Tensor, values: np.ndarray, size: int, fill: int = 0) -> None:
    """Host `values` into the first `size` entries of a static `target`, the rest of those
    `fill`: one transfer, which does not wait for the device."""
    pad = size - len(values)
    _copy(target[:size], np.concatenate([values, np.full(pad, fill)]) if pad else values)


def _copy(target: torch.Tensor, source: np.ndarray) -> None:
    target.copy_(torch.from_numpy(np.ascontiguousarray(source, dtype=np.int64)), non_blocking=True)
