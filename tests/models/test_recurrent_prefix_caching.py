"""Prefix caching for models whose layers keep recurrent states (LFM2, Qwen3.5, Granite 4,
Nemotron-H, Falcon-H1, Jamba, Mamba's own models): a request resumes from a cached prefix only
where a snapshot of the states after it is kept (every `mamba_block_size` tokens a step ends at;
a prompt's chunk is cut at the last such point before its last token), its states copied from
that snapshot; its tokens stay transformers' in turn and overlapped, with few snapshots and
under chunked prefill and preemption."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from server.cli import build_parser, engine_config
from tests.helpers import reference_greedy, run_all, tiny_core, tiny_tokenizer, tokens_of
from tests.models import (
    test_falcon_h1,
    test_granite_hybrid,
    test_jamba,
    test_lfm2,
    test_mamba,
    test_nemotron_h,
    test_qwen3_5,
)

FAMILIES = {
    "falcon_h1": test_falcon_h1,
    "lfm2": test_lfm2,
    "mamba": test_mamba,
    "qwen3_5": test_qwen3_5,
    "granite_hybrid": test_granite_hybrid,
    "jamba": test_jamba,
    "nemotron_h": test_nemotron_h,
}
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
GRID = 8  # tokens between snapshots (two blocks of 4)


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 320) for _ in range(count)]


def served(core, prompt: list[int]) -> tuple[list[int], int]:
    """The greedy tokens of `prompt` served alone, and the prompt tokens it found cached."""
    hits = core.scheduler.prefix_cache_hits
    out = tokens_of(run_all(core, [prompt], GREEDY)["req-0"])
    return out, core.scheduler.prefix_cache_hits - hits


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_later_turn_resumes_where_the_last_one_left_its_states(family, overlap):
    """Turn two's prompt is turn one's prompt and answer and more: it resumes at 40, the last
    point of the grid that turn one's decode steps reached (37 prompt tokens, 9 answer tokens
    computed), not at 48 (a cached block, but no states kept after it)."""
    model = FAMILIES[family].build()
    attention = getattr(FAMILIES[family], "ATTENTION", "sdpa")  # Mamba's own: eager alone
    core, _ = tiny_core(model, mamba_block_size=GRID, async_scheduling=overlap)
    first = tokens(37, seed=1)
    answer, hits = served(core, first)
    assert answer == reference_greedy(model, first, MAX_NEW, attention) and hits == 0
    second = first + answer + tokens(5, seed=2)
    out, hits = served(core, second)
    assert out == reference_greedy(model, second, MAX_NEW, attention)
    assert hits == 40
    blocks = core.scheduler.block_manager
    assert blocks.snapshots is not None and blocks.snapshots.num_kept >= 3
    assert blocks.state_slots is not None and blocks.state_slots.num_free == 64


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_the_same_prompt_again_resumes_from_its_chunk_cut_at_the_grid(family):
    """A 37-token prompt fits one step, but its chunk stops at 32, the last point of the grid
    before its last token, so that the states there are kept: the same prompt again resumes
    from them."""
    model = FAMILIES[family].build()
    core, _ = tiny_core(model, mamba_block_size=GRID)
    prompt = tokens(37, seed=3)
    expected = reference_greedy(model, prompt, MAX_NEW)
    assert served(core, prompt) == (expected, 0)
    assert served(core, prompt) == (expected, 32)


def test_with_few_snapshots_the_oldest_go_and_their_prompts_are_computed_again():
    """Two snapshots for four prompts: the first prompt's are overwritten, so it runs whole
    again, with the same tokens; the last prompt's are still kept."""
    model = test_qwen3_5.build()
    core, _ = tiny_core(model, mamba_block_size=GRID, max_num_seqs=2)
    prompts = [tokens(21, seed=10 + i) for i in range(4)]
    for prompt in prompts:
        assert served(core, prompt)[1] == 0
    assert served(core, prompts[0]) == (reference_greedy(model, prompts[0], MAX_NEW), 0)
    assert served(core, prompts[0])[1] == 16
    core.scheduler.check_invariants()


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_requests_sharing_a_prefix_under_chunking_and_preemption(overlap):
    """Prompts that share a 24-token start, served in waves with too few blocks and a small
    token budget: later waves resume from the shared start, and every request gets
    transformers' tokens."""
    model = test_nemotron_h.build()
    core, _ = tiny_core(
        model,
        mamba_block_size=GRID,
        num_blocks=24,
        max_num_batched_tokens=12,
        max_model_len=96,
        async_scheduling=overlap,
    )
    shared = tokens(24, seed=20)
    waves = [[shared + tokens(n, seed=30 + n + 7 * w) for n in (3, 9, 14, 20)] for w in range(3)]
    for wave in waves:
        outputs = run_all(core, wave, GREEDY)
        for i, prompt in enumerate(wave):
            assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, MAX_NEW)
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.prefix_cache_hits >= 8 * 24
    blocks = core.scheduler.block_manager
    assert blocks.num_used_blocks == 0 and blocks.state_slots.num_free == 64


def test_resetting_the_prefix_cache_forgets_the_snapshots():
    model = test_granite_hybrid.build()
    core, _ = tiny_core(model, mamba_block_size=GRID)
    prompt = tokens(37, seed=5)
    expected = reference_greedy(model, prompt, MAX_NEW)
    served(core, prompt)
    blocks = core.scheduler.block_manager
    assert blocks.snapshots is not None and blocks.snapshots.num_kept > 0
    assert blocks.reset_cache() > 0 and blocks.snapshots.num_kept == 0
    assert served(core, prompt) == (expected, 0)


def test_without_prefix_caching_or_off_the_grid_nothing_is_kept(tmp_path):
    """No prefix caching: no snapshots, and a prompt is never cut. The grid is vLLM's
    `--mamba-block-size`; one that is not a multiple of the block size is refused at start-up."""
    model = test_lfm2.build()
    core, info = tiny_core(model, enable_prefix_caching=False, mamba_block_size=GRID)
    assert not info.enable_prefix_caching and core.scheduler.block_manager.snapshots is None
    assert core.runner.kv_cache.states.num_snapshots == 0
    prompt = tokens(37, seed=4)
    assert served(core, prompt) == served(core, prompt)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    args = build_parser().parse_args(["serve", "--mamba-block-size", "6", "--block-size", "4"])
    cache = replace(engine_config(args).cache, num_blocks=16)
    assert cache.mamba_block_size == 6
    with pytest.raises(ValueError, match="not a multiple of the block size 4"):
        create_engine_core(EngineConfig(model=str(tmp_path), cache=cache))
