"""Event encoding and the per-request delta collector, the two pieces every streamed token
passes through."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.core.async_engine import RequestCollector
from engine.core.outputs import RequestOutput
from server.rendering import ChunkRenderer
from server.streaming import FAIR_SHARE, compact_json, merge, sse
from tests.server_utils import app_client, sse_events

PAYLOADS: list[Any] = [
    {"id": "cmpl-1", "choices": [{"index": 0, "text": " the", "logprobs": None}]},
    {"text": "日本語 é \u2028 \U0001f600", "escapes": 'quote " backslash \\ tab \t nl \n \x00'},
    {"floats": [0.1, -2.5e-07, 1e300, 3.0], "ints": [0, -1, 2**70], "flags": [True, False, None]},
    {"nested": {"a": [{"b": []}, {}], "c": {"d": {"e": "f"}}}, "empty": ""},
    [1, "two", [3.5, {"four": None}]],
    "a bare string",
    42,
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_compact_json_is_json_dumps_compact_with_unicode_kept(payload):
    assert compact_json(payload) == json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def test_compact_json_refuses_what_json_refuses():
    with pytest.raises(TypeError):
        compact_json({"a": object()})
    # A failure leaves nothing behind: the next event encodes as usual.
    assert compact_json({"a": [1]}) == '{"a":[1]}'


class _Renderer(ChunkRenderer):
    object_name = "text_completion"

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


class _TrailingFieldRenderer(_Renderer):
    """A chunk with a field after `choices`: the cached head cannot be used."""

    def chunk(self, choices: list[dict[str, Any]], with_usage: bool = False) -> dict[str, Any]:
        return {**super().chunk(choices, with_usage), "system_fingerprint": "fp"}


FRAGMENTS = [
    [{"index": 0, "text": " the", "logprobs": None, "finish_reason": None}],
    [
        {
            "index": 3,
            "text": 'é\n"',
            "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5]},
            "finish_reason": "stop",
            "stop_reason": 7,
        }
    ],
    [],
]


@pytest.mark.parametrize("renderer_class", [_Renderer, _TrailingFieldRenderer])
def test_event_is_the_chunk_as_a_server_sent_event(renderer_class):
    renderer = renderer_class("cmpl-xyz", 'model "q" é', include_usage=False)
    for fragments in FRAGMENTS * 2:  # the second pass reuses what the first cached
        event = renderer.event(fragments)
        assert event == sse(renderer.chunk(fragments))
        assert event.startswith("data: ") and event.endswith("\n\n")
        assert json.loads(event[len("data: ") :])["choices"] == fragments


def _output(index: int, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        "req", index, [token], f"<{token}>", finished=finished, num_output_tokens=1
    )


async def test_collector_wakes_a_waiting_consumer():
    collector = RequestCollector(1)
    getter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    assert not getter.done()
    collector.put(_output(0, 5))
    outputs = await asyncio.wait_for(getter, 30)  # a hang guard: the output is already there
    assert [o.new_token_ids for o in outputs] == [[5]]


async def test_collector_merges_what_a_lagging_consumer_has_not_read():
    collector = RequestCollector(2)
    collector.put(_output(0, 1))
    collector.put(_output(1, 2))
    collector.put(_output(0, 3, finished=True))
    collector.put(_output(0, 4))  # after its sequence finished: dropped
    outputs = await asyncio.wait_for(collector.get(), 30)
    assert {o.index: (o.new_token_ids, o.text, o.finished) for o in outputs} == {
        0: ([1, 3], "<1><3>", True),
        1: ([2], "<2>", False),
    }
    assert collector.finished_indices == {0}


async def test_collector_survives_a_cancelled_wait():
    collector = RequestCollector(1)
    getter = asyncio.ensure_future(collector.get())
    await asyncio.sleep(0)
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    collector.put(_output(0, 9))  # nobody waits: kept for the next read
    outputs = await asyncio.wait_for(collector.get(), 30)
    assert [o.new_token_ids for o in outputs] == [[9]]


async def test_an_interval_gathers_tokens_past_the_first_until_it_is_reached():
    collector = RequestCollector(1, interval=3)
    collector.put(_output(0, 1))  # the first token goes at once
    assert [o.new_token_ids for o in await asyncio.wait_for(collector.get(), 30)] == [[1]]
    getter = asyncio.ensure_future(collector.get())
    collector.put(_output(0, 2))
    collector.put(_output(0, 3))
    await asyncio.sleep(0)
    assert not getter.done()  # two of three
    collector.put(_output(0, 4))
    assert [o.new_token_ids for o in await asyncio.wait_for(getter, 30)] == [[2, 3, 4]]
    getter = asyncio.ensure_future(collector.get())
    collector.put(_output(0, 5, finished=True))  # the end goes at once
    assert [o.new_token_ids for o in await asyncio.wait_for(getter, 30)] == [[5]]


async def test_an_interval_lets_each_sequence_start_at_once():
    collector = RequestCollector(2, interval=4)
    collector.put(_output(0, 1))
    assert [o.index for o in await asyncio.wait_for(collector.get(), 30)] == [0]
    getter = asyncio.ensure_future(collector.get())
    collector.put(_output(0, 2))
    await asyncio.sleep(0)
    assert not getter.done()
    collector.put(_output(1, 7))  # the second sequence's first token wakes the consumer
    outputs = await asyncio.wait_for(getter, 30)
    assert {o.index: o.new_token_ids for o in outputs} == {0: [2], 1: [7]}


async def streamed_token_ids(**core_options: Any) -> list[list[int]]:
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 9,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    async with app_client(**core_options) as (client, _):
        reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    chunks = [event["choices"] for event in sse_events(reply.text) if event != "[DONE]"]
    return [choice["token_ids"] for choices in chunks for choice in choices]


async def test_a_server_with_an_interval_streams_the_same_tokens_in_fewer_chunks():
    plain = await streamed_token_ids()
    gathered = await streamed_token_ids(stream_interval=4)
    assert [len(ids) for ids in plain] == [1] * 9
    assert [len(ids) for ids in gathered] == [1, 4, 4]
    assert list(itertools.chain(*gathered)) == list(itertools.chain(*plain))


async def test_streaming_overhead_benchmark_runs_the_real_app():
    """`benchmarks/streaming_overhead.py` streams through the app over its stand-in core."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "streaming_overhead.py"
    spec = importlib.util.spec_from_file_location("streaming_overhead", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    per_token = await module.measure(concurrency=3, tokens=5, rounds=2)
    assert len(per_token) == 2 and all(us > 0 for us in per_token)
    app_bytes = await _one_stream_text(module)
    events = [e for e in app_bytes.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " a" * 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def _one_stream_text(module) -> str:
    async with module.stand_in_app() as app:
        body = json.dumps({"prompt": [5] * 4, "max_tokens": 5, "stream": True}).encode()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            return response.text


async def test_a_merged_stream_of_many_prompts_lets_other_requests_in_between():
    """A thousand ready deltas are not handed on in one go: other tasks (other clients'
    streams) run after every FAIR_SHARE of them (a few dozen at most)."""

    async def ready(count: int) -> AsyncIterator[int]:
        for i in range(count):
            yield i

    handed: list[int] = []
    seen_by_neighbour: list[int] = []

    async def neighbour() -> None:
        while len(handed) < 1000:
            seen_by_neighbour.append(len(handed))
            await asyncio.sleep(0)

    other = asyncio.create_task(neighbour())
    async for _, item in merge([ready(500), ready(500)]):
        handed.append(item)
    await other
    gaps = [b - a for a, b in itertools.pairwise(seen_by_neighbour)]
    assert FAIR_SHARE <= 64
    assert len(seen_by_neighbour) >= 1000 // 64
    assert max(gaps) <= 64
