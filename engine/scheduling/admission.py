"""Admission control: every new request is admitted, deferred or rejected before it queues.

The decision weighs the tokens already promised (queued prompts plus what they may generate)
against the limits, and the KV cache usage against a soft limit past which low-priority
traffic is deferred. A rejection carries a `Retry-After` from the rate at which the queue
currently drains. Imports no torch.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass

from engine.core.sampling_params import SamplingParams


class Admission(enum.Enum):
    ADMIT = "admit"
    DEFER = "defer"
    REJECT = "reject"


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_waiting_requests: int | None = None
    max_queued_tokens: int | None = None
    soft_limit: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.soft_limit <= 1:
            raise ValueError("admission soft limit must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class QueueState:
    """What is already promised when a request arrives."""

    num_waiting: int
    queued_tokens: int
    kv_cache_usage: float


@dataclass(frozen=True, slots=True)
class Decision:
    outcome: Admission
    reason: str = ""
    retry_after: int = 0


# Recent step times kept per batch size. In a plain mean over a window, unlike in a running
# average seeded by its first step, the burst of prompts admitted when load arrives counts as
# one step among many.
STEP_WINDOW = 64


# Estimated finish times are stretched by this margin before they are held against a deadline:
# a request estimated to finish just in time misses it about half the time, and then all the
# work spent on it is lost.
DEADLINE_MARGIN = 1.1


def batch_bucket(num_sequences: int) -> int:
    """Batch sizes grouped by powers of two: 1, 2-3, 4-7, 8-15, ..."""
    return max(1, num_sequences).bit_length()


class DrainRate:
    """Exponentially weighted rates of finished requests and processed tokens per second, and
    step times by batch size: a step with more sequences takes longer, so the inter-token
    latency a new request will see depends on how many run beside it. Step times are averaged
    per step, not per second, since a request's next N tokens take N steps, short or long, over
    a window of recent steps."""

    def __init__(self, half_life: float = 10.0) -> None:
        self._half_life = half_life
        self.requests_per_s = 0.0
        self.tokens_per_s = 0.0
        self.step_s: dict[int, deque[float]] = {}
        self.prefill_tokens_per_s = 0.0

    def _blend(self, old: float, new: float, seconds: float) -> float:
        if old == 0.0:
            return new
        keep = 0.5 ** (seconds / self._half_life)
        return keep * old + (1 - keep) * new

    def record_step(
        self,
        seconds: float,
        finished: int,
        tokens: int,
        prefill_tokens: int,
        decodes: int,
        sequences: int,
    ) -> None:
        if seconds <= 0:
            return
        self.requests_per_s = self._blend(self.requests_per_s, finished / seconds, seconds)
        self.tokens_per_s = self._blend(self.tokens_per_s, tokens / seconds, seconds)
        if decodes:
            window = self.step_s.setdefault(batch_bucket(sequences), deque(maxlen=STEP_WINDOW))
            window.append(seconds)
        if prefill_tokens:
            rate = prefill_tokens / seconds
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, rate, seconds)

    def seconds_to_drain(self, queued_tokens: int) -> float:
        return queued_tokens / self.tokens_per_s if self.tokens_per_s > 0 else 1.0

    def step_seconds(self, num_sequences: int) -> float:
        """A lower bound on the step time with `num_sequences` running: the time measured at
        that batch size or, failing that, at the largest smaller one (0 when none is known,
        so a stale figure from a busier past never turns requests away from an idle engine)."""
        bucket = batch_bucket(num_sequences)
        known = [b for b in self.step_s if b <= bucket]
        if not known:
            return 0.0
        window = self.step_s[max(known)]
        return sum(window) / len(window)

    def fastest_finish(
        self, prompt_tokens: int, min_new_tokens: int, num_sequences: int = 1
    ) -> float:
        """A lower bound on the seconds a request needs when it runs beside `num_sequences - 1`
        others, at the current speed (0 unknown)."""
        prefill = prompt_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0
        return prefill + max(0, min_new_tokens - 1) * self.step_seconds(num_sequences)

    def time_to_finish(
        self, prompt_tokens: int, min_new_tokens: int, num_sequences: int = 1
    ) -> float:
        """The seconds to count on before a request's deadline: its fastest finish with
        `DEADLINE_MARGIN` to spare."""
        return DEADLINE_MARGIN * self.fastest_finish(prompt_tokens, min_new_tokens, num_sequences)


def promised_tokens(
    num_prompt_tokens: int, params: SamplingParams, max_sequence_tokens: int
) -> int:
    """Tokens a request may occupy: its prompt plus its largest possible output."""
    limit = max_sequence_tokens - num_prompt_tokens
    max_tokens = params.max_tokens
    return num_prompt_tokens + (limit if max_tokens is None else min(max_tokens, limit))


def fewest_new_tokens(params: SamplingParams, room: int) -> int:
    """The fewest tokens a request can end with: EOS may come at once unless ignored."""
    if params.ignore_eos:
        return min(params.max_tokens or room, room)
    return max(1, params.min_tokens)


def decide(
    limits: AdmissionLimits,
    state: QueueState,
    new_tokens: int,
    low_priority: bool,
    drain: DrainRate,
) -> Decision:
    """Admit, defer or reject a request promising `new_tokens` (prompt plus max output)."""
    if limits.max_waiting_requests is not None and (
        state.num_waiting >= limits.max_waiting_requests
    ):
        return _reject(f"{state.num_waiting} requests are already waiting", state, drain)
    if limits.max_queued_tokens is not None and (
        state.queued_tokens + new_tokens > limits.max_queued_tokens
    ):
        return _reject(f"{state.queued_tokens} tokens are already queued", state, drain)
    if low_priority and state.kv_cache_usage >= limits.soft_limit:
        return Decision(Admission.DEFER, "deferred")
    return Decision(Admission.ADMIT)


def _reject(reason: str, state: QueueState, drain: DrainRate) -> Decision:
    seconds = drain.seconds_to_drain(state.queued_tokens)
    return Decision(Admission.REJECT, reason, retry_after=max(1, min(600, math.ceil(seconds))))
