"""Plain stats the engine reports each step; the server turns them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request
from engine.kv.residency import Eviction


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """Timings of one finished sequence, in seconds (None where it never got that far)."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    time_to_first_token: float | None
    prefill_time: float | None
    decode_time: float | None
    inference_time: float | None
    # The request this sequence belongs to, and how many sequences it has (`n`).
    parent_id: str = ""
    siblings: int = 1
    # What the scheduler did with it: (monotonic time, what), as `RequestTimings.events`.
    events: tuple[tuple[float, str], ...] = ()
    # Its prompt tokens found in the prefix cache rather than computed.
    num_cached_tokens: int = 0

    @property
    def time_per_output_token(self) -> float | None:
        if self.decode_time is None or self.num_generation_tokens < 2:
            return None
        return self.decode_time / (self.num_generation_tokens - 1)

    @classmethod
    def of(
        cls, request: Request, now: float, parent_id: str = "", siblings: int = 1
    ) -> FinishedRequestStats:
        t = request.timings
        queue = _span(request.arrival_time, t.first_scheduled)
        return cls(
            finish_reason=str(request.finish_reason or "abort"),
            num_prompt_tokens=request.num_prompt_tokens,
            num_generation_tokens=request.num_output_tokens,
            e2e_latency=now - request.arrival_time,
            queue_time=queue,
            time_to_first_token=_span(request.arrival_time, t.first_token),
            prefill_time=_span(t.first_scheduled, t.first_token),
            decode_time=_span(t.first_token, t.last_token),
            inference_time=_span(t.first_scheduled, t.last_token),
            parent_id=parent_id or request.request_id,
            siblings=siblings,
            events=tuple(t.events),
            num_cached_tokens=request.num_cached_tokens,
        )


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start)


@dataclass(frozen=True, slots=True)
class RequestParamsStats:
    """The `n` and effective `max_tokens` of a request, recorded when it is submitted."""

    n: int
    max_tokens: int
    # The kind of output format it asks for (`StructuredOutputs.kind`), None for free text.
    structured: str | None = None


@dataclass(slots=True)
class DraftStats:
    """Speculation since the last report (vLLM's `spec_decode` counters): drafts verified,
    their tokens, the tokens kept, and how many were kept at each position of a draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += kept
        missing = kept - len(self.accepted_per_position)
        self.accepted_per_position.extend([0] * max(0, missing))
        for position in range(kept):
            self.accepted_per_position[position] += 1


@dataclass(slots=True)
class SpecTally:
    """One request's verification steps (vLLM's per-request acceptance metrics): for each
    number of drafts a step verified, how many steps kept each count of them; with
    `per_step`, each step's (drafted, kept) in order too. `num_spec_tokens` is the most
    drafts a step of this request may verify."""

    num_spec_tokens: int
    by_length: dict[int, list[int]] = field(default_factory=dict)
    per_step: list[tuple[int, int]] | None = None

    def record(self, drafted: int, kept: int) -> None:
        counts = self.by_length.setdefault(drafted, [0] * (drafted + 1))
        counts[kept] += 1
        if self.per_step is not None:
            self.per_step.append((drafted, kept))


@dataclass(slots=True)
class StepStats:
    """Queue and cache state after a step, what the step produced, and who finished."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    # Of those, the tokens the prefix cache held (the rest were computed).
    num_cached_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_waiting_deferred: int = 0
    num_rejections: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    new_requests: list[RequestParamsStats] = field(default_factory=list)
    # Seconds each output format compiled since the last step took (cached formats do not).
    grammar_compile_seconds: list[float] = field(default_factory=list)
    # With LoRA adapters served: the adapters running and waiting requests run, by name.
    running_loras: tuple[str, ...] | None = None
    waiting_loras: tuple[str, ...] = ()
    drafts: DraftStats = field(default_factory=DraftStats)
    # Sampled prefix-cache blocks evicted since the last step (with `--kv-cache-metrics`).
    kv_evictions: list[Eviction] = field(default_factory=list)
