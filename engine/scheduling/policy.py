"""Who goes first: first-come-first-served, or priorities with aging. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.core.request import Request

HIGHEST = float("-inf")


class SchedulingPolicy:
    """Orders requests. Under `fcfs` the queue order is kept (preempted requests go back to its
    front); under `priority` a lower `priority` value goes first, then earlier arrival, and a
    request that waited longer than `max_wait` seconds counts as the highest priority."""

    def __init__(self, name: str = "fcfs", max_wait: float | None = None) -> None:
        self.name = name
        self.max_wait = max_wait

    @property
    def uses_priority(self) -> bool:
        return self.name == "priority"

    def key(self, request: Request, now: float) -> tuple[float, float]:
        started = request.timings.first_scheduled
        waited = (started if started is not None else now) - request.arrival_time
        aged = self.max_wait is not None and waited > self.max_wait
        return (HIGHEST if aged else request.priority, request.arrival_time)

    def outranks(self, request: Request, other: Request, now: float) -> bool:
        """True when `request` is in a strictly better priority class than `other` (arrival
        order inside a class does not count)."""
        return self.key(request, now)[0] < self.key(other, now)[0]

    def pick(
        self, waiting: Iterable[Request], now: float, eligible: Callable[[Request], bool]
    ) -> Request | None:
        """The waiting request to admit next, or None."""
        candidates = (r for r in waiting if eligible(r))
        if not self.uses_priority:
            return next(candidates, None)
        return min(candidates, key=lambda r: self.key(r, now), default=None)

    def order_running(self, running: list[Request], now: float) -> None:
        """Sort so the request to preempt first is last (fcfs: the most recently admitted)."""
        if self.uses_priority:
            running.sort(key=lambda r: self.key(r, now))
