"""What the completion and chat renderers share: per-choice bookkeeping and chunk framing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.core.outputs import RequestOutput
from engine.core.stats import FinishedRequestStats, SpecTally
from server.request_metrics import MetricsReport
from server.serving import now
from server.streaming import compact_json, sse

_EMPTY_CHOICES_END = '"choices":[]}'


@dataclass(slots=True)
class ChoiceState:
    """One choice being assembled: its text pieces, counts and how it ended."""

    index: int
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # Drafts from the request's prediction (Predicted Outputs) kept and refused.
    num_prediction_kept: int = 0
    num_prediction_refused: int = 0
    started: bool = False
    # The generated token ids, kept where the request asked for them (`return_token_ids`).
    token_ids: list[int] | None = None
    # Once finished in a step: its timings and verification steps (`request_metrics.py`).
    stats: FinishedRequestStats | None = None
    spec: SpecTally | None = None

    def record(self, output: RequestOutput, text: str) -> None:
        self.pieces.append(text)
        if self.token_ids is not None:
            self.token_ids.extend(output.new_token_ids)
        self.num_output_tokens = output.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        self.num_prediction_kept = output.num_prediction_kept
        self.num_prediction_refused = output.num_prediction_refused
        if output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
            self.stats, self.spec = output.stats, output.spec

    def ending(self, finished: bool) -> dict[str, Any]:
        """The `finish_reason` / `stop_reason` fields of a streamed fragment."""
        return {
            "finish_reason": self.finish_reason if finished else None,
            "stop_reason": self.stop_reason if finished else None,
        }

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class ChunkRenderer:
    """Frames fragments as `object_name` chunks; subclasses fold deltas and count usage."""

    object_name: ClassVar[str]
    choices: dict[int, Any]
    # What a response's `metrics` holds (vLLM's per-request metrics); by default nothing.
    report: MetricsReport = MetricsReport()

    def __init__(
        self, request_id: str, model: str, include_usage: bool, continuous_usage: bool = False
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        # Every chunk carries the usage so far (vLLM's `continuous_usage_stats`).
        self.continuous_usage = continuous_usage
        self.created = now()
        self._event_head: str | None = None
        # The `service_tier` every chunk names, where the request named one.
        self.tier: dict[str, str] = {}

    def usage(self) -> dict[str, Any]:
        raise NotImplementedError

    def finish_reasons(self) -> list[str]:
        return [choice.finish_reason or "abort" for choice in self.choices.values()]

    def texts(self) -> list[str]:
        """Each choice's text as the model wrote it."""
        return [choice.text for choice in self.choices.values()]

    def event(self, choices: list[dict[str, Any]]) -> str:
        """The server-sent event of a chunk without usage: the same text as
        `sse(self.chunk(choices))`, with the fields that never change encoded once; with
        `continuous_usage`, the chunk and the usage so far."""
        if self.continuous_usage:
            return sse(self.chunk(choices, with_usage=True))
        if self._event_head is None:
            empty = compact_json(self.chunk([]))
            if not empty.endswith(_EMPTY_CHOICES_END):  # `choices` is not the last field
                return sse(self.chunk(choices))
            self._event_head = "data: " + empty[: -len("[]}")]
        return f"{self._event_head}{compact_json(choices)}}}\n\n"

    def chunk(self, choices: list[dict[str, Any]], with_usage: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            **self.tier,
            "choices": choices,
        }
        if with_usage:
            body["usage"] = self.usage()
            if all(choice.finish_reason for choice in self.choices.values()):
                body.update(self.metrics_field())
        return body

    def metrics_field(self) -> dict[str, Any]:
        """`{"metrics": ...}` where the server reports them: a lone sequence's (None for
        several, whose timings no one sequence tells), else nothing."""
        if not self.report.reports:
            return {}
        choices = list(self.choices.values())
        if len(choices) != 1:
            return {"metrics": None}
        return {"metrics": self.report.of(choices[0].stats, choices[0].spec)}
