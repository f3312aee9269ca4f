"""Whether drafting pays at the current batch size, measured while serving.

A draft row is nearly free while a step's rows leave the device idle (a few requests on a CPU,
many on a GPU) and costs its share once they do not; what it gains depends on how many drafts
the model keeps, which depends on the traffic. So instead of a fixed batch size the gate keeps,
per size class of decode steps (1, 2, 3-4, 5-8, 9-16, ...), the output tokens per second of recent
steps with drafts and of recent steps without, and drafts where the steps with them have been
faster. A size class first runs a step without drafts and one with, then the way that was
faster, trying the other way again after `FIRST_TRY` decisions, then after twice as many each
time a try leaves the same way faster (up to `LAST_TRY`), so both rates stay current as the
traffic changes while a way that keeps losing is seldom paid for; a try that lost by little is
repeated after `FIRST_TRY` decisions (it costs little), and one that won starts its way's rate
over, as the traffic changed (a reply that starts repeating text drafts from the next step). A
rate is the median of its last `WINDOW` steps, so one step stalled by something else (a
collection, another process) does not turn the decision."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# Decisions before the way the rates do not favour is tried again, at first and at most.
FIRST_TRY = 8
LAST_TRY = 256
# The steps a rate is the median of.
WINDOW = 8
# A try that loses by less than this share waits only FIRST_TRY decisions for the next.
CLOSE = 0.15


def _window() -> deque[float]:
    return deque(maxlen=WINDOW)


@dataclass(slots=True)
class _Rates:
    """Output tokens per second of recent steps with drafts and without; the decisions taken,
    the one at which the other way is tried next, the wait before that, and which way was
    favoured at the last try."""

    drafted: deque[float] = field(default_factory=_window)
    plain: deque[float] = field(default_factory=_window)
    decisions: int = 0
    next_try: int = FIRST_TRY
    wait: int = FIRST_TRY
    favoured_then: bool | None = None
    trying: bool | None = None  # the way the last decision tried (None: not a try)
    last_asked: int = -FIRST_TRY  # the decision a drafter last turned into a try of drafts

    def favours_drafts(self) -> bool:
        """Whether steps with drafts have been as fast as steps without; a way not measured
        yet is not favoured over one that was (a step can draft before its size class decided
        anything: its rows changed since the decision, or the batch-size limit chose)."""
        if not self.drafted or not self.plain:
            return bool(self.drafted)
        return statistics.median(self.drafted) >= statistics.median(self.plain)

    def decide(self) -> bool:
        self.decisions += 1
        self.trying = None
        if not self.plain:
            return False
        if not self.drafted:
            self.trying = True
            return True
        favoured = self.favours_drafts()
        if self.decisions < self.next_try:
            return favoured
        confirmed = favoured == self.favoured_then
        self.wait = min(2 * self.wait, LAST_TRY) if confirmed else FIRST_TRY
        self.favoured_then = favoured
        self.next_try = self.decisions + self.wait
        self.trying = not favoured
        return not favoured

    def observe(self, drafted: bool, rate: float) -> None:
        """A step's rate. A try that beat the other way's rate means the traffic changed: its
        way's rate starts over from it (the older ones are of the traffic before). One that
        lost by little is tried again soon, as it costs little."""
        window = self.drafted if drafted else self.plain
        other = self.plain if drafted else self.drafted
        if self.trying is drafted and other:
            best = statistics.median(other)
            if rate > best:
                window.clear()
                self.favoured_then = None
            if rate >= (1 - CLOSE) * best:
                self.wait = FIRST_TRY
                self.next_try = self.decisions + FIRST_TRY
        self.trying = None
        window.append(rate)


def size_class(rows: int) -> int:
    """The size class of a step of `rows` decoding requests: 1, 2, 3-4, 5-8, 9-16, ... (a
    server full at a power of two, one request short of it between steps, stays in one)."""
    return (max(rows, 1) - 1).bit_length()


class DraftGate:
    """Decides, before each step, whether its requests draft, from what steps of about its
    size gave with drafts and without."""

    def __init__(self) -> None:
        self._classes: dict[int, _Rates] = {}

    def drafts(self, rows: int) -> bool:
        """Whether a step of `rows` decoding requests should draft (see the module's
        docstring)."""
        return self._classes.setdefault(size_class(rows), _Rates()).decide()

    def try_drafts(self, rows: int) -> bool:
        """Turn the last decision for steps of `rows` requests, plain where plain steps have
        been faster, into a try of drafts (a drafter saw drafts likely kept: the traffic may
        have changed), at most once in `FIRST_TRY` decisions. Whether it did."""
        rates = self._classes.get(size_class(rows))
        if rates is None or rates.trying is not None or not rates.drafted:
            return False
        if rates.favours_drafts() or rates.decisions < rates.last_asked + FIRST_TRY:
            return False
        rates.trying, rates.last_asked = True, rates.decisions
        return True

    def tries_drafts(self, rows: int) -> bool:
        """Whether the last decision for steps of `rows` requests was to try drafts where steps
        without have been faster (or not yet measured with them)."""
        found = self._classes.get(size_class(rows))
        return found is not None and found.trying is True

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step of `rows` requests, with drafts or without, gave `tokens` output
        tokens in `seconds`."""
        if seconds <= 0 or rows <= 0:
            return
        self._classes.setdefault(size_class(rows), _Rates()).observe(drafted, tokens / seconds)

    def rates(self, rows: int) -> tuple[float | None, float | None]:
        """The measured (with drafts, without) output tokens per second of this size class
        (None: not measured yet)."""
        found = self._classes.get(size_class(rows), _Rates())
        return _median(found.drafted), _median(found.plain)


def _median(values: deque[float]) -> float | None:
    return statistics.median(values) if values else None
