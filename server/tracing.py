"""Request tracing with OpenTelemetry: one server span per completion or chat request; and,
with `--log-format json`, one log line per request made of the same attributes.

Off unless `--otlp-traces-endpoint` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; then
spans go out over OTLP/HTTP through the OpenTelemetry SDK (the optional `otel` extra), which
also reads the other standard `OTEL_EXPORTER_OTLP_*` variables. When off nothing is imported
and a request costs one attribute lookup.

A span is named as the GenAI conventions name it (`chat {model}`, `text_completion {model}`),
continues the caller's W3C `traceparent`, and carries the request's settings, its usage and
finish reasons, the timings the engine measured for its sequences (queue, time to first token,
prefill, decode, end to end: the same as the Prometheus histograms), and events for what the
scheduler did with it (deferred admission, preemption, pause, resumption), a client that went
away or a deadline that passed. An error sets the span's status.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.core.stats import FinishedRequestStats, StepStats
from server.errors import to_api_error
from server.settings import ServerSettings
from server.streaming import CLIENT_GONE

ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"

# Engine timings (seconds) as span attributes, under the names vLLM's spans use.
TIMING_ATTRIBUTES = {
    "queue_time": "gen_ai.latency.time_in_queue",
    "time_to_first_token": "gen_ai.latency.time_to_first_token",
    "prefill_time": "gen_ai.latency.time_in_model_prefill",
    "decode_time": "gen_ai.latency.time_in_model_decode",
    "inference_time": "gen_ai.latency.time_in_model_inference",
    "e2e_latency": "gen_ai.latency.e2e",
}

# A request's log line (`--log-format json`): attribute -> key.
LOG_FIELDS = {
    "http.request.header.x-request-id": "request_id",
    "gen_ai.response.id": "response_id",
    "gen_ai.operation.name": "operation",
    "gen_ai.request.model": "model",
    "conveyor.stream": "stream",
    "http.response.status_code": "status",
    "gen_ai.usage.input_tokens": "prompt_tokens",
    "gen_ai.usage.output_tokens": "completion_tokens",
    "gen_ai.usage.cache_read.input_tokens": "cached_tokens",
    "gen_ai.response.finish_reasons": "finish_reasons",
    "gen_ai.latency.time_in_queue": "queue_time_s",
    "gen_ai.latency.time_to_first_token": "ttft_s",
    "gen_ai.latency.time_in_model_prefill": "prefill_time_s",
    "gen_ai.latency.time_in_model_decode": "decode_time_s",
    "gen_ai.latency.e2e": "e2e_s",
}
REQUEST_LOG = logging.getLogger("conveyor.requests")


class Produced(Protocol):
    """What a request's renderer tells of its output."""

    def usage(self) -> dict[str, Any]: ...

    def finish_reasons(self) -> list[str]: ...

    def texts(self) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class OutputLogging:
    """Each choice's text in the request's log line (vLLM's `--enable-log-outputs`), cut to
    `max_len` characters (`--max-log-len`; None: whole)."""

    max_len: int | None = None

    def cut(self, text: str) -> str:
        return text if self.max_len is None else text[: self.max_len]


class RequestTrace:
    """One request, observed until its response (or stream) ends: its span when tracing, and
    the attributes its log line is made of."""

    def __init__(self, tracing: Tracing, span: Any, attributes: dict[str, Any]) -> None:
        self.tracing = tracing
        self.span = span
        self.attributes = attributes
        self.events: list[str] = []
        self.error: str | None = None
        self.request_id: str | None = None
        self.sequences: list[FinishedRequestStats] = []
        self.outputs: list[str] | None = None
        self.status = 200
        self.ended = False

    def set(self, name: str, value: Any) -> None:
        self.attributes[name] = value
        if self.span is not None:
            self.span.set_attribute(name, value)

    def event(
        self, name: str, attributes: dict[str, Any] | None = None, at: int | None = None
    ) -> None:
        """An event now, or `at` (ns since the epoch)."""
        self.events.append(name)
        if self.span is not None:
            self.span.add_event(name, attributes, at)

    def bind(self, request_id: str, response_id: str | None = None) -> None:
        """The engine's id for the request, so that its sequences' timings find it, and the id
        its response shows (the same, unless the client named the request)."""
        self.request_id = request_id
        self.set("gen_ai.response.id", response_id or request_id)
        self.tracing.open[request_id] = self

    def output(self, produced: Produced) -> None:
        """What the request produced: usage, finish reasons, and each choice's text (which
        reaches the log line only where output logging is on)."""
        if self.tracing.outputs is not None:
            self.outputs = [self.tracing.outputs.cut(text) for text in produced.texts()]
        usage, finish_reasons = produced.usage(), produced.finish_reasons()
        self.set("gen_ai.usage.input_tokens", usage["prompt_tokens"])
        self.set("gen_ai.usage.output_tokens", usage["completion_tokens"])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.set("gen_ai.usage.cache_read.input_tokens", cached)
        self.set("gen_ai.response.finish_reasons", finish_reasons)
        if "timeout" in finish_reasons:
            self.event("deadline expired")

    def fail(self, exc: BaseException) -> None:
        """An error the client gets (its status), or a stream cut short by one."""
        self.status = to_api_error(exc).status if isinstance(exc, Exception) else 500
        self.error = str(exc) or type(exc).__name__
        if self.span is not None:
            self.span.record_exception(exc)
            self.span.set_status(self.tracing.error_status(self.error))

    def end(self, status: int | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if status is not None:
            self.status = status
        if self.status == CLIENT_GONE:
            self.event("aborted", {"reason": "the client went away"})
        elif self.status >= 400 and self.error is None:
            self.error = f"HTTP {self.status}"
            if self.span is not None:
                self.span.set_status(self.tracing.error_status(self.error))
        self.set("http.response.status_code", self.status)
        self._scheduler_events()
        self._timings()
        if self.request_id is not None:
            self.tracing.open.pop(self.request_id, None)
        if self.span is not None:
            self.span.end()
        self.tracing.finished(self)

    def _scheduler_events(self) -> None:
        """What the scheduler did with the sequences (deferred admission, preemption, pause,
        resumption), at the times it did it."""
        wall, monotonic = time.time_ns(), time.monotonic()
        for when, name in sorted({event for s in self.sequences for event in s.events}):
            self.event(name, at=wall - int((monotonic - when) * 1e9))

    def _timings(self) -> None:
        """The first sequence's queue and first-token times; the longest decode and total."""
        if not self.sequences:
            return
        first = min(self.sequences, key=lambda s: s.time_to_first_token or float("inf"))
        last = max(self.sequences, key=lambda s: s.e2e_latency)
        for field, name in TIMING_ATTRIBUTES.items():
            source = first if field in ("queue_time", "time_to_first_token") else last
            value = getattr(source, field)
            if value is not None:
                self.set(name, value)

    def log_fields(self) -> dict[str, Any]:
        """The request's log line: its ids, outcome, token counts and timings."""
        fields: dict[str, Any] = {"event": "request"}
        for attribute, key in LOG_FIELDS.items():
            value = self.attributes.get(attribute)
            if attribute.startswith("http.request.header") and value:
                value = value[0]
            if value is not None:
                fields[key] = round(value, 6) if isinstance(value, float) else value
        if self.span is not None:
            fields["trace_id"] = format(self.span.get_span_context().trace_id, "032x")
        if self.error is not None:
            fields["error"] = self.error
        if self.events:
            fields["events"] = self.events
        if self.outputs is not None:
            fields["outputs"] = self.outputs
        return fields


class Tracing:
    """Observes each completion and chat request when a tracer is configured (a span) or
    request logging is on (a log line); otherwise does nothing."""

    def __init__(
        self,
        tracer: Any = None,
        provider: Any = None,
        log_requests: bool = False,
        outputs: OutputLogging | None = None,
    ):
        self.tracer = tracer
        self.provider = provider
        self.log_requests = log_requests
        # What of each choice's text the log line holds (None: nothing).
        self.outputs = outputs if log_requests else None
        self.open: dict[str, RequestTrace] = {}

    @classmethod
    def from_endpoint(
        cls, endpoint: str | None, log_requests: bool = False, outputs: OutputLogging | None = None
    ) -> Tracing:
        """Tracing that exports to `endpoint` (or the environment's), or none; and a log line
        per request with `log_requests`, holding its outputs with `outputs`."""
        endpoint = endpoint or os.environ.get(ENDPOINT_VARIABLE)
        if not endpoint:
            return cls(log_requests=log_requests, outputs=outputs)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ValueError(
                "--otlp-traces-endpoint needs the OpenTelemetry packages: "
                "pip install 'conveyor[otel]'"
            ) from exc
        exporter = OTLPSpanExporter(endpoint=endpoint)
        return cls.with_processor(BatchSpanProcessor(exporter), log_requests, outputs)

    @classmethod
    def with_processor(
        cls, processor: Any, log_requests: bool = False, outputs: OutputLogging | None = None
    ) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        provider = TracerProvider(resource=Resource.create({"service.name": "conveyor"}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("conveyor"), provider, log_requests, outputs)

    @property
    def enabled(self) -> bool:
        return self.tracer is not None or self.log_requests

    def start(self, operation: str, model: str, body: Any, request: Request) -> RequestTrace:
        attributes = _request_attributes(operation, model, body, request)
        if self.tracer is None:
            return RequestTrace(self, None, attributes)
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(
            f"{operation} {model}",
            context=extract(dict(request.headers)),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )
        return RequestTrace(self, span, attributes)

    def finished(self, trace: RequestTrace) -> None:
        if self.log_requests:
            REQUEST_LOG.info("request", extra={"fields": trace.log_fields()})

    async def traced(
        self,
        operation: str,
        model: str,
        body: Any,
        request: Request,
        handle: Callable[[Any, Request], Awaitable[Response]],
    ) -> Response:
        """`handle(body, request)` inside the request's span; a stream's span ends with it."""
        if not self.enabled:
            return await handle(body, request)
        trace = self.start(operation, model, body, request)
        request.state.trace = trace
        try:
            response = await handle(body, request)
        except BaseException as exc:
            trace.fail(exc)
            trace.end()
            raise
        if not isinstance(response, StreamingResponse):
            trace.end(response.status_code)
        return response

    def record(self, stats: StepStats) -> None:
        """A stats logger: the timings of finished sequences, for the spans still open."""
        for sequence in stats.finished:
            trace = self.open.get(sequence.parent_id) or self.open.get(
                sequence.parent_id.rsplit("-", 1)[0]
            )
            if trace is not None:
                trace.sequences.append(sequence)

    def error_status(self, description: str) -> Any:
        from opentelemetry.trace import Status, StatusCode

        return Status(StatusCode.ERROR, description)

    def shutdown(self) -> None:
        """Send what is still buffered."""
        if self.provider is not None:
            self.provider.shutdown()


def output_logging(settings: ServerSettings) -> OutputLogging | None:
    """What of each output the request log lines hold, as the settings ask."""
    return OutputLogging(settings.max_log_len) if settings.log_outputs else None


def request_trace(request: Request) -> RequestTrace | None:
    return getattr(request.state, "trace", None)


def _request_attributes(operation: str, model: str, body: Any, request: Request) -> dict[str, Any]:
    settings = {
        "gen_ai.request.max_tokens": body.requested_max_tokens,
        "gen_ai.request.temperature": body.temperature,
        "gen_ai.request.top_p": body.top_p,
        "gen_ai.request.choice.count": body.n,
        "gen_ai.request.seed": body.seed,
    }
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "conveyor.stream": bool(body.stream),
        **{name: value for name, value in settings.items() if value is not None},
    }
    request_id = getattr(request.state, "request_id", None)
    if request_id:
        attributes["http.request.header.x-request-id"] = [request_id]
    return attributes
