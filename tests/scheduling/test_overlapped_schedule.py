"""The scheduler under overlapped scheduling, on plain data: a step is scheduled after the
previous one was advanced but before its tokens were received."""

from __future__ import annotations

from engine.core.request import FinishReason, RequestStatus
from tests.scheduler_utils import (
    FAKE_TOKEN,
    create_request,
    create_scheduler,
    fake_runner_output,
    scheduled_counts,
)


def launch(scheduler):
    """Schedule and advance a step, as the engine does once it is launched."""
    output = scheduler.schedule()
    scheduler.advance(output)
    return output


def two_in_flight(scheduler, *requests: tuple[str, int, int]):
    """Queue (id, prompt length, max tokens) requests, then launch two steps, the second
    before the first's tokens arrive."""
    for request_id, prompt_len, max_tokens in requests:
        scheduler.add_request(create_request(request_id, prompt_len, max_tokens=max_tokens))
    return launch(scheduler), launch(scheduler)


def preempted_in_flight():
    """Five blocks of 4: two prompts of 8 tokens take four; growing, a takes the fifth and b,
    its step in flight, is preempted. Returns the scheduler and both steps."""
    scheduler = create_scheduler(num_blocks=5, block_size=4)
    first, second = two_in_flight(scheduler, ("a", 8, 8), ("b", 8, 8))
    assert [r.request_id for r in second.preempted] == ["b"]
    return scheduler, first, second


def receive(scheduler, output, token: int = FAKE_TOKEN):
    advanced = scheduler.receive(output, fake_runner_output(output, token))
    scheduler.check_invariants()
    return advanced


def test_a_sampled_token_is_pending_and_its_position_runs_next():
    scheduler = create_scheduler()
    scheduler.add_request(create_request("a", prompt_len=5, max_tokens=4))
    first = launch(scheduler)
    request = scheduler.requests["a"]
    assert request.num_pending_tokens == 1 and request.num_tokens == 6
    assert request.output_token_ids == [] and request.num_computed_tokens == 5
    second = launch(scheduler)  # before the first step's token is known
    (item,) = second.scheduled
    assert (item.start, item.num_tokens, item.completes_sequence) == (5, 1, True)
    assert request.num_pending_tokens == 2
    assert [r.request_id for r in receive(scheduler, first)] == ["a"]
    assert request.output_token_ids == [FAKE_TOKEN] and request.num_pending_tokens == 1
    # The step's item keeps where it started though the request moved on.
    assert item.start == 5 and item.end == 6
    receive(scheduler, second, token=9)
    assert request.output_token_ids == [FAKE_TOKEN, 9] and request.num_pending_tokens == 0


def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_again():
    scheduler = create_scheduler()
    first, second = two_in_flight(scheduler, ("short", 3, 1), ("long", 3, 5))
    assert scheduled_counts(second) == {"long": 1}
    receive(scheduler, first)
    assert scheduler.requests.get("short") is None  # finished by length on arrival
    receive(scheduler, second)
    manager = scheduler.block_manager
    assert manager.num_used_blocks == len(scheduler.requests["long"].block_ids)


def test_a_request_ended_while_its_step_was_in_flight_gets_nothing_more():
    scheduler = create_scheduler()
    first, second = two_in_flight(scheduler, ("a", 4, 10), ("b", 4, 10))
    receive(scheduler, first, token=0)  # EOS: both stop, though the second step runs them
    assert not scheduler.requests
    assert receive(scheduler, second) == []
    assert scheduler.block_manager.num_used_blocks == 0


def test_a_preempted_request_waits_for_its_token_then_recomputes_with_it():
    scheduler, first, second = preempted_in_flight()
    b = scheduler.requests["b"]
    assert b.status is RequestStatus.WAITING and b.num_pending_tokens == 1
    assert b.num_computed_tokens == 0 and not b.block_ids
    receive(scheduler, first)
    assert b.output_token_ids == [FAKE_TOKEN] and b.num_pending_tokens == 0
    receive(scheduler, second)
    scheduler.finish_request("a", FinishReason.ABORT)
    third = scheduler.schedule()
    assert scheduled_counts(third) == {"b": 9}  # its prompt and the token it received


def test_a_pending_request_is_not_readmitted_before_its_token_arrives():
    scheduler, _, _ = preempted_in_flight()
    scheduler.finish_request("a", FinishReason.ABORT)
    assert scheduler.schedule().is_empty  # b's token from the first step is still coming
