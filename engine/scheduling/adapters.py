"""At most `max_loras` LoRA adapters among the running requests, so that every step fits the
model's adapter slots. Imports no torch.

A waiting request whose adapter would be one too many waits, and so does every request ranked
after it that would run an adapter already running: those adapters' requests then drain and
the waiting one gets its turn (admitting them past it would keep it waiting as long as they
keep coming). Requests of the base model are never held back."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.core.request import Request


def adapter_gate(
    running: Iterable[Request],
    ranked_waiting: Callable[[], Iterable[Request]],
    max_loras: int,
) -> Callable[[Request], bool]:
    """Which waiting requests may start now; `ranked_waiting` gives the eligible waiting
    requests in the order the policy would start them (asked for only while the running
    requests' adapters fill every slot)."""
    active = {r.lora.lora_id for r in running if r.lora is not None}
    if len(active) < max_loras:
        return lambda request: True
    ahead: set[int] = set()
    for request in ranked_waiting():
        if request.lora is not None and request.lora.lora_id not in active:
            break
        ahead.add(id(request))
    return lambda request: request.lora is None or id(request) in ahead
