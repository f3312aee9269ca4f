"""How long the prefix cache keeps its blocks, sampled (vLLM's `--kv-cache-metrics`).

A sampled share of the blocks handed out is followed from the moment it is taken: each time a
later request finds it in the prefix cache is a hit, and when the cache evicts it (its slot
taken for other tokens) the block reports its lifetime (taken to evicted), how long it sat
unused before the eviction (since its last hit, else since it was taken) and the gaps between
its last few hits. A block that returns to the free list without ever being cached, or that a
cache reset forgets, reports nothing: it left the cache without being evicted from it.
Operators read these to size the cache (blocks evicted seconds after their last hit call for
more memory) and routers to set how long they trust a replica to hold a prefix.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

# The hits a block remembers for its gaps, as vLLM keeps them (its last four: three gaps).
REMEMBERED_HITS = 4


@dataclass(frozen=True, slots=True)
class Eviction:
    """What one sampled block reports when the cache evicts it, in seconds."""

    lifetime: float
    idle: float
    reuse_gaps: tuple[float, ...]


@dataclass(slots=True)
class _Followed:
    taken: float
    hits: deque[float] = field(default_factory=lambda: deque(maxlen=REMEMBERED_HITS))

    def eviction(self, now: float) -> Eviction:
        last = self.hits[-1] if self.hits else self.taken
        gaps = tuple(later - earlier for earlier, later in pairwise(self.hits))
        return Eviction(now - self.taken, now - last, gaps)


class BlockResidency:
    """Follows a `sample_rate` share of the blocks a `BlockManager` hands out."""

    def __init__(
        self,
        sample_rate: float,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(
                f"the KV cache metrics' sample rate must be in (0, 1], got {sample_rate}"
            )
        self.sample_rate = sample_rate
        self._rng = rng or random.Random()
        self._clock = clock
        self._followed: dict[int, _Followed] = {}
        self._evictions: list[Eviction] = []

    def taken(self, block: int) -> None:
        """`block` was handed out for new tokens: followed from now, if sampled."""
        if self._rng.random() < self.sample_rate:
            self._followed[block] = _Followed(self._clock())
        else:
            self._followed.pop(block, None)

    def hit(self, block: int) -> None:
        """A request found `block` in the prefix cache."""
        followed = self._followed.get(block)
        if followed is not None:
            followed.hits.append(self._clock())

    def evicted(self, block: int) -> None:
        """The cache gave up `block`'s tokens to make room: it reports, if followed."""
        followed = self._followed.pop(block, None)
        if followed is not None:
            self._evictions.append(followed.eviction(self._clock()))

    def dropped(self, block: int) -> None:
        """`block` left without an eviction (freed uncached, or forgotten by a reset)."""
        self._followed.pop(block, None)

    def take(self) -> list[Eviction]:
        """The evictions reported since the last call."""
        evictions, self._evictions = self._evictions, []
        return evictions

    @property
    def num_followed(self) -> int:
        return len(self._followed)
