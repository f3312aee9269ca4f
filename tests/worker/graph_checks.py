"""What the graph tests run: prompts of mixed lengths whose rows finish at different steps, and
the check that the engine's greedy tokens equal transformers' generate."""

from __future__ import annotations

import random

from engine.core.sampling_params import SamplingParams
from tests.helpers import reference_greedy, run_all, tiny_llama, tokens_of


def greedy(i: int) -> SamplingParams:
    """Different lengths, so rows finish at different steps and batches shrink."""
    return SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 320) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def check_greedy(core, count: int) -> None:
    model = tiny_llama().to(core.runner.device)
    outputs = run_all(core, prompts(count), [greedy(i) for i in range(count)])
    for i, prompt in enumerate(prompts(count)):
        expected = reference_greedy(model, prompt, greedy(i).max_tokens)
        assert tokens_of(outputs[f"req-{i}"]) == expected, f"prompt {i} differs"
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def spy_padding(graphs) -> list[tuple[int, int]]:
    """(rows or tokens, padded size) of every step `graphs` (decode or piecewise) ran."""
    seen: list[tuple[int, int]] = []
    fill = graphs._fill

    def spy(batch, input_ids, count, size):
        seen.append((count, size))
        fill(batch, input_ids, count, size)

    graphs._fill = spy
    return seen
