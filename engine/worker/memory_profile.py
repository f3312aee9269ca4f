"""Sizes the GPU's KV cache by measurement, as vLLM does: the model is loaded and its projections
fused first, then one forward pass at the step's token budget shows the activations' peak, the
CUDA graphs get their own share, and the KV cache takes what is left of `total x utilization`.

`MemoryBreakdown` is plain arithmetic over byte counts, so the sizing is tested with figures
injected; `measure` reads them from the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kv.kv_cache import KVCache, KVCacheSpec
from engine.kv.state_cache import StateCache
from engine.models import CausalLM
from engine.scheduling.scheduler import ScheduledRequest
from engine.worker.input_batch import build_input_batch

GiB = 1024**3
# What a captured graph keeps beyond the shared pool (its own small buffers), per batch size.
GRAPH_OVERHEAD_BYTES = 2 * 1024**2


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """The device's bytes as the KV cache is sized: `kv_cache` is what is left of the allowed
    share once the weights (as the model holds them, fused), the activations' peak, the CUDA graphs
    and memory torch does not hold (the CUDA context, other processes) are counted."""

    total: int
    utilization: float
    weights: int
    activations: int
    graphs: int
    other: int

    @property
    def kv_cache(self) -> int:
        return (
            int(self.total * self.utilization)
            - self.weights
            - self.activations
            - self.graphs
            - self.other
        )

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        return (
            f"GPU memory {gib(self.total)} x {self.utilization:g} = "
            f"{gib(int(self.total * self.utilization))}: weights {gib(self.weights)}, "
            f"activations peak {gib(self.activations)}, CUDA graphs {gib(self.graphs)}, "
            f"other {gib(self.other)}, KV cache {gib(self.kv_cache)}"
        )


def measure(
    device: torch.device,
    utilization: float,
    prefill: Callable[[], None],
    decode: Callable[[], None] | None,
    graph_count: int,
) -> MemoryBreakdown:
    """Read the breakdown from the device: what torch holds now is the weights; the `prefill`
    pass at the step's token budget peaks above that by its activations. Captured graphs share
    one pool as large as the peak of their largest batch (the `decode` pass), plus a little
    each."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    total, other = _total_and_other(device)
    weights = torch.cuda.memory_allocated(device)
    activations = _peak_above(device, weights, prefill)
    graphs = 0
    if decode is not None and graph_count:
        graphs = _peak_above(device, weights, decode) + graph_count * GRAPH_OVERHEAD_BYTES
    return MemoryBreakdown(total, utilization, weights, activations, graphs, other)


def allowed_above_allocated(device: torch.device, utilization: float) -> int:
    """What `utilization` of the device allows beyond what torch holds now and what it does not
    hold (the CUDA context, other processes): before the cache is sized, the weights."""
    torch.cuda.synchronize(device)
    total, other = _total_and_other(device)
    return max(0, int(total * utilization) - torch.cuda.memory_allocated(device) - other)


def _total_and_other(device: torch.device) -> tuple[int, int]:
    """The device's bytes, and those held by what torch does not hold (the CUDA context, other
    processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total, max(0, total - free - torch.cuda.memory_reserved(device))


def _peak_above(device: torch.device, base: int, run: Callable[[], None]) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return max(0, peak)


def profile_forward(
    model: CausalLM,
    backend: AttentionBackend,
    spec: KVCacheSpec,
    device: torch.device,
    lengths: list[int],
    states: StateCache | None = None,
) -> Callable[[], None]:
    """A function that runs one forward pass over dummy prompts of these lengths, as a step
    would, the last token of each through the LM head. Its KV cache holds just those tokens and
    counts among the activations; a recurrent model's prompts take the first slots of its
    `states` (each step zeroes a slot as a request starts in it)."""

    @torch.inference_mode()
    def run() -> None:
        blocks = [-(-n // spec.block_size) for n in lengths]
        cache = KVCache(spec, sum(blocks), device)
        cache.states = states
        scheduled, first = [], 0
        for i, (length, count) in enumerate(zip(lengths, blocks, strict=True)):
            request = Request(
                f"profile-{i}",
                [0] * length,
                SamplingParams(max_tokens=1),
                time.monotonic(),
                max_total_tokens=length + 1,
            )
            request.block_ids = list(range(first, first + count))
            request.state_slot = i if states is not None else None
            first += count
            scheduled.append(ScheduledRequest(request, length))
        batch = build_input_batch(scheduled, spec.block_size)
        metadata = backend.build_metadata(batch, cache)
        if states is not None:
            states.begin(batch)
        ids = torch.from_numpy(batch.input_ids).to(device)
        positions = torch.from_numpy(batch.positions).to(device)
        keep = torch.from_numpy(np.asarray(batch.sample_token_indices)).to(device)
        model(ids, positions, metadata, keep)

    return run


def prefill_lengths(tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """A step's token budget as prompts: as few as the context allows (at most `max_num_seqs`),
    of even lengths."""
    count = min(max(1, -(-tokens // max_model_len)), max_num_seqs, tokens)
    base, extra = divmod(min(tokens, count * max_model_len), count)
    return [base + (1 if i < extra else 0) for i in range(count)]
