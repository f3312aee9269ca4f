"""The GPU's KV cache sized by measurement: the arithmetic with figures injected, the profiling
pass on the CPU, and the device asked for made current."""

from __future__ import annotations

import pytest
import torch

from engine import factory, model_build
from engine.core.config import CacheConfig, EngineConfig
from engine.worker import memory_profile
from engine.worker.memory_profile import GiB, MemoryBreakdown, prefill_lengths
from tests.helpers import tiny_core, tiny_llama


def test_the_kv_cache_gets_what_is_left_of_the_allowed_share():
    # An 8B model in bf16 on an 80 GB card: 16 GB of weights and 9 GB of fused copies.
    breakdown = MemoryBreakdown(
        total=80 * GiB,
        utilization=0.9,
        weights=25 * GiB,
        activations=3 * GiB,
        graphs=GiB // 2,
        other=GiB // 2,
    )
    assert breakdown.kv_cache == int(72 * GiB) - 29 * GiB
    line = breakdown.describe()
    for figure in (
        "80.00 GiB x 0.9 = 72.00 GiB",
        "weights 25.00 GiB",
        "activations peak 3.00 GiB",
        "CUDA graphs 0.50 GiB",
        "other 0.50 GiB",
        "KV cache 43.00 GiB",
    ):
        assert figure in line


def test_a_model_too_large_for_the_share_leaves_no_cache():
    breakdown = MemoryBreakdown(
        total=48 * GiB,
        utilization=0.9,
        weights=41 * GiB,
        activations=2 * GiB,
        graphs=GiB,
        other=GiB,
    )
    assert breakdown.kv_cache < 0


class FakeCuda:
    """The device's counters as torch.cuda reports them, driven by the test."""

    def __init__(self, total: int, held: int, other: int) -> None:
        self.total, self.allocated, self.other = total, held, other
        self.peak = held

    def allocate(self, n: int) -> None:
        self.peak = max(self.peak, self.allocated + n)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(
            cuda,
            "mem_get_info",
            lambda device=None: (self.total - self.allocated - self.other, self.total),
        )
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(
            cuda,
            "reset_peak_memory_stats",
            lambda device=None: setattr(self, "peak", self.allocated),
        )


def test_measure_reads_weights_peaks_and_graphs(monkeypatch):
    fake = FakeCuda(total=80 * GiB, held=25 * GiB, other=GiB)
    fake.install(monkeypatch)
    breakdown = memory_profile.measure(
        torch.device("cuda"),
        0.9,
        prefill=lambda: fake.allocate(3 * GiB),
        decode=lambda: fake.allocate(GiB // 4),
        graph_count=20,
    )
    assert breakdown.weights == 25 * GiB and breakdown.other == GiB
    assert breakdown.activations == 3 * GiB
    assert breakdown.graphs == GiB // 4 + 20 * memory_profile.GRAPH_OVERHEAD_BYTES
    assert breakdown.kv_cache == int(72 * GiB) - 29 * GiB - breakdown.graphs


def test_eager_steps_reserve_nothing_for_graphs(monkeypatch):
    fake = FakeCuda(total=24 * GiB, held=2 * GiB, other=0)
    fake.install(monkeypatch)
    breakdown = memory_profile.measure(
        torch.device("cuda"), 0.5, lambda: fake.allocate(GiB), None, graph_count=0
    )
    assert breakdown.graphs == 0 and breakdown.kv_cache == 9 * GiB


@pytest.mark.parametrize(
    ("tokens", "context", "seqs", "lengths"),
    [
        (2048, 4096, 128, [2048]),
        (2048, 512, 128, [512] * 4),
        (2050, 1024, 128, [684, 683, 683]),
        (2048, 100, 8, [100] * 8),
        (3, 512, 8, [3]),
    ],
)
def test_the_token_budget_as_prompts(tokens, context, seqs, lengths):
    assert prefill_lengths(tokens, context, seqs) == lengths


def test_the_profiling_pass_runs_a_step_at_the_budget():
    core, _ = tiny_core(tiny_llama())
    runner = core.runner
    seen: list[tuple[int, int]] = []
    model = runner.model

    def recording(ids, positions, metadata, keep):
        seen.append((ids.shape[0], keep.shape[0]))
        return model(ids, positions, metadata, keep)

    spec = runner.kv_cache.spec
    for lengths in (prefill_lengths(300, 128, 64), [1] * 16):
        memory_profile.profile_forward(
            recording, runner.backend, spec, torch.device("cpu"), lengths
        )()
    assert seen == [(300, 3), (16, 16)]


def test_the_cache_is_sized_after_the_projections_are_fused(monkeypatch):
    events: list[str] = []
    real_build, real_blocks = model_build.build_causal_lm, factory._num_blocks
    monkeypatch.setattr(
        model_build, "build_causal_lm", lambda *a: events.append("model built") or real_build(*a)
    )
    monkeypatch.setattr(
        factory, "_num_blocks", lambda *a: events.append("cache sized") or real_blocks(*a)
    )
    tiny_core(tiny_llama(), num_blocks=None, kv_cache_memory=16 << 20)
    assert events == ["model built", "cache sized"]


@pytest.mark.parametrize(("budget_blocks", "expected"), [(64, 64), (-3, None)])
def test_the_gpu_cache_takes_the_measured_budget(monkeypatch, budget_blocks, expected):
    spec = factory.KVCacheSpec.from_hf_config(tiny_llama().config, torch.float32, 16)
    monkeypatch.setattr(factory, "_cuda_kv_budget", lambda *a: budget_blocks * spec.bytes_per_block)
    config = EngineConfig(cache=CacheConfig(block_size=16))
    if expected is None:
        with pytest.raises(ValueError, match="holds no block"):
            factory._num_blocks(config, spec, torch.device("cuda"), None, None, 512)
    else:
        assert factory._num_blocks(config, spec, torch.device("cuda"), None, None, 512) == expected


def test_a_cache_given_in_bytes_is_taken_as_given_without_profiling(monkeypatch):
    """vLLM's --kv-cache-memory-bytes: on CUDA, the budget instead of the measured share."""
    spec = factory.KVCacheSpec.from_hf_config(tiny_llama().config, torch.float32, 16)

    def measured(*_args: object) -> int:
        raise AssertionError("the given budget needs no profiling pass")

    monkeypatch.setattr(factory, "_cuda_kv_budget", measured)
    config = EngineConfig(
        cache=CacheConfig(block_size=16, kv_cache_memory=40 * spec.bytes_per_block)
    )
    for device in ("cuda", "cpu"):
        assert factory._num_blocks(config, spec, torch.device(device), None, None, 512) == 40


def test_the_device_asked_for_becomes_current(monkeypatch):
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    factory.use_device(torch.device("cuda:3"))
    factory.use_device(torch.device("cpu"))
    assert chosen == [3]


def test_a_recurrent_models_slots_fit_half_of_what_the_gpu_allows(monkeypatch):
    """On a GPU the states are held before the profiling pass: as many slots as half of what
    utilization allows above the weights holds, at most `--max-num-seqs`."""
    fake = FakeCuda(total=80 * GiB, held=60 * GiB, other=GiB)
    fake.install(monkeypatch)
    cuda = torch.device("cuda")
    assert memory_profile.allowed_above_allocated(cuda, 0.9) == int(72 * GiB) - 61 * GiB
    slot = 150 * 2**20  # a large Qwen3.5's states a request
    config = EngineConfig(model="m", max_num_seqs=256)
    half = (int(72 * GiB) - 61 * GiB) // 2
    assert factory._state_slot_count(config, slot, cuda) == half // slot < 256
    roomy = EngineConfig(model="m", max_num_seqs=16)
    assert factory._state_slot_count(roomy, slot, cuda) == 16
    fake.allocated = 71 * GiB
    with pytest.raises(ValueError, match="--kv-cache-memory or --gpu-memory-utilization"):
        factory._state_slot_count(config, slot, cuda)
