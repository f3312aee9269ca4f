"""Structured outputs through the HTTP API: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, streamed or not, with `n`, `logprobs`
and seeds; bad formats get a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest

from engine.structured.compiler import GrammarCompiler
from tests.helpers import tiny_tokenizer
from tests.server_utils import app_client, blocks_in_use, sse_events, wait_until_idle

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city."}]
BASE = {"model": "tiny", "max_tokens": 80, "seed": 3}
CLOSERS = [tiny_tokenizer().convert_tokens_to_ids(c) for c in ('"', "}")]
# Structural tags a random model must open at once.
FORCED_CALL = {
    "structures": [{"begin": "<call=city>", "schema": SCHEMA, "end": "</call>"}],
    "triggers": ["<call="],
    "at_least_one": True,
}
FORCED_FORMAT = {
    "type": "sequence",
    "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "regex", "pattern": "yes|no"},
    ],
}


async def chat(client, **body):
    response = await client.post(
        "/v1/chat/completions", json={**BASE, "messages": MESSAGES, **body}
    )
    assert response.status_code == 200, response.text
    return response.json()


async def complete(client, **body):
    response = await client.post("/v1/completions", json={**BASE, "prompt": "Hi", **body})
    assert response.status_code == 200, response.text
    return response.json()


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}


async def test_response_format_json_schema_in_chat():
    async with app_client() as (client, engine):
        body = await chat(client, response_format=json_schema_format(SCHEMA), n=2)
        for choice in body["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
            assert choice["finish_reason"] == "stop"
        assert blocks_in_use(engine) == 0


async def test_response_format_json_object_in_completions():
    bias = {str(CLOSERS[0]): 4, str(CLOSERS[1]): 4}  # short strings: see test_formats
    async with app_client() as (client, _):
        body = await complete(
            client, response_format={"type": "json_object"}, logit_bias=bias, max_tokens=200
        )
        assert body["choices"][0]["finish_reason"] == "stop"
        assert isinstance(json.loads(body["choices"][0]["text"]), dict)


async def test_response_format_text_is_free_text():
    async with app_client() as (client, _):
        free = await complete(client, temperature=0, ignore_eos=True, max_tokens=8)
        text = await complete(
            client, temperature=0, ignore_eos=True, max_tokens=8, response_format={"type": "text"}
        )
        assert text["choices"][0]["text"] == free["choices"][0]["text"]


@pytest.mark.parametrize(
    ("field", "check"),
    [
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"structured_outputs": {"regex": "[a-c]{2}[0-9]"}}, re.compile("[a-c]{2}[0-9]").fullmatch),
        ({"guided_regex": "[a-c]{2}[0-9]"}, re.compile("[a-c]{2}[0-9]").fullmatch),
        (
            {"structured_outputs": {"json": SCHEMA}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        (
            {"guided_json": json.dumps(SCHEMA)},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
        ({"structured_outputs": {"json_object": True}}, lambda t: t.startswith("{")),
        ({"guided_grammar": 'start: "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
        (
            {"response_format": {"type": "structural_tag", **FORCED_CALL}},
            # the call first; free text may follow it
            re.compile(
                r'<call=city>\{"city": "[^"]*", "population": \d+, "coastal": \w+\}</call>'
            ).match,
        ),
        (
            {"response_format": {"type": "structural_tag", "format": FORCED_FORMAT}},
            re.compile(r"Answer: (yes|no)").fullmatch,
        ),
        (
            {"structured_outputs": {"structural_tag": json.dumps(FORCED_CALL)}},
            lambda t: t.startswith("<call=city>{") and "}</call>" in t,
        ),
    ],
    ids=[
        "choice",
        "guided_choice",
        "regex",
        "guided_regex",
        "json",
        "guided_json",
        "json_object",
        "guided_grammar",
        "structural_tag",
        "structural_tag_format",
        "structured_outputs_structural_tag",
    ],
)
async def test_vllm_fields(field: dict, check) -> None:
    async with app_client() as (client, _):
        body = await complete(client, **field)
        assert check(body["choices"][0]["text"]), body["choices"][0]["text"]


async def test_streamed_deltas_join_into_the_same_document():
    async with app_client() as (client, _):
        fmt = json_schema_format(SCHEMA)
        whole = await chat(client, response_format=fmt)
        response = await client.post(
            "/v1/chat/completions",
            json={**BASE, "messages": MESSAGES, "response_format": fmt, "stream": True},
        )
        assert response.status_code == 200
        events = [e for e in sse_events(response.text) if e != "[DONE]"]
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
        assert streamed == whole["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(streamed), SCHEMA)


async def test_logprobs_with_a_format():
    async with app_client() as (client, _):
        body = await complete(client, guided_choice=["alpha", "beta"], logprobs=2)
        choice = body["choices"][0]
        assert choice["text"] in ("alpha", "beta")
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": json_schema_format({"type": "nope"})}, "response_format"),
        ({"response_format": {"type": "xml"}}, None),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "xml"}}},
            "response_format",
        ),
        ({"structured_outputs": {"structural_tag": "{no"}}, "structured_outputs.structural_tag"),
    ],
)
async def test_bad_formats_get_a_400_naming_the_field(field: dict, param: str | None):
    async with app_client() as (client, engine):
        response = await client.post("/v1/completions", json={**BASE, "prompt": "Hi", **field})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, error
        assert (await client.get("/health")).status_code == 200
        assert blocks_in_use(engine) == 0


async def test_metrics_count_formats_and_compile_times():
    async with app_client() as (client, engine):
        fmt = json_schema_format(SCHEMA)
        await chat(client, response_format=fmt)
        await chat(client, response_format=fmt)  # compiled once, counted twice
        await complete(client, guided_choice=["a", "b"])
        await wait_until_idle(engine)
        text = (await client.get("/metrics")).text
        counted = dict(
            re.findall(
                r'conveyor:structured_output_requests_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)', text
            )
        )
        assert counted["json"] == "2.0" and counted["choice"] == "1.0" and counted["regex"] == "0.0"
        count = re.search(r"conveyor:structured_output_compile_seconds_count\{[^}]*\} (\S+)", text)
        assert count is not None and float(count.group(1)) == 2.0


async def test_a_slow_compile_stalls_no_other_request(monkeypatch):
    """Compiling runs on a thread of its own: a free request is served while a compile waits
    for it to finish (a compile on the event loop would hold the free request back until its
    wait gave up)."""
    compile_ = GrammarCompiler._compile
    started, released = threading.Event(), threading.Event()
    waits: list[bool] = []

    def slow(self, spec):
        started.set()
        waits.append(released.wait(timeout=60))
        return compile_(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    async with app_client() as (client, _):
        constrained = asyncio.create_task(complete(client, guided_regex="[a-z]{3}"))
        assert await asyncio.to_thread(started.wait, 60)
        free = await complete(client, max_tokens=4, ignore_eos=True)
        assert free["choices"][0]["finish_reason"] == "length"
        assert not constrained.done()
        released.set()
        body = await constrained
        assert waits == [True]  # released by the free request's end, not by the wait giving up
        assert re.fullmatch("[a-z]{3}", body["choices"][0]["text"])
