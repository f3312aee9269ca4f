"""Tensor parallelism over two gloo ranks for the recurrent layers whose states split: Qwen3.5's
and Qwen3-Next's Gated DeltaNet, the Mamba2 mixers of Granite 4, Falcon-H1 and Nemotron-H (each
rank keeps the states of its heads; Nemotron-H's gateless experts in a latent width beside them),
Mamba2's own models, Jamba's and Falcon-Mamba's Mamba1 and LFM2's short convolutions (of their
channels); the tokens are transformers' under chunked prefill and preemption, in turn and
overlapped, from snapshots of the states (prefix caching) that every rank restores and saves, and
with drafts verified, each rank keeping its kept rows' states. A family whose states do not split
is refused before any worker starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig, Mamba2Config
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from engine.core.config import CacheConfig, EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import SpeculativeConfig
from engine.factory import create_engine_core
from engine.parallel.mixer_shares import attends
from engine.parallel.sharding import why_not_shardable
from tests.core.test_engine_greedy import record_chunking
from tests.core.test_speculation import ScriptedDrafter
from tests.helpers import reference_greedy, run_all, tiny_tokenizer, tokens_of
from tests.models import (
    test_falcon_h1,
    test_granite_hybrid,
    test_jamba,
    test_lfm2,
    test_mamba,
    test_nemotron_h,
    test_qwen3_5,
)
from tests.models.recurrent import drawn_mamba2, prompts
from tests.models.test_recurrent_prefix_caching import served, tokens
from tests.parallel.test_tensor_parallel import engine_core

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def granite_one_group() -> Any:
    """A tiny Granite 4 hybrid whose Mamba2 mixers have one group of B and C, which both ranks
    keep (the gated norm's one group of channels across them)."""
    torch.manual_seed(0)
    shape = test_granite_hybrid.SHAPE | dict(mamba_n_groups=1)
    config = GraniteMoeHybridConfig(**shape, num_local_experts=6, num_experts_per_tok=2)
    return drawn_mamba2(AutoModelForCausalLM.from_config(config))


def mamba2_one_group() -> Any:
    """A tiny Mamba2 (its own model, no attention) whose mixers have one group of B and C."""
    torch.manual_seed(0)
    config = Mamba2Config(**test_mamba.SHAPE, num_heads=8, head_dim=16, n_groups=1)
    return drawn_mamba2(AutoModelForCausalLM.from_config(config))


# Each kind's tiny model, and the shape of rank 0's first recurrent state (its place among the
# states): 2 of the 4 value heads' (one key head's), 4 of the 8 Mamba2 heads', or 32 of the 64
# channels.
KINDS = {
    "qwen3.5": (lambda: test_qwen3_5.build("dense"), 1, (2, 8, 12)),
    "qwen3-next": (lambda: test_qwen3_5.build("next"), 1, (2, 8, 12)),
    "granite-4": (granite_one_group, 1, (4, 16, 8)),
    "falcon-h1": (lambda: test_falcon_h1.build("norm-then-gate"), 1, (4, 16, 8)),
    "nemotron-h": (lambda: test_nemotron_h.build("latent"), 1, (4, 16, 8)),
    # 64 of Jamba's 128 Mamba1 channels, 8 state dims each.
    "jamba": (lambda: test_jamba.build("experts"), 1, (64, 8)),
    "mamba2": (mamba2_one_group, 1, (4, 16, 8)),
    "lfm2": (lambda: test_lfm2.build(), 0, (2, 32)),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def saved(request, tmp_path_factory) -> tuple[Any, Path, str]:
    """A tiny model of the kind saved as a checkpoint."""
    model = KINDS[request.param][0]()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return model, folder, request.param


def reference(model: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens (Mamba's own models' on their eager path)."""
    attention = "sdpa" if attends(model.config) else test_mamba.ATTENTION
    return reference_greedy(model, prompt, MAX_NEW, attention)


def config(folder: Path, **options: Any) -> EngineConfig:
    cache = CacheConfig(block_size=4, num_blocks=options.pop("num_blocks", 64), mamba_block_size=8)
    return EngineConfig(
        model=str(folder), dtype="float32", tensor_parallel_size=2, cache=cache, **options
    )


def tight_config(folder: Path, overlap: bool = False) -> EngineConfig:
    """Too few blocks for every prompt at once and a small token budget."""
    return config(
        folder, num_blocks=24, max_model_len=96, max_num_batched_tokens=12, async_scheduling=overlap
    )


def serve_under_pressure(core: EngineCore, model: Any) -> None:
    """`prompts()` served with transformers' tokens, some preempted and some chunked, every block
    and state slot given back."""
    expected = [reference(model, p) for p in prompts()]
    chunked = record_chunking(core)
    outputs = run_all(core, prompts(), GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    assert core.scheduler.num_preemptions > 0 and any(chunked)
    states = core.runner.kv_cache.states
    blocks = core.scheduler.block_manager
    assert states is not None and blocks.state_slots is not None
    assert blocks.num_used_blocks == 0
    assert blocks.state_slots.num_free == states.num_slots


def test_two_ranks_serve_transformers_tokens_and_resume_from_their_snapshots(saved):
    """Under chunked prefill and preemption each rank keeps its share of the states; then a
    later turn resumes at 40, the last point of the snapshots' grid (every 8 tokens) the first
    turn reached: every rank restores its own share's states there, so the tokens stay
    transformers'."""
    model, folder, kind = saved
    with engine_core(tight_config(folder)) as core:
        serve_under_pressure(core, model)
        states = core.runner.kv_cache.states
        assert states is not None
        _, index, share = KINDS[kind]
        assert states.layers[index].shape[1:] == share
        first = tokens(37, seed=1)
        answer, hits = served(core, first)
        assert answer == reference(model, first) and hits == 0
        second = first + answer + tokens(5, seed=2)
        assert served(core, second) == (reference(model, second), 40)


def test_overlapped_steps_across_ranks(tmp_path):
    model = KINDS["granite-4"][0]()
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with engine_core(tight_config(tmp_path, overlap=True)) as core:
        serve_under_pressure(core, model)


@pytest.mark.parametrize(
    ("key_heads", "value_heads", "size", "reason"),
    [
        (3, 6, 2, "its 3 linear attention key heads do not divide by 2"),
        (2, 6, 4, "its 2 linear attention key heads do not divide by 4"),
        (4, 6, 4, "its 6 linear attention value heads do not divide by 4"),
        (2, 4, 2, ""),
    ],
)
def test_linear_attention_heads_that_do_not_divide_are_named(key_heads, value_heads, size, reason):
    shape = test_qwen3_5.SHAPE | dict(
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads
    )
    assert why_not_shardable(Qwen3_5TextConfig(**shape), size) == reason


@pytest.mark.parametrize(
    "build",
    [lambda: test_qwen3_5.build("dense"), lambda: test_mamba.build("falcon_mamba")],
    ids=["qwen3.5", "falcon-mamba"],
)
def test_drafts_verified_across_ranks_leave_each_rank_its_kept_rows_states(build, tmp_path):
    """Every third draft wrong: rank 0 keeps its last kept rows' states at once, the worker
    before its next step; the tokens stay transformers' (Qwen3.5's delta rule and
    Falcon-Mamba's scan, its Mamba1 channels split, each with the decode rows chained in the
    kernel; their convolutions in waves)."""
    model = build()
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    truths = {f"req-{i}": reference(model, p) for i, p in enumerate(prompts())}
    spec = SpeculativeConfig(3, 1, 1)
    with engine_core(config(tmp_path, speculative=spec, max_num_batched_tokens=16)) as core:
        core.drafter = ScriptedDrafter(truths, 3, 3, limit=64)  # every step, not as timed
        outputs = run_all(core, prompts(), GREEDY)
        assert {key: tokens_of(parts) for key, parts in outputs.items()} == truths
        drafts = core.take_stats().drafts
        assert 0 < drafts.num_accepted_tokens < drafts.num_draft_tokens


def test_a_family_whose_states_do_not_split_is_refused_before_any_worker_starts(
    tmp_path, monkeypatch
):
    test_mamba.build().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    monkeypatch.setattr(
        "engine.parallel.workers.WorkerPool.start",
        lambda *args: pytest.fail("a worker started"),
    )
    monkeypatch.setattr("engine.factory.STATES_SPLIT", frozenset())
    with pytest.raises(ValueError, match="tensor parallelism does not split recurrent"):
        create_engine_core(config(tmp_path))
