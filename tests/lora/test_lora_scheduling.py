"""The scheduler runs at most `max_loras` adapters at once: a request of one more adapter
waits, requests of running adapters ranked after it wait behind it (so it is not starved),
and requests of the base model are never held back."""

from __future__ import annotations

import pytest

from engine.lora.registry import LoRARegistry
from tests.scheduler_utils import create_request, create_scheduler, drain, step

REGISTRY = LoRARegistry()
ADAPTERS = {name: REGISTRY.new_request(name, f"/adapters/{name}") for name in "abc"}


def request(request_id: str, adapter: str | None, max_tokens: int = 4, **options):
    made = create_request(request_id, 6, max_tokens=max_tokens, **options)
    made.lora = ADAPTERS[adapter] if adapter is not None else None
    return made


def running_adapters(scheduler) -> set[str]:
    return {r.lora.name for r in scheduler.running if r.lora is not None}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_one_adapter_too_many_waits_and_later_requests_of_running_ones_wait_behind_it(policy):
    scheduler = create_scheduler(max_loras=1, policy=policy)
    queue = [
        request("a0", "a", max_tokens=3),
        request("b0", "b"),
        request("a1", "a"),
        request("base", None),
    ]
    for made in queue:
        scheduler.add_request(made)
    step(scheduler)
    assert {r.request_id for r in scheduler.running} == {"a0", "base"}
    order = []
    while scheduler.has_unfinished():
        step(scheduler)
        assert len(running_adapters(scheduler)) <= 1
        order += [r.request_id for r in scheduler.running if r.request_id not in order]
    assert order.index("b0") < order.index("a1")  # a1 did not overtake b0


def test_slots_for_every_adapter_admit_them_together():
    scheduler = create_scheduler(max_loras=3)
    for i, name in enumerate(["a", "b", "c", None]):
        scheduler.add_request(request(f"r{i}", name))
    step(scheduler)
    assert running_adapters(scheduler) == {"a", "b", "c"} and len(scheduler.running) == 4
    drain(scheduler)


def test_without_adapters_served_nothing_is_gated():
    scheduler = create_scheduler()
    for i, name in enumerate(["a", "b", "c"]):
        scheduler.add_request(request(f"r{i}", name))
    step(scheduler)
    assert len(scheduler.running) == 3
    drain(scheduler)
