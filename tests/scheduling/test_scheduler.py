from __future__ import annotations

import random

import numpy as np
import pytest

from engine.core.errors import PromptTooLongError
from engine.core.images import ImageInputs
from engine.core.request import FinishReason, RequestStatus
from tests.scheduler_utils import (
    FAKE_TOKEN,
    create_request,
    create_scheduler,
    fake_runner_output,
    scheduled_counts,
    step,
)


def test_admits_waiting_requests_up_to_max_num_seqs():
    scheduler = create_scheduler(max_num_seqs=3)
    for i in range(5):
        scheduler.add_request(create_request(f"r{i}", prompt_len=4))
    output = step(scheduler)
    assert list(scheduled_counts(output)) == ["r0", "r1", "r2"]
    assert scheduler.num_running == 3 and scheduler.num_waiting == 2


def test_token_budget_limits_the_step_and_long_prompts_are_chunked():
    scheduler = create_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(create_request("long", prompt_len=25))
    scheduler.add_request(create_request("short", prompt_len=3))
    counts = [scheduled_counts(step(scheduler)) for _ in range(3)]
    assert counts[0] == {"long": 10}
    assert counts[1] == {"long": 10}
    # The last chunk of 5 leaves room for the short prompt in the same step.
    assert counts[2] == {"long": 5, "short": 3}
    long = scheduler.requests["long"]
    assert long.num_computed_tokens == 25 and long.output_token_ids == [FAKE_TOKEN]


def test_a_long_prefill_threshold_leaves_room_in_each_step_for_other_prompts():
    """vLLM's `long_prefill_token_threshold`: a long prompt computes at most that many tokens a
    step, so a short prompt behind it starts in the first step instead of the third."""
    scheduler = create_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=4)
    scheduler.add_request(create_request("long", prompt_len=25))
    scheduler.add_request(create_request("short", prompt_len=3))
    scheduler.add_request(create_request("other", prompt_len=8))
    assert scheduled_counts(step(scheduler)) == {"long": 4, "short": 3, "other": 3}
    assert scheduled_counts(step(scheduler)) == {"long": 4, "short": 1, "other": 4}
    long = scheduler.requests["long"]
    while scheduler.has_unfinished():
        counts = scheduled_counts(step(scheduler))
        assert all(count <= 4 for count in counts.values())
    assert long.num_computed_tokens >= 25 and long.output_token_ids[0] == FAKE_TOKEN
    with pytest.raises(ValueError):
        create_scheduler(long_prefill_token_threshold=4, enable_chunked_prefill=False)


def test_a_threshold_shorter_than_an_image_run_never_holds_the_run_up():
    """An image whose tokens attend both ways is computed in one step: a threshold that would
    cut it lets that step run as the budget allows."""
    scheduler = create_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=3)
    request = create_request("image", prompt_len=20)
    request.images = ImageInputs(np.arange(4, 12), (), {})
    request.images.both_ways = True
    scheduler.add_request(request)
    chunks = [scheduled_counts(step(scheduler))["image"] for _ in range(3)]
    assert chunks == [3, 1, 16]  # up to the run; the run (and what the budget leaves) whole


def test_running_decodes_go_before_new_prefills():
    scheduler = create_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(create_request("a", prompt_len=4, max_tokens=10))
    step(scheduler)
    scheduler.add_request(create_request("b", prompt_len=20))
    output = step(scheduler)
    assert [item.request.request_id for item in output.scheduled] == ["a", "b"]
    assert scheduled_counts(output) == {"a": 1, "b": 7}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = create_scheduler(max_num_batched_tokens=128, enable_chunked_prefill=False)
    scheduler.add_request(create_request("a", prompt_len=100, max_tokens=5))
    scheduler.add_request(create_request("b", prompt_len=60))
    first = step(scheduler)
    assert scheduled_counts(first) == {"a": 100}
    second = step(scheduler)
    assert scheduled_counts(second) == {"a": 1, "b": 60}


def test_chunked_prefill_off_needs_a_budget_of_the_context():
    with pytest.raises(ValueError):
        create_scheduler(max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=False)


def test_finished_requests_free_blocks_in_the_same_step_and_waiting_ones_start_next():
    scheduler = create_scheduler(num_blocks=2, block_size=4, max_model_len=8)
    scheduler.add_request(create_request("a", prompt_len=4, max_tokens=1))
    scheduler.add_request(create_request("b", prompt_len=4, max_tokens=1))
    scheduler.add_request(create_request("c", prompt_len=4, max_tokens=1))
    assert scheduled_counts(step(scheduler)) == {"a": 4, "b": 4}
    assert scheduler.block_manager.num_free_blocks == 2  # both done, blocks back at once
    assert scheduled_counts(step(scheduler)) == {"c": 4}


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    # 4 blocks of 4 tokens; three requests of 5 tokens need 2 blocks each to grow.
    scheduler = create_scheduler(num_blocks=5, block_size=4, max_model_len=20)
    for name in ("a", "b", "c"):
        scheduler.add_request(create_request(name, prompt_len=4, max_tokens=8))
    scheduler.add_request(create_request("d", prompt_len=4, max_tokens=8))
    step(scheduler)  # four prompts of one block each; one block left
    assert scheduler.num_running == 4
    output = step(scheduler)  # each needs a second block: only 1 free
    preempted = [r.request_id for r in output.preempted]
    assert preempted == ["d", "c"]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    assert scheduler.num_preemptions == 2
    for name in preempted:
        request = scheduler.requests[name]
        assert request.status is RequestStatus.WAITING
        assert request.num_computed_tokens == 0 and request.block_ids == []
        assert request.num_preemptions == 1


def test_preempted_request_recomputes_prompt_and_outputs():
    scheduler = create_scheduler(num_blocks=3, block_size=4, max_model_len=12)
    scheduler.add_request(create_request("a", prompt_len=3, max_tokens=6))
    scheduler.add_request(create_request("b", prompt_len=3, max_tokens=6))
    seen_recompute = False
    for _ in range(50):
        output = scheduler.schedule()
        for item in output.scheduled:
            request = item.request
            if request.num_preemptions and request.num_computed_tokens == 0:
                # the recompute covers the prompt plus every output generated before
                assert item.num_tokens == request.num_tokens > request.num_prompt_tokens
                seen_recompute = True
        scheduler.update_from_output(output, fake_runner_output(output))
        scheduler.check_invariants()
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished()
    assert seen_recompute


def test_tiny_cache_never_deadlocks_and_everything_finishes():
    rng = random.Random(3)
    scheduler = create_scheduler(
        num_blocks=6, block_size=4, max_model_len=24, max_num_batched_tokens=16
    )
    requests = [
        create_request(f"r{i}", prompt_len=rng.randint(1, 20), max_tokens=rng.randint(1, 12))
        for i in range(20)
    ]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(2_000):
        if not scheduler.has_unfinished():
            break
        step(scheduler)
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 6
    for request in requests:
        assert request.is_finished and request.finish_reason is FinishReason.LENGTH
        assert request.num_output_tokens == min(
            request.sampling_params.max_tokens, 24 - request.num_prompt_tokens
        )
    assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "finished"])
def test_abort_in_every_state_frees_all_blocks(state):
    scheduler = create_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(create_request("keep", prompt_len=4, max_tokens=20))
    scheduler.add_request(
        create_request("x", prompt_len=20, max_tokens=20 if state != "finished" else 1)
    )
    if state != "waiting":
        step(scheduler)  # keep: 4, x: first chunk of 4
    if state in ("decoding", "finished"):
        for _ in range(5):
            step(scheduler)
    request = scheduler.requests.get("x")
    if state == "prefilling":
        assert request is not None and 0 < request.num_computed_tokens < 20
    if state == "decoding":
        assert request is not None and request.num_output_tokens > 0
    if state == "finished":
        assert request is None
    aborted = scheduler.abort_requests(["x"])
    assert len(aborted) == (0 if state == "finished" else 1)
    for item in aborted:
        assert item.finish_reason is FinishReason.ABORT and item.block_ids == []
    scheduler.check_invariants()
    assert scheduler.block_manager.num_used_blocks == len(scheduler.requests["keep"].block_ids)
    assert "x" not in scheduler.requests


def test_prompt_that_can_never_fit_is_refused_at_submission():
    scheduler = create_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
        scheduler.add_request(create_request("ctx", prompt_len=64))
    with pytest.raises(PromptTooLongError, match="KV cache holds only 16 tokens"):
        scheduler.add_request(create_request("cache", prompt_len=16))
    assert not scheduler.has_unfinished()
    scheduler.add_request(create_request("ok", prompt_len=15))


def test_output_is_clamped_to_the_longest_sequence_the_cache_can_hold():
    scheduler = create_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    request = create_request("r", prompt_len=10, max_tokens=100)
    scheduler.add_request(request)
    while scheduler.has_unfinished():
        step(scheduler)
    assert request.num_tokens == 16
    assert request.finish_reason is FinishReason.LENGTH


def test_eos_and_stop_token_ids_finish_with_stop():
    scheduler = create_scheduler()
    eos = create_request("eos", prompt_len=4, max_tokens=10)
    stop = create_request(
        "stop", prompt_len=4, max_tokens=10, stop_token_ids=(FAKE_TOKEN,), ignore_eos=True
    )
    ignore = create_request("ignore", prompt_len=4, max_tokens=3, ignore_eos=True)
    for request in (eos, stop, ignore):
        scheduler.add_request(request)
    step(scheduler, token=0)  # 0 is EOS
    assert eos.finish_reason is FinishReason.STOP and eos.stop_reason is None
    assert not ignore.is_finished
    step(scheduler, token=FAKE_TOKEN)
    assert stop.finish_reason is FinishReason.STOP and stop.stop_reason == FAKE_TOKEN


def test_min_tokens_defers_token_stops():
    scheduler = create_scheduler()
    request = create_request("r", prompt_len=4, max_tokens=10, min_tokens=3)
    scheduler.add_request(request)
    step(scheduler, token=0)
    step(scheduler, token=0)
    assert not request.is_finished
    step(scheduler, token=0)
    assert request.finish_reason is FinishReason.STOP and request.num_output_tokens == 3


def test_static_batching_admits_nothing_until_the_whole_batch_is_done():
    scheduler = create_scheduler(max_num_seqs=2, static_batching=True)
    scheduler.add_request(create_request("short", prompt_len=4, max_tokens=1))
    scheduler.add_request(create_request("long", prompt_len=4, max_tokens=4))
    scheduler.add_request(create_request("next", prompt_len=4, max_tokens=1))
    assert set(scheduled_counts(step(scheduler))) == {"short", "long"}
    for _ in range(3):  # "short" is done and its slot is free, but the batch stays closed
        assert set(scheduled_counts(step(scheduler))) == {"long"}
    assert scheduled_counts(step(scheduler)) == {"next": 4}


def test_continuous_batching_fills_a_freed_slot_at_once():
    scheduler = create_scheduler(max_num_seqs=2)
    scheduler.add_request(create_request("short", prompt_len=4, max_tokens=1))
    scheduler.add_request(create_request("long", prompt_len=4, max_tokens=4))
    scheduler.add_request(create_request("next", prompt_len=4, max_tokens=1))
    step(scheduler)
    assert scheduled_counts(step(scheduler)) == {"long": 1, "next": 4}


def test_background_requests_pause_while_others_want_capacity_and_resume_after():
    scheduler = create_scheduler()
    batch = create_request("batch", prompt_len=4, max_tokens=12)
    batch.background = True
    scheduler.add_request(batch)
    step(scheduler)
    step(scheduler)
    assert scheduler.running == [batch]
    live = create_request("live", prompt_len=4, max_tokens=3)
    scheduler.add_request(live)
    while live.status is not RequestStatus.FINISHED:
        output = step(scheduler)
        assert [item.request for item in output.scheduled] == [live]
        assert batch.block_ids  # paused, not preempted: its cache stays
    computed = batch.num_computed_tokens
    output = step(scheduler)
    assert [item.request for item in output.scheduled] == [batch]
    assert batch.num_computed_tokens > computed  # it goes on where it stopped
    assert [name for _, name in batch.timings.events] == ["paused", "resumed"]


def test_a_live_request_that_cannot_start_does_not_hold_up_background_work():
    """A deferred live request is not counted: background work goes on (and frees the cache
    the deferral waits for) instead of both waiting on each other."""
    scheduler = create_scheduler(admission_soft_limit=0.01)  # any use of the cache defers
    batch = create_request("batch", prompt_len=4, max_tokens=4)
    batch.background = True
    scheduler.add_request(batch)
    step(scheduler)
    live = create_request("live", prompt_len=4, max_tokens=2)
    live.deferred = True
    scheduler.add_request(live)
    output = step(scheduler)
    assert [item.request for item in output.scheduled] == [batch]
