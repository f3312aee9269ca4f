"""Pausing generation between two steps, as RL trainers do around a weight update (vLLM's
`/pause` and `/resume`).

A pause takes one of three modes: `abort` ends every request in flight at once, `wait` lets them
finish, and `keep` freezes them where they are (they go on after the resume). Requests that
arrive while paused are held, not refused, and start at the resume. A `pause()` returns once the
engine rests: frozen, or drained of the requests it had; then, unless frozen with requests in
it, the prefix cache is forgotten when a caller asked for it (its blocks were computed with the
weights about to change).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.core.errors import ConveyorError, InvalidRequestError

PAUSE_MODES = ("abort", "wait", "keep")


class PauseInterruptedError(ConveyorError):
    """A resume came before the pause it interrupts took effect."""

    def __init__(self) -> None:
        super().__init__(
            "Generation was resumed before the pause took effect.", code="pause_interrupted"
        )


def check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(
            f"mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}.", param="mode"
        )


@dataclass(slots=True)
class Pause:
    """One pause, from the first `pause()` to the `resume()`: whether it froze the requests in
    flight, and the callers waiting for it to take effect with whether each wants the cache
    forgotten."""

    frozen: bool = False
    waiters: list[tuple[asyncio.Future[None], bool]] = field(default_factory=list)

    def ask(self, mode: str, clear_cache: bool) -> asyncio.Future[None]:
        """Another caller's pause: `keep` freezes a draining pause at once."""
        self.frozen = self.frozen or mode == "keep"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append((done, clear_cache and mode != "keep"))
        return done

    def rests(self, drained: bool) -> bool:
        """Whether the engine stops stepping now."""
        return self.frozen or drained

    @property
    def wants_clear(self) -> bool:
        return any(clear for done, clear in self.waiters if not done.done())

    def settle(self) -> None:
        """The pause took effect: every caller waiting returns."""
        for done, _ in self.waiters:
            if not done.done():
                done.set_result(None)
        self.waiters.clear()

    def fail(self, error: BaseException) -> None:
        for done, _ in self.waiters:
            if not done.done():
                done.set_exception(error)
        self.waiters.clear()
