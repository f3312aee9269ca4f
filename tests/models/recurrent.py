"""What the tests of models that keep recurrent states share: prompts of many lengths, and their
greedy tokens served under chunked prefill and preemption, checked against transformers'."""

from __future__ import annotations

import random
from typing import Any

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from tests.core.test_engine_greedy import record_chunking
from tests.helpers import reference_greedy, run_all, tiny_core, tokens_of


def prompts() -> list[list[int]]:
    rng = random.Random(6)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (1, 3, 9, 17, 30, 70, 24)]


def served_under_pressure(model: Any, max_new: int) -> EngineCore:
    """The engine core that served `prompts()` greedily from `model` with too few blocks for all
    at once and a small token budget: its tokens equal transformers', some request was preempted
    and some prompt chunked, and every block and state slot came back."""
    expected = [reference_greedy(model, p, max_new) for p in prompts()]
    core, _ = tiny_core(model, num_blocks=24, max_model_len=96, max_num_batched_tokens=12)
    chunked = record_chunking(core)
    greedy = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outputs = run_all(core, prompts(), greedy)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    assert core.scheduler.num_preemptions > 0 and any(chunked)
    blocks = core.scheduler.block_manager
    assert blocks.num_used_blocks == 0
    assert blocks.state_slots is not None and blocks.state_slots.num_free == 64
    return core
