"""Greedy tokens from the engine equal transformers' `generate(do_sample=False)`."""

from __future__ import annotations

import random
from functools import lru_cache

import pytest

from engine.core.sampling_params import SamplingParams
from tests.conftest import TRITON_DEVICE, needs_triton
from tests.helpers import reference_greedy, run_all, tiny_core, tiny_llama, tokens_of

MAX_NEW = 12
PROMPT_LENGTHS = (1, 3, 7, 12, 20, 33, 5, 47, 16, 2)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in PROMPT_LENGTHS]


@lru_cache(maxsize=2)
def references(device: str) -> tuple[tuple[int, ...], ...]:
    model = tiny_llama().to(device)
    return tuple(tuple(reference_greedy(model, p, MAX_NEW)) for p in prompts())


def record_chunking(core) -> list[bool]:
    """Spy on the scheduler: one flag per step, True when some prefill was split."""
    flags: list[bool] = []
    schedule = core.scheduler.schedule

    def spy():
        output = schedule()
        flags.append(any(not item.completes_sequence for item in output.scheduled))
        return output

    core.scheduler.schedule = spy
    return flags


def check_greedy(device: str, **core_options) -> tuple[object, list[bool]]:
    """Run the prompts greedily and compare; return the core and its per-step chunking flags."""
    core, _ = tiny_core(tiny_llama(), device=device, **core_options)
    chunked_steps = record_chunking(core)
    outputs = run_all(core, prompts(), GREEDY)
    for i, expected in enumerate(references(device)):
        assert tokens_of(outputs[f"req-{i}"]) == list(expected), f"prompt {i} differs"
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    return core, chunked_steps


def test_concurrent_prompts_match_generate(device):
    core, chunked = check_greedy(device)
    assert core.scheduler.num_preemptions == 0
    assert not any(chunked)


def test_match_generate_under_preemption(device):
    # 24 blocks of 4 tokens cannot hold ten growing sequences at once.
    core, _ = check_greedy(device, num_blocks=24, max_model_len=64)
    assert core.scheduler.num_preemptions > 0


def test_match_generate_with_chunked_prefill_forced(device):
    core, chunked = check_greedy(device, max_num_batched_tokens=6)
    assert core.scheduler.num_preemptions == 0
    assert sum(chunked) > 10


def test_match_generate_with_preemption_and_chunking_together(device):
    core, chunked = check_greedy(device, num_blocks=20, max_model_len=64, max_num_batched_tokens=10)
    assert core.scheduler.num_preemptions > 0 and any(chunked)


def test_match_generate_without_chunked_prefill(device):
    _, chunked = check_greedy(
        device, max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=64
    )
    assert not any(chunked)


@pytest.mark.parametrize("block_size", [1, 16])
def test_match_generate_with_other_block_sizes(block_size):
    check_greedy("cpu", block_size=block_size)


@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=needs_triton)])
def test_each_attention_backend_matches_generate(backend):
    """`triton` runs on the GPU where there is one, else in Triton's interpreter."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    core, _ = check_greedy(
        device,
        num_blocks=24,
        max_model_len=64,
        max_num_batched_tokens=10,
        attention_backend=backend,
    )
    assert core.runner.backend.name == backend
    assert core.scheduler.num_preemptions > 0
