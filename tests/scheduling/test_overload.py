"""Priorities, admission control and deadlines: on plain data, then through HTTP."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.core.config import EngineConfig
from engine.core.request import FinishReason
from engine.scheduling.admission import (
    DEADLINE_MARGIN,
    STEP_WINDOW,
    Admission,
    AdmissionLimits,
    DrainRate,
    QueueState,
    decide,
)
from tests.helpers import sabotage_steps
from tests.scheduler_utils import create_request, create_scheduler, drain, scheduled_counts, step
from tests.server_utils import app_client, blocks_in_use, live_server, sse_events, until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(
    name: str,
    prompt_len: int = 4,
    max_tokens: int = 4,
    priority: int = 0,
    arrival: float = 100.0,
    deadline: float | None = None,
    **params,
):
    request = create_request(name, prompt_len=prompt_len, max_tokens=max_tokens, **params)
    request.priority, request.arrival_time, request.deadline = priority, arrival, deadline
    return request


def policy_scheduler(clock: Clock, **config):
    return create_scheduler(clock=clock, **config)


# ---- priorities ----------------------------------------------------------------------------


def test_priority_policy_admits_by_priority_then_arrival():
    clock = Clock()
    scheduler = policy_scheduler(clock, policy="priority", max_num_seqs=2)
    scheduler.add_request(make("late-low", priority=5, arrival=100.0))
    scheduler.add_request(make("high-b", priority=-1, arrival=100.2))
    scheduler.add_request(make("high-a", priority=-1, arrival=100.1))
    assert set(scheduled_counts(step(scheduler))) == {"high-a", "high-b"}


def test_fcfs_ignores_priority():
    scheduler = policy_scheduler(Clock(), max_num_seqs=2)
    scheduler.add_request(make("first", priority=5))
    scheduler.add_request(make("second", priority=-9))
    scheduler.add_request(make("third", priority=-9))
    assert set(scheduled_counts(step(scheduler))) == {"first", "second"}


def test_a_higher_priority_request_preempts_the_lowest_running_one():
    clock = Clock()
    scheduler = policy_scheduler(
        clock, policy="priority", num_blocks=4, block_size=4, max_model_len=16
    )
    scheduler.add_request(make("low", prompt_len=4, max_tokens=8, priority=9))
    scheduler.add_request(make("mid", prompt_len=4, max_tokens=8, priority=5))
    step(scheduler)
    scheduler.add_request(make("urgent", prompt_len=8, max_tokens=4, priority=0))
    output = step(scheduler)
    assert [r.request_id for r in output.preempted] == ["low"]
    assert "urgent" in scheduled_counts(output)
    assert scheduler.requests["low"].num_computed_tokens == 0
    drain(scheduler)
    assert scheduler.block_manager.num_used_blocks == 0


def test_a_higher_priority_request_takes_the_slot_of_the_lowest_running_one():
    scheduler = policy_scheduler(Clock(), policy="priority", max_num_seqs=2)
    scheduler.add_request(make("low", max_tokens=8, priority=9, arrival=100.0))
    scheduler.add_request(make("mid", max_tokens=8, priority=5, arrival=100.1))
    step(scheduler)
    scheduler.add_request(make("urgent", max_tokens=2, priority=0, arrival=100.2))
    output = step(scheduler)
    assert [r.request_id for r in output.preempted] == ["low"]
    assert set(scheduled_counts(output)) == {"mid", "urgent"}
    low = scheduler.requests["low"]
    assert low.block_ids and low.num_computed_tokens == 4  # paused: its KV stays
    while "urgent" in scheduler.requests:
        step(scheduler)
    assert scheduled_counts(step(scheduler))["low"] == 1  # resumes decoding, no recompute
    drain(scheduler)
    assert scheduler.block_manager.num_used_blocks == 0


def test_the_paused_request_is_one_that_misses_its_deadline_anyway_or_has_most_to_spare():
    clock = Clock()
    scheduler = policy_scheduler(clock, policy="priority", max_num_seqs=3)
    for name, arrival, deadline in (
        ("roomy", 100.0, 200.0),
        ("doomed", 100.1, 105.0),
        ("tight", 100.2, 115.0),
    ):
        scheduler.add_request(
            make(
                name, max_tokens=10, ignore_eos=True, priority=1, arrival=arrival, deadline=deadline
            )
        )
    step(scheduler)
    scheduler.drain.record_step(1.0, 0, 3, prefill_tokens=0, decodes=3, sequences=3)
    scheduler.add_request(make("urgent-1", max_tokens=4, priority=0, arrival=101.0))
    assert [r.request_id for r in step(scheduler).preempted] == ["doomed"]
    scheduler.add_request(make("urgent-2", max_tokens=4, priority=0, arrival=101.0))
    assert [r.request_id for r in step(scheduler).preempted] == ["roomy"]


def test_requests_of_one_priority_class_never_take_each_others_slots():
    scheduler = policy_scheduler(Clock(), policy="priority", max_num_seqs=1)
    scheduler.add_request(make("running", max_tokens=8, priority=1, arrival=100.5))
    step(scheduler)
    scheduler.add_request(make("earlier", max_tokens=8, priority=1, arrival=100.0))
    output = step(scheduler)
    assert not output.preempted and set(scheduled_counts(output)) == {"running"}


def test_slot_preemption_stops_at_the_token_budget():
    scheduler = policy_scheduler(
        Clock(), policy="priority", max_num_seqs=3, max_num_batched_tokens=12
    )
    for i in range(3):
        scheduler.add_request(make(f"low-{i}", max_tokens=20, priority=1, arrival=100 + i))
    step(scheduler)
    for i in range(3):
        scheduler.add_request(make(f"high-{i}", prompt_len=8, priority=0, arrival=101 + i))
    output = step(scheduler)
    # 3 decode tokens + one 8-token prompt fit in 12; the second prompt would not
    assert [r.request_id for r in output.preempted] == ["low-2"]
    assert "high-0" in scheduled_counts(output)


def test_an_aged_request_takes_a_slot_from_a_fresher_low_priority_one():
    clock = Clock()
    scheduler = policy_scheduler(clock, policy="priority", max_num_seqs=1, max_priority_wait=5.0)
    scheduler.add_request(make("busy", max_tokens=50, priority=1, arrival=100.0))
    step(scheduler)
    scheduler.add_request(make("patient", max_tokens=2, priority=1, arrival=100.1))
    clock.now = 106.0
    output = step(scheduler)
    assert [r.request_id for r in output.preempted] == ["busy"]
    assert set(scheduled_counts(output)) == {"patient"}
    clock.now = 120.0  # "busy" was started within the wait limit: it is not aged
    assert not step(scheduler).preempted


def test_a_paused_request_gives_its_blocks_to_a_higher_priority_one():
    scheduler = policy_scheduler(
        Clock(), policy="priority", max_num_seqs=1, num_blocks=4, block_size=4, max_model_len=16
    )
    scheduler.add_request(make("low", prompt_len=8, max_tokens=6, priority=1, arrival=100.0))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(make("urgent", prompt_len=12, max_tokens=2, priority=0, arrival=101))
    output = step(scheduler)
    assert scheduled_counts(output) == {"urgent": 12}
    low = scheduler.requests["low"]
    assert low.block_ids == [] and low.num_computed_tokens == 0  # recomputed later
    drain(scheduler)
    assert scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_priorities_under_block_and_slot_pressure_always_drain(seed):
    """Pausing, preempting and releasing held blocks never wedges the queue or leaks."""
    rng = random.Random(seed)
    clock = Clock()
    scheduler = policy_scheduler(
        clock,
        policy="priority",
        max_num_seqs=3,
        num_blocks=10,
        block_size=4,
        max_model_len=32,
        max_num_batched_tokens=16,
        max_priority_wait=2.0,
    )
    for i in range(40):
        if i < 30:
            prompt = rng.randint(1, 20)
            scheduler.add_request(
                make(
                    f"r{i}",
                    prompt_len=prompt,
                    max_tokens=rng.randint(1, 31 - prompt),
                    priority=rng.randint(0, 3),
                    arrival=clock.now,
                )
            )
        step(scheduler)
        clock.now += 0.25
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        step(scheduler)
        clock.now += 0.25
    assert not scheduler.has_unfinished() and scheduler.num_preemptions > 0
    assert scheduler.block_manager.num_used_blocks == 0


def test_fcfs_does_not_preempt_for_a_newcomer():
    scheduler = policy_scheduler(Clock(), num_blocks=4, block_size=4, max_model_len=16)
    scheduler.add_request(make("low", max_tokens=8, priority=9))
    scheduler.add_request(make("mid", max_tokens=8, priority=5))
    step(scheduler)
    scheduler.add_request(make("urgent", prompt_len=8, priority=0))
    output = step(scheduler)
    assert not output.preempted and "urgent" not in scheduled_counts(output)


def test_aging_lets_a_starved_request_go_first():
    clock = Clock()
    scheduler = policy_scheduler(clock, policy="priority", max_num_seqs=1, max_priority_wait=5.0)
    scheduler.add_request(make("starved", priority=9, arrival=90.0))  # waited 10 s already
    scheduler.add_request(make("fresh-high", priority=0, arrival=100.0))
    assert set(scheduled_counts(step(scheduler))) == {"starved"}


# ---- admission -----------------------------------------------------------------------------


def test_reserved_slots_keep_room_for_urgent_requests():
    scheduler = policy_scheduler(Clock(), policy="priority", max_num_seqs=4, reserved_seqs=1)
    for i in range(5):
        scheduler.add_request(make(f"low-{i}", max_tokens=20, priority=1))
    assert set(scheduled_counts(step(scheduler))) == {"low-0", "low-1", "low-2"}
    step(scheduler)
    assert len(scheduler.running) == 3
    scheduler.add_request(make("urgent", max_tokens=2, priority=0))
    assert "urgent" in scheduled_counts(step(scheduler))
    assert len(scheduler.running) == 4
    while scheduler.has_unfinished():
        step(scheduler)
        assert sum(r.priority > 0 for r in scheduler.running) <= 3
    assert scheduler.block_manager.num_used_blocks == 0


def test_fcfs_reserves_nothing():
    scheduler = policy_scheduler(Clock(), max_num_seqs=4, reserved_seqs=1)
    for i in range(5):
        scheduler.add_request(make(f"low-{i}", priority=1))
    assert len(scheduled_counts(step(scheduler))) == 4


def test_reserved_slots_default_to_an_eighth_under_the_priority_policy():
    assert EngineConfig(scheduling_policy="priority").scheduler_config(64).reserved_seqs == 16
    assert EngineConfig().scheduler_config(64).reserved_seqs == 0
    config = EngineConfig(scheduling_policy="priority", max_num_seqs=8, priority_reserved_seqs=3)
    assert config.scheduler_config(64).reserved_seqs == 3
    with pytest.raises(ValueError, match="reserved_seqs"):
        EngineConfig(
            scheduling_policy="priority", max_num_seqs=2, priority_reserved_seqs=2
        ).scheduler_config(64)


def test_every_admission_outcome():
    drain = DrainRate()
    limits = AdmissionLimits(max_waiting_requests=3, max_queued_tokens=100, soft_limit=0.9)
    quiet = QueueState(num_waiting=0, queued_tokens=0, kv_cache_usage=0.2)
    assert decide(limits, quiet, 50, False, drain).outcome is Admission.ADMIT
    assert decide(limits, quiet, 50, True, drain).outcome is Admission.ADMIT
    full_cache = QueueState(0, 0, kv_cache_usage=0.95)
    assert decide(limits, full_cache, 50, True, drain).outcome is Admission.DEFER
    assert decide(limits, full_cache, 50, False, drain).outcome is Admission.ADMIT
    too_many = decide(limits, QueueState(3, 10, 0.2), 5, False, drain)
    assert too_many.outcome is Admission.REJECT and too_many.retry_after >= 1
    too_much = decide(limits, QueueState(1, 80, 0.2), 30, False, drain)
    assert too_much.outcome is Admission.REJECT


def test_retry_after_follows_the_drain_rate():
    drain = DrainRate()
    drain.record_step(1.0, finished=2, tokens=100, prefill_tokens=0, decodes=100, sequences=100)
    decision = decide(
        AdmissionLimits(max_waiting_requests=1), QueueState(1, 1000, 0.1), 10, False, drain
    )
    assert decision.retry_after == 10  # 1000 queued tokens at 100 tokens/s


def test_deferred_requests_wait_for_the_cache_to_drain():
    scheduler = policy_scheduler(
        Clock(), num_blocks=10, block_size=4, max_model_len=40, admission_soft_limit=0.5
    )
    scheduler.add_request(make("big", prompt_len=24, max_tokens=2))
    step(scheduler)
    assert scheduler.block_manager.usage >= 0.5
    decision = scheduler.admission(promised_tokens=8, priority=3)
    assert decision.outcome is Admission.DEFER
    late = make("low", priority=3)
    late.deferred = True
    scheduler.add_request(late)
    assert scheduler.num_deferred() == 1
    assert "low" not in scheduled_counts(step(scheduler))  # "big" finishes in this step
    assert scheduled_counts(step(scheduler)) == {"low": 4}


def test_rejections_are_counted():
    scheduler = policy_scheduler(Clock(), max_waiting_requests=1)
    scheduler.add_request(make("a"))
    assert scheduler.admission(8, 0).outcome is Admission.REJECT
    assert scheduler.num_rejections == 1


# ---- deadlines -----------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding"])
def test_deadline_expiry_in_every_state_frees_blocks(state):
    clock = Clock()
    scheduler = policy_scheduler(clock, max_num_batched_tokens=8, max_num_seqs=1)
    scheduler.add_request(make("blocker", prompt_len=4, max_tokens=50))
    scheduler.add_request(make("x", prompt_len=20, max_tokens=50, deadline=105.0))
    if state != "waiting":
        scheduler.abort_requests(["blocker"])
        step(scheduler)
    if state == "decoding":
        for _ in range(4):
            step(scheduler)
    request = scheduler.requests["x"]
    assert (request.block_ids == []) == (state == "waiting")
    assert (request.num_output_tokens > 0) == (state == "decoding")
    clock.now = 104.9
    assert scheduler.expire_deadlines(clock.now) == []
    clock.now = 105.0
    [expired] = scheduler.expire_deadlines(clock.now)
    assert expired is request and request.finish_reason is FinishReason.TIMEOUT
    assert request.block_ids == [] and "x" not in scheduler.requests
    scheduler.check_invariants()


def test_a_waiting_request_that_can_no_longer_make_it_is_dropped_early():
    clock = Clock()
    scheduler = policy_scheduler(clock, max_num_seqs=1)
    scheduler.drain.record_step(0.1, 0, 1, prefill_tokens=0, decodes=1, sequences=1)
    scheduler.add_request(make("blocker", max_tokens=50))
    scheduler.add_request(make("x", max_tokens=20, deadline=110.0, ignore_eos=True))
    step(scheduler)
    clock.now = 107.0  # 20 tokens need >= 1.9 s, only 3 s left: still possible
    assert scheduler.expire_deadlines(clock.now) == []
    clock.now = 108.5  # 1.5 s left: hopeless, so it never starts
    [dropped] = scheduler.expire_deadlines(clock.now)
    assert dropped.request_id == "x" and dropped.finish_reason is FinishReason.TIMEOUT


def test_queue_limits_count_only_equal_or_higher_priorities_under_the_priority_policy():
    for policy, high_outcome in (("fcfs", Admission.REJECT), ("priority", Admission.ADMIT)):
        scheduler = policy_scheduler(Clock(), policy=policy, max_waiting_requests=2, max_num_seqs=1)
        for name in ("run", "low-1", "low-2"):
            scheduler.add_request(make(name, priority=1))
        step(scheduler)
        assert scheduler.admission(8, priority=1).outcome is Admission.REJECT
        assert scheduler.admission(8, priority=0).outcome is high_outcome


def test_fastest_finish_estimate():
    drain = DrainRate()
    assert drain.fastest_finish(100, 50) == 0  # nothing measured yet: never reject
    drain.record_step(0.5, 0, 100, prefill_tokens=100, decodes=0, sequences=1)
    drain.record_step(0.05, 0, 4, prefill_tokens=0, decodes=4, sequences=4)
    assert drain.fastest_finish(100, 11, num_sequences=5) == pytest.approx(0.5 + 10 * 0.05)
    drain.record_step(0.4, 0, 32, prefill_tokens=0, decodes=32, sequences=32)
    assert drain.fastest_finish(100, 11, num_sequences=33) == pytest.approx(0.5 + 10 * 0.4)
    assert drain.fastest_finish(100, 11, num_sequences=6) == pytest.approx(0.5 + 10 * 0.05)
    # averaged per step: one 3 s step among 0.4 s ones moves the figure by a step's share
    drain.record_step(3.0, 0, 600, prefill_tokens=576, decodes=24, sequences=33)
    assert drain.step_seconds(33) == pytest.approx((0.4 + 3.0) / 2)


def test_a_burst_step_is_soon_forgotten():
    """The first step under load admits a burst of prompts and runs for seconds; within a
    window of steps only the steps after it count."""
    drain = DrainRate()
    drain.record_step(3.0, 0, 2048, prefill_tokens=2016, decodes=32, sequences=32)
    for _ in range(STEP_WINDOW - 1):
        drain.record_step(0.3, 0, 32, prefill_tokens=0, decodes=32, sequences=32)
    assert drain.step_seconds(33) == pytest.approx(0.3 + 2.7 / STEP_WINDOW)
    drain.record_step(0.3, 0, 32, prefill_tokens=0, decodes=32, sequences=32)
    assert drain.step_seconds(33) == pytest.approx(0.3)


def test_deadlines_are_judged_with_a_margin():
    drain = DrainRate()
    drain.record_step(0.5, 0, 100, prefill_tokens=100, decodes=0, sequences=1)
    drain.record_step(0.05, 0, 4, prefill_tokens=0, decodes=4, sequences=4)
    assert drain.time_to_finish(100, 11, num_sequences=5) == pytest.approx(
        DEADLINE_MARGIN * (0.5 + 10 * 0.05)
    )
    assert DEADLINE_MARGIN > 1


def test_a_slow_step_under_load_does_not_turn_requests_away_from_an_idle_engine():
    """Step times are kept per batch size: after a busy spell, a request alone is judged by
    what is known of small batches (nothing yet: admit), not by the busy figure."""
    drain = DrainRate()
    drain.record_step(0.8, 0, 32, prefill_tokens=0, decodes=32, sequences=32)
    assert drain.fastest_finish(64, 32, num_sequences=1) == 0
    assert drain.fastest_finish(64, 32, num_sequences=40) == pytest.approx(31 * 0.8)


# ---- through HTTP --------------------------------------------------------------------------

LONG = {"prompt": "Hello", "max_tokens": 300, "ignore_eos": True}


async def test_a_request_timing_out_in_the_queue_gets_504(monkeypatch):
    import httpx

    async with live_server(max_num_seqs=1) as server:
        engine = server.engine
        sabotage_steps(engine.core, monkeypatch, fail_on=set(), delay=0.02)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            running = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await until(lambda: engine.core.scheduler.num_running == 1)
            plain = await client.post("/v1/completions", json={"prompt": "x", "timeout": 0.2})
            assert plain.status_code == 504
            assert plain.json()["error"]["code"] == "timeout"
            streamed = await client.post(
                "/v1/completions", json={"prompt": "x", "timeout": 0.2, "stream": True}
            )
            assert streamed.status_code == 504
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


# A deadline LONG's 300 steps of at least 0.02 s (6 s) pass, far enough off that the first token
# comes before it on a loaded machine (0.5 s did not always: the request then timed out unserved).
PAST_FIRST_TOKEN = 2.0


async def test_a_request_generating_past_its_deadline_returns_what_it_has(monkeypatch):
    # Fresh engines: with no speed measured yet, nothing is refused up front.
    async with app_client() as (client, engine):
        sabotage_steps(engine.core, monkeypatch, fail_on=set(), delay=0.02)
        body = (
            await client.post("/v1/completions", json={**LONG, "timeout": PAST_FIRST_TOKEN})
        ).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "timeout"
        assert 0 < body["usage"]["completion_tokens"] < 300
        assert blocks_in_use(engine) == 0
    async with app_client() as (client, engine):
        sabotage_steps(engine.core, monkeypatch, fail_on=set(), delay=0.02)
        async with client.stream(
            "POST", "/v1/completions", json={**LONG, "timeout": PAST_FIRST_TOKEN, "stream": True}
        ) as response:
            events = sse_events((await response.aread()).decode())
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        finishes = [e["choices"][0]["finish_reason"] for e in events[:-2] if e.get("choices")]
        assert finishes[-1] == "timeout"
        assert blocks_in_use(engine) == 0


async def test_a_deadline_that_cannot_be_met_is_refused_at_once(monkeypatch):
    async with app_client() as (client, engine):
        sabotage_steps(engine.core, monkeypatch, fail_on=set(), delay=0.02)
        warm = await client.post("/v1/completions", json={**LONG, "max_tokens": 20})
        assert warm.status_code == 200
        refused = await client.post("/v1/completions", json={**LONG, "timeout": 0.5})
        assert refused.status_code == 504 and "cannot finish" in refused.json()["error"]["message"]
        assert not engine.core.has_unfinished()


async def test_admission_rejections_and_waiting_reasons_are_metrics():
    async with app_client(max_waiting_requests=0) as (client, _):
        refused = await client.post("/v1/completions", json={"prompt": "x", "priority": 2})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        await asyncio.sleep(0.05)
        text = (await client.get("/metrics")).text
        assert 'vllm:admission_rejections_total{engine="0",model_name="tiny"} 1.0' in text
        assert (
            'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",'
            'reason="deferred"} 0.0' in text
        )


def test_timeout_must_be_positive():
    from server.protocol import CompletionRequest

    with pytest.raises(ValueError):
        CompletionRequest(prompt="x", timeout=0)
    assert CompletionRequest(prompt="x", timeout=2.5).timeout == 2.5
