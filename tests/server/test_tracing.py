"""Request spans: one per completion or chat request, with the GenAI attributes, the engine's
timings and the outcome, continuing the caller's traceparent; exported over OTLP/HTTP. And the
JSON log line per request made of the same attributes."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import ClassVar

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode

from server.log_format import JsonFormatter
from server.settings import ServerSettings
from server.tracing import OutputLogging, Tracing, output_logging
from tests.server_utils import app_client, blocks_in_use, live_server, until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
PROMPT = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def in_memory() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return Tracing.with_processor(SimpleSpanProcessor(exporter)), exporter


async def until_spans(exporter: InMemorySpanExporter, count: int) -> list:
    for _ in range(500):
        spans = exporter.get_finished_spans()
        if len(spans) >= count:
            return list(spans)
        await asyncio.sleep(0.01)
    raise AssertionError(f"{count} spans not finished")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_span_carries_the_request_usage_and_timings(stream: bool):
    tracing, exporter = in_memory()
    async with app_client(tracing=tracing) as (client, _):
        response = await client.post(
            "/v1/completions",
            json={**PROMPT, "stream": stream},
            headers={"traceparent": TRACEPARENT, "x-request-id": "client-42"},
        )
        assert response.status_code == 200
        [span] = await until_spans(exporter, 1)
    assert span.name == "text_completion tiny" and span.kind == SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    a = span.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == "tiny"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (5, 0.5)
    assert a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 5
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.response.id"].startswith("cmpl-")
    assert a["http.request.header.x-request-id"] == ("client-42",)
    assert a["http.response.status_code"] == 200
    for name in ("time_in_queue", "time_to_first_token", "time_in_model_decode", "e2e"):
        assert a[f"gen_ai.latency.{name}"] >= 0
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]
    assert span.status.status_code == StatusCode.UNSET


async def test_a_chat_span_and_cached_prompt_tokens():
    tracing, exporter = in_memory()
    async with app_client(tracing=tracing) as (client, _):
        for _ in range(2):
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        first, second = await until_spans(exporter, 2)
    assert first.name == "chat tiny" and first.attributes["gen_ai.operation.name"] == "chat"
    assert first.attributes["gen_ai.response.id"].startswith("chatcmpl-")
    assert second.attributes["gen_ai.usage.cache_read.input_tokens"] > 0
    assert first.context.trace_id != second.context.trace_id  # no traceparent: new traces


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({**PROMPT, "stop": ["x"] * 100}, 400),
        ({**PROMPT, "model": "other"}, 404),
        ({**PROMPT, "timeout": 1e-6}, 504),
    ],
    ids=["400", "404", "504"],
)
async def test_errors_set_the_span_status(body, status):
    tracing, exporter = in_memory()
    async with app_client(tracing=tracing) as (client, engine):
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == status, response.text
        [span] = await until_spans(exporter, 1)
        assert blocks_in_use(engine) == 0
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["http.response.status_code"] == status
    assert any(event.name == "exception" for event in span.events)


async def test_overload_is_a_503_span():
    tracing, exporter = in_memory()
    async with app_client(tracing=tracing, max_waiting_requests=0) as (client, _):
        response = await client.post("/v1/completions", json=PROMPT)
        assert response.status_code == 503
        [span] = await until_spans(exporter, 1)
    assert span.attributes["http.response.status_code"] == 503
    assert span.status.status_code == StatusCode.ERROR


async def test_a_client_that_leaves_mid_stream_ends_its_span_as_aborted():
    tracing, exporter = in_memory()
    async with live_server(tracing=tracing) as server, httpx.AsyncClient() as client:
        body = {**PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as reply:
            async for _ in reply.aiter_lines():
                break  # one event, then hang up
        [span] = await until_spans(exporter, 1)
    assert span.attributes["http.response.status_code"] == 499
    assert [event.name for event in span.events] == ["aborted"]


class _Receiver(BaseHTTPRequestHandler):
    received: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        self.received.append(body)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


async def test_spans_reach_an_otlp_http_receiver():
    """The real exporter: the receiver decodes the protobuf it gets."""
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_port}/v1/traces"
    try:
        tracing = Tracing.from_endpoint(endpoint)
        settings = ServerSettings(served_model_name="tiny")
        async with app_client(settings, tracing=tracing) as (client, _):
            assert (await client.post("/v1/completions", json=PROMPT)).status_code == 200
        await asyncio.to_thread(tracing.shutdown)  # flushes the batch
    finally:
        receiver.shutdown()
    spans = []
    for body in _Receiver.received:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    [span] = spans
    assert span.name == "text_completion tiny"
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["gen_ai.usage.output_tokens"].int_value == 5


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert not Tracing.from_endpoint(None).enabled
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    assert Tracing.from_endpoint(None).enabled


async def test_a_log_line_per_request_ties_the_request_id_to_the_trace(caplog):
    exporter = InMemorySpanExporter()
    tracing = Tracing.with_processor(SimpleSpanProcessor(exporter), log_requests=True)
    caplog.set_level("INFO", logger="conveyor.requests")
    async with app_client(tracing=tracing) as (client, _):
        ok = await client.post("/v1/completions", json=PROMPT, headers={"x-request-id": "r-1"})
        bad = await client.post("/v1/completions", json={**PROMPT, "stop": ["x"] * 100})
        assert (ok.status_code, bad.status_code) == (200, 400)
        spans = await until_spans(exporter, 2)
    lines = [r.fields for r in caplog.records if r.name == "conveyor.requests"]
    assert len(lines) == 2
    line = next(f for f in lines if f["status"] == 200)
    assert line["request_id"] == "r-1" and line["response_id"] == ok.json()["id"]
    assert (line["operation"], line["model"]) == ("text_completion", "tiny")
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 5
    assert line["finish_reasons"] == ["length"] and line["e2e_s"] >= line["ttft_s"] > 0
    span = next(s for s in spans if s.attributes["http.response.status_code"] == 200)
    assert line["trace_id"] == format(span.context.trace_id, "032x")
    refused = next(f for f in lines if f["status"] == 400)
    assert "stop strings" in refused["error"]


async def test_request_lines_without_tracing(caplog):
    caplog.set_level("INFO", logger="conveyor.requests")
    async with app_client(tracing=Tracing(log_requests=True)) as (client, _):
        body = {**CHAT, "stream": True}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        for _ in range(100):
            if caplog.records:
                break
            await asyncio.sleep(0.01)
    [record] = [r for r in caplog.records if r.name == "conveyor.requests"]
    assert record.fields["operation"] == "chat" and record.fields["stream"] is True
    assert "trace_id" not in record.fields


def test_the_json_formatter_writes_one_object_with_the_fields():
    record = logging.LogRecord("conveyor.requests", logging.INFO, "", 0, "request", (), None)
    record.fields = {"status": 200, "finish_reasons": ["stop"]}
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "info" and entry["logger"] == "conveyor.requests"
    assert (entry["message"], entry["status"]) == ("request", 200)
    assert entry["finish_reasons"] == ["stop"]


async def test_preemption_and_resumption_are_span_events_at_their_times():
    """A cache too small for three growing sequences preempts one; its span says when it was
    preempted and resumed, within the span."""
    tracing, exporter = in_memory()
    small = {"num_blocks": 20, "max_model_len": 64}  # 80 tokens for three of ~45
    body = {**PROMPT, "max_tokens": 40, "ignore_eos": True}
    async with app_client(tracing=tracing, **small) as (client, engine):
        replies = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(3))
        )
        assert all(r.status_code == 200 for r in replies)
        spans = await until_spans(exporter, 3)
        assert blocks_in_use(engine) == 0
    events = [(span, event) for span in spans for event in span.events]
    names = [event.name for _, event in events]
    assert "preempted" in names and "resumed" in names
    for span, event in events:
        assert span.start_time <= event.timestamp <= span.end_time


def test_the_flag_without_the_otel_extra_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(ValueError, match=r"pip install 'conveyor\[otel\]'"):
        Tracing.from_endpoint("http://127.0.0.1:4318/v1/traces")


@pytest.mark.parametrize("stream", [False, True])
async def test_log_lines_hold_each_outputs_text_cut_to_the_length(caplog, stream: bool):
    """`--enable-log-outputs`: each choice's text, cut to `--max-log-len` characters; without
    it the line holds no text."""
    caplog.set_level("INFO", logger="conveyor.requests")
    body = {
        "model": "tiny",
        "prompt": "Hi",
        "max_tokens": 12,
        "n": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    full = {**body, "stream": False}
    for outputs in (OutputLogging(max_len=5), None):
        caplog.clear()
        tracing = Tracing(log_requests=True, outputs=outputs)
        async with app_client(tracing=tracing) as (client, _):
            texts = [
                c["text"]
                for c in (await client.post("/v1/completions", json=full)).json()["choices"]
            ]
            caplog.clear()
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            await until(lambda: caplog.records, what="the log line")
        [record] = [r for r in caplog.records if r.name == "conveyor.requests"]
        if outputs is None:
            assert "outputs" not in record.fields
        else:
            assert record.fields["outputs"] == [text[:5] for text in texts]
            assert all(len(text) > 5 for text in texts)  # so the cut shows


def test_output_log_lines_need_request_log_lines():
    from server.cli import build_parser, server_settings

    def settings(*argv: str):
        return server_settings(build_parser().parse_args(["serve", *argv]))

    chosen = settings("--enable-log-requests", "--enable-log-outputs", "--max-log-len", "40")
    assert chosen.log_outputs and chosen.max_log_len == 40
    assert output_logging(chosen) == OutputLogging(40)
    assert output_logging(settings("--enable-log-requests")) is None
    with pytest.raises(ValueError, match="--enable-log-requests"):
        settings("--enable-log-outputs")
    with pytest.raises(SystemExit):
        settings("--max-log-len", "-1")
