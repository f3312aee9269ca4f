"""vLLM's per-request `metrics` object: a lone sequence's timings
(`--enable-per-request-metrics`) and its speculative verification steps
(`--per-request-spec-decode-metrics`), on the response, or streamed on the usage chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.stats import FinishedRequestStats, SpecTally


@dataclass(frozen=True, slots=True)
class MetricsReport:
    """What a response's `metrics` holds: its timings (`timing`), its verification steps
    (`spec`: "none", "summary" or "detailed")."""

    timing: bool = False
    spec: str = "none"

    @property
    def reports(self) -> bool:
        return self.timing or self.spec != "none"

    def of(self, stats: FinishedRequestStats | None, tally: SpecTally | None) -> dict[str, Any]:
        """The `metrics` object of one finished sequence."""
        found: dict[str, Any] = timings(stats) if self.timing else {}
        if self.spec != "none":
            found["speculative_decoding"] = (
                acceptance(tally, self.spec == "detailed") if tally is not None else None
            )
        return found


def timings(stats: FinishedRequestStats | None) -> dict[str, Any]:
    """vLLM's timing fields, in milliseconds (None where the sequence never got that far):
    time to first token and tokens per second count from when it was first scheduled."""
    if stats is None:
        stats = _NOTHING
    tokens, spent = stats.num_generation_tokens, stats.inference_time
    return {
        "time_to_first_token_ms": _ms(stats.prefill_time),
        "generation_time_ms": _ms(stats.decode_time),
        "queue_time_ms": _ms(stats.queue_time),
        "mean_itl_ms": _ms(stats.time_per_output_token),
        "tokens_per_second": tokens / spent if spent else None,
    }


_NOTHING = FinishedRequestStats("abort", 0, 0, 0.0, None, None, None, None, None)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def acceptance(tally: SpecTally, detailed: bool) -> dict[str, Any]:
    """vLLM's `metrics.speculative_decoding` of one sequence's verification steps (ratios
    None where it verified nothing)."""
    steps = sum(sum(counts) for counts in tally.by_length.values())
    drafted = sum(k * sum(counts) for k, counts in tally.by_length.items())
    kept = sum(j * n for counts in tally.by_length.values() for j, n in enumerate(counts))
    histogram = [0] * (max([tally.num_spec_tokens, *tally.by_length]) + 1)
    for counts in tally.by_length.values():
        for j, n in enumerate(counts):
            histogram[j] += n
    found: dict[str, Any] = {
        "mean_acceptance_length": 1 + kept / steps if steps else None,
        "draft_acceptance_rate": kept / drafted if drafted else None,
        "acceptance_histogram": histogram,
        "acceptance_histogram_by_draft_length": {
            str(k): list(counts) for k, counts in sorted(tally.by_length.items())
        },
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": kept,
        "num_draft_tokens": drafted,
        "num_spec_tokens": tally.num_spec_tokens,
    }
    if detailed:
        per_step = tally.per_step or []
        found["per_step_accepted"] = [kept for _, kept in per_step]
        found["per_step_drafted"] = [drafted for drafted, _ in per_step]
    return found
