"""What the tests of models that keep recurrent states share: prompts of many lengths, their
greedy tokens served under chunked prefill and preemption and from a saved checkpoint, checked
against transformers', and a Mamba2 model's random weights drawn so its norms, steps, decays and
skips count."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from engine.core.config import CacheConfig, EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from tests.core.test_engine_greedy import record_chunking
from tests.helpers import reference_greedy, run_all, tiny_core, tiny_tokenizer, tokens_of


def prompts() -> list[list[int]]:
    rng = random.Random(6)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (1, 3, 9, 17, 30, 70, 24)]


def served_under_pressure(model: Any, max_new: int, attention: str = "sdpa") -> EngineCore:
    """The engine core that served `prompts()` greedily from `model` with too few blocks for all
    at once and a small token budget: its tokens equal transformers' (on its `attention`: Mamba's
    own models take `eager` alone), some request was preempted and some prompt chunked, and
    every block and state slot came back."""
    expected = [reference_greedy(model, p, max_new, attention) for p in prompts()]
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


def drawn_mamba2(model: Any) -> Any:
    """`model` (a random Mamba2 hybrid) with its norms' weights about one, its steps' biases and
    skips about zero and its decays' logs spread, so that each counts."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith(("dt_bias", "D")):
                param.normal_(0.0, 1.0)
            elif name.endswith("A_log"):
                param.uniform_(-1.0, 1.5)
    return model.eval()


def check_saved_checkpoint(model: Any, folder: Path, max_new: int, attention: str = "sdpa") -> None:
    """`model` saved to `folder` as a checkpoint serves `prompts()` from it with transformers'
    greedy tokens (on its `attention`)."""
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    config = EngineConfig(
        model=str(folder), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64)
    )
    core, _, _ = create_engine_core(config)
    greedy = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    try:
        outputs = run_all(core, prompts(), greedy)
        tokens = [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))]
        assert tokens == [reference_greedy(model, p, max_new, attention) for p in prompts()]
    finally:
        core.close()
