"""Speculative decoding over models that keep recurrent states: a step that verifies drafts runs
each request's rows in waves, each row after the first from the state of the row before in a
borrowed slot, and the request keeps the state of its last kept row. Whatever the drafts, the
greedy tokens are transformers' and a seeded request's are those it writes without drafts, for
LFM2's convolutions, Qwen3.5's Gated DeltaNet, Granite 4's Mamba2 and Falcon-Mamba's Mamba1, under
chunked prefill and preemption; every borrowed slot comes back, and drafts borrow none a waiting
request needs."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import SpeculativeConfig
from engine.kv.state_slots import StateSlots
from engine.parallel.mixer_shares import attends
from tests.core.test_speculation import ScriptedDrafter
from tests.core.test_step_isolation import fail_after_the_forward, run_to_end
from tests.helpers import reference_greedy, run_all, tiny_core, tokens_of
from tests.models import test_granite_hybrid, test_lfm2, test_mamba, test_qwen3_5
from tests.models.recurrent import prompts
from tests.scheduler_utils import create_request, create_scheduler, fake_runner_output, step

MAX_NEW = 12
DRAFTS = 3
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KINDS = {
    "lfm2": test_lfm2.build,
    "qwen3.5": lambda: test_qwen3_5.build("dense"),
    "granite-4": lambda: test_granite_hybrid.build("experts"),
    "falcon-mamba": lambda: test_mamba.build("falcon_mamba"),
}


def speculating_core(model: Any, **options: Any) -> EngineCore:
    """An engine core over `model` with too few blocks for every prompt at once and a small
    token budget, speculating `DRAFTS` tokens a step."""
    shape: dict[str, Any] = dict(num_blocks=24, max_model_len=96, max_num_batched_tokens=12)
    shape |= dict(max_num_seqs=4, speculative=SpeculativeConfig(DRAFTS, 1, 1))
    core, _ = tiny_core(model, **(shape | options))
    return core


def reference(model: Any, prompt: list[int]) -> list[int]:
    attention = "sdpa" if attends(model.config) else test_mamba.ATTENTION
    return reference_greedy(model, prompt, MAX_NEW, attention)


def assert_every_slot_back(core: EngineCore) -> None:
    blocks = core.scheduler.block_manager
    states = core.runner.kv_cache.states
    assert states is not None and blocks.state_slots is not None
    assert blocks.num_used_blocks == 0
    assert blocks.state_slots.num_free == states.num_slots
    blocks.check_invariants()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_tokens_are_transformers_whatever_the_drafts_keep(kind):
    """Every third draft is wrong: steps keep none, some or all of their drafts, and each
    request's states follow only the tokens it kept."""
    model = KINDS[kind]()
    truths = {f"req-{i}": reference(model, p) for i, p in enumerate(prompts())}
    core = speculating_core(model)
    core.drafter = ScriptedDrafter(truths, 3, DRAFTS, limit=64)  # every step, not as timed
    outputs = run_all(core, prompts(), GREEDY)
    assert {key: tokens_of(parts) for key, parts in outputs.items()} == truths
    drafts = core.take_stats().drafts
    assert 0 < drafts.num_accepted_tokens < drafts.num_draft_tokens
    assert core.scheduler.num_preemptions > 0
    assert_every_slot_back(core)


def test_a_seeded_request_writes_the_same_tokens_with_drafts_as_without():
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=MAX_NEW, ignore_eos=True)
    model = KINDS["qwen3.5"]()
    plain, _ = tiny_core(model, max_num_seqs=4)
    truths = {key: tokens_of(parts) for key, parts in run_all(plain, prompts(), params).items()}
    core = speculating_core(model)
    core.drafter = ScriptedDrafter(truths, 2, DRAFTS, limit=64)
    outputs = run_all(core, prompts(), params)
    assert {key: tokens_of(parts) for key, parts in outputs.items()} == truths
    assert core.take_stats().drafts.num_accepted_tokens > 0
    assert_every_slot_back(core)


def test_drafts_borrow_only_the_slots_no_waiting_request_needs():
    """Three slots: one running request's, one for the waiting request, one to lend; the
    running request verifies one of its three drafts, and the lent slot comes back when the
    step ends."""
    scheduler = create_scheduler(max_num_seqs=1)
    slots = scheduler.block_manager.state_slots = StateSlots(3)
    running = create_request("running", 4, max_tokens=8)
    scheduler.add_request(running)
    step(scheduler)
    scheduler.add_request(create_request("waiting", 4))
    running.draft_token_ids = [5, 6, 7]
    output = scheduler.schedule()
    (item,) = output.scheduled
    assert item.drafts == [5] and len(item.draft_slots) == 1
    assert item.draft_slots[0] != running.state_slot and slots.num_free == 1
    scheduler.update_from_output(output, fake_runner_output(output))
    assert slots.num_free == 2
    scheduler.check_invariants()


def served(core: EngineCore, prompt: list[int]) -> tuple[list[int], int]:
    """The greedy tokens of `prompt` served alone, and the prompt tokens it found cached."""
    hits = core.scheduler.prefix_cache_hits
    out = tokens_of(run_all(core, [prompt], GREEDY)["req-0"])
    return out, core.scheduler.prefix_cache_hits - hits


def test_a_later_turn_resumes_from_the_states_kept_before_the_drafts():
    """Steps that verify drafts keep no snapshot (where their drafts end is known only once
    they are verified); the others on the grid do, and the next turn resumes from the last (past
    the prompt's, at 32) with transformers' tokens."""
    model = KINDS["qwen3.5"]()
    core = speculating_core(model, num_blocks=64, mamba_block_size=8)
    first = prompts()[5][:37]
    # Drafts for the first ten tokens, then none (not as the measured gate decides): which
    # steps keep snapshots, and so where the next turn resumes, must not depend on the
    # machine's speed.
    truth = {"req-0": reference(model, first)[:10]}
    drafter = core.drafter = ScriptedDrafter(truth, 3, DRAFTS, limit=64)
    answer, hits = served(core, first)
    assert answer == reference(model, first) and hits == 0
    second = first + answer + prompts()[4][:5]
    drafter.continuations = {"req-0": reference(model, second)[:10]}
    out, hits = served(core, second)
    assert out == reference(model, second) and hits > 32
    assert core.take_stats().drafts.num_accepted_tokens > 0
    assert_every_slot_back(core)


def test_the_states_hold_slots_for_each_request_s_drafts_and_snapshots_for_its_own():
    """`--max-num-seqs` 4 and 3 drafts a step: 16 slots; the snapshots of prefix caching, one a
    request's slot, 4."""
    core = speculating_core(KINDS["lfm2"]())
    states = core.runner.kv_cache.states
    assert states is not None
    assert (states.num_slots, states.num_snapshots) == (16, 4)


def test_a_failed_verifying_step_recomputes_the_others_and_lends_every_slot_back(
    monkeypatch, caplog
):
    """A step that verifies drafts fails after the forward (its rows' states, lent slots and
    all, already written): the culprit fails, the others are recomputed from their tokens and end
    with transformers' tokens, and every slot comes back."""
    model = KINDS["qwen3.5"]()
    truths = {f"r{i}": reference(model, p) for i, p in enumerate(prompts()[:4])}
    spec = SpeculativeConfig(DRAFTS, 1, 1, disable_by_batch_size=64)  # drafts every step
    core = speculating_core(model, num_blocks=64, speculative=spec)
    core.drafter = ScriptedDrafter(truths, 3, DRAFTS, limit=64)
    fail_after_the_forward(core, monkeypatch, "r1", len(prompts()[1]) + 2)
    for i, prompt in enumerate(prompts()[:4]):
        core.add_request(f"r{i}", prompt, GREEDY)
    with caplog.at_level(logging.WARNING, logger="engine.core.engine_core"):
        outputs = run_to_end(core)
    assert outputs["r1"][-1].finish_reason == "error"
    for request_id in ("r0", "r2", "r3"):
        assert tokens_of(outputs[request_id]) == truths[request_id]
    assert "are recomputed: their recurrent states may have advanced" in caplog.text
    assert core.take_stats().drafts.num_drafts > 0
    assert_every_slot_back(core)
