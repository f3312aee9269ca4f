"""OpenAI's Responses API (`/v1/responses`) on a random-weight model: the reply is the one chat
gives for the same conversation, streamed as typed events that build the same output items,
function calls as items and back as input, stored responses continued by id, and what the
server cannot run refused by name."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI

from server.response_items import OutputItems
from server.response_store import ResponseStore
from server.responses_protocol import ResponsesRequest, as_chat, input_messages
from server.settings import ServerSettings
from server.strict_tools import strict_calls_format
from server.tracing import Tracing
from server.truncation import drop_oldest, fits
from tests.server.test_reasoning import thinking_tokenizer
from tests.server.test_tool_calls import SCHEMAS, TIME, WEATHER, tool_tokenizer
from tests.server_utils import app_client, blocks_in_use, named_events, until, wait_until_idle

BASE = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}
TOOLS = [
    {"type": "function", "name": "weather", "parameters": WEATHER},
    {"type": "function", "name": "time", "description": "Now.", "parameters": TIME},
]


def stream_events(body: str) -> list[dict]:
    """Parse a Responses stream strictly (`named_events`), its events numbered from 0."""
    events = named_events(body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def output_text(response: dict) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


async def chat_reply(client: httpx.AsyncClient, messages: list[dict], **body) -> dict:
    """Chat's whole answer for `messages`, with BASE's settings (12 greedy tokens)."""
    payload = {"model": "tiny", "temperature": 0, "max_tokens": 12, "messages": messages}
    response = await client.post("/v1/chat/completions", json={**payload, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def create(client: httpx.AsyncClient, **body) -> dict:
    response = await client.post("/v1/responses", json={**BASE, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_the_reply_is_chats_for_the_same_conversation():
    async with app_client() as (client, engine):
        result = await create(client, instructions="Be brief.", input="Hello there")
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ]
        expected = await chat_reply(client, messages)
        assert result["object"] == "response" and result["id"].startswith("resp_")
        assert output_text(result) == expected["choices"][0]["message"]["content"]
        usage, ours = expected["usage"], result["usage"]
        assert (ours["input_tokens"], ours["output_tokens"], ours["total_tokens"]) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
            usage["total_tokens"],
        )
        assert ours["output_tokens_details"] == {"reasoning_tokens": 0}
        # The chat request ran second, over the prefix this one left in the cache.
        assert ours["input_tokens_details"] == {"cached_tokens": 0}
        # 12 tokens of a random model: cut short by max_output_tokens.
        assert result["status"] == "incomplete"
        assert result["incomplete_details"] == {"reason": "max_output_tokens"}
        [message] = result["output"]
        assert message["type"] == "message" and message["role"] == "assistant"
        # The item the budget cut is incomplete too, as OpenAI marks it.
        assert message["status"] == "incomplete" and message["id"].startswith("msg_")
        assert result["instructions"] == "Be brief." and result["max_output_tokens"] == 12
        assert blocks_in_use(engine) == 0


async def test_a_stream_builds_the_same_items_event_by_event():
    async with app_client() as (client, _):
        whole = await create(client, input="Tell me a story", max_output_tokens=16)
        response = await client.post(
            "/v1/responses",
            json={**BASE, "input": "Tell me a story", "max_output_tokens": 16, "stream": True},
        )
        assert response.headers["content-type"].startswith("text/event-stream")
        events = stream_events(response.text)
        kinds = [e["type"] for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        assert events[0]["response"]["status"] == "in_progress"
        assert events[0]["response"]["output"] == []
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        final = events[-1]["response"]
        assert "".join(deltas) == output_text(final) == output_text(whole)
        assert final["output"][0]["id"] == events[2]["item"]["id"]
        assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 16
        assert final["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


async def test_the_openai_sdk_reads_responses_and_their_streams():
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        api = AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=client)
        result = await api.responses.create(
            model="tiny", input="Hello", max_output_tokens=8, temperature=0
        )
        assert result.status == "incomplete" and result.output_text
        assert result.usage is not None and result.usage.output_tokens == 8
        texts, last = [], None
        async with api.responses.stream(
            model="tiny", input="Hello", max_output_tokens=8, temperature=0
        ) as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    texts.append(event.delta)
                last = event
        # Cut short, as OpenAI's: the stream ends with `response.incomplete`.
        assert last is not None and last.type == "response.incomplete"
        assert "".join(texts) == last.response.output_text == result.output_text
        async with api.responses.stream(
            model="tiny",
            input="Weather?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "weather"},
            max_output_tokens=80,
            temperature=0,
        ) as stream:
            final = await stream.get_final_response()
        assert final.status == "completed"
        [call] = final.output
        assert call.type == "function_call" and call.name == "weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)


async def test_a_forced_function_call_is_an_item_whose_arguments_fit_the_schema():
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        for choice in ({"type": "function", "name": "weather"}, "required"):
            result = await create(
                client,
                input="Weather in Oslo?",
                tools=TOOLS,
                tool_choice=choice,
                max_output_tokens=80,
                temperature=1,
                seed=5,
            )
            calls = [item for item in result["output"] if item["type"] == "function_call"]
            assert calls and result["status"] == "completed"
            for call in calls:
                assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
            if isinstance(choice, dict):
                assert [call["name"] for call in calls] == ["weather"]
            assert result["tools"][0]["name"] == "weather"


async def test_allowed_tools_narrow_the_forced_calls():
    """`{"type": "allowed_tools", "mode": "required", "tools": [...]}`: calls only to those."""
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": TOOLS[-1]["name"]}],
    }
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        result = await create(
            client, input="Time?", tools=TOOLS, tool_choice=choice, max_output_tokens=80, seed=5
        )
        calls = [item for item in result["output"] if item["type"] == "function_call"]
        assert calls and {call["name"] for call in calls} == {TOOLS[-1]["name"]}
        assert result["tool_choice"] == choice


async def test_a_streamed_call_grows_its_arguments_and_ends_as_the_whole():
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        body = {
            **BASE,
            "input": "Weather?",
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "weather"},
            "max_output_tokens": 80,
            "stream": True,
        }
        events = stream_events((await client.post("/v1/responses", json=body)).text)
        added = [e for e in events if e["type"] == "response.output_item.added"]
        assert [e["item"]["type"] for e in added] == ["function_call"]
        pieces = [
            e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
        ]
        [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        [call] = events[-1]["response"]["output"]
        assert "".join(pieces) == done["arguments"] == call["arguments"]
        jsonschema.validate(json.loads(call["arguments"]), WEATHER)


async def test_function_call_outputs_go_back_as_tool_messages():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Ask."}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "time", "arguments": '{"zone":1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sunny."}],
        },
    ]
    body = ResponsesRequest.model_validate({"input": items})
    assert input_messages(body.input) == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Ask.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "time", "arguments": '{"zone":1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "weather"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon", "name": "time"},
        {"role": "assistant", "content": "Sunny."},
    ]
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        result = await create(client, input=items, tools=TOOLS)
        assert result["output"][0]["type"] == "message"


async def test_a_stored_response_is_continued_by_its_id():
    async with app_client() as (client, _):
        first = await create(client, input="Hi", instructions="Only now.")
        assert (await client.get(f"/v1/responses/{first['id']}")).json() == first
        second = await create(client, input="And then?", previous_response_id=first["id"])
        assert second["previous_response_id"] == first["id"]
        conversation = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": output_text(first)},
            {"role": "user", "content": "And then?"},
        ]
        chat = await chat_reply(client, conversation)
        # The earlier turn's instructions are not carried over, as in OpenAI's API.
        assert output_text(second) == chat["choices"][0]["message"]["content"]
        deleted = await client.delete(f"/v1/responses/{first['id']}")
        assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
        for response in (
            await client.get(f"/v1/responses/{first['id']}"),
            await client.post(
                "/v1/responses", json={**BASE, "input": "x", "previous_response_id": first["id"]}
            ),
        ):
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "response_not_found"
        unstored = await create(client, input="Hi", store=False)
        assert (await client.get(f"/v1/responses/{unstored['id']}")).status_code == 404


def test_the_store_keeps_the_newest_and_rebuilds_conversations():
    store = ResponseStore(capacity=2)
    store.put({"id": "a"}, [{"role": "user", "content": "1"}], None)
    store.put({"id": "b"}, [{"role": "user", "content": "2"}], "a")
    assert [m["content"] for m in store.history("b")] == ["1", "2"]
    store.put({"id": "c"}, [{"role": "user", "content": "3"}], "b")
    assert len(store) == 2
    with pytest.raises(Exception, match="No response with id 'a'"):
        store.history("c")
    # Past the byte budget the oldest go first, however few.
    small = ResponseStore(capacity=100, max_bytes=300)
    for name in "xyz":
        small.put({"id": name}, [{"role": "user", "content": "w" * 100}], None)
    assert len(small) == 2 and 0 < small.size <= 300
    small.delete("z")
    assert len(small) == 1 and small.size < 150


async def test_a_json_schema_format_holds_for_the_text():
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}}
    async with app_client() as (client, _):
        result = await create(
            client, input="A number", text=text, max_output_tokens=60, seed=3, temperature=1
        )
        jsonschema.validate(json.loads(output_text(result)), schema)
        assert result["text"] == text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
            "input.0.content.0.type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
            "input.0.content.0.image_url",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
            "text.format.schema",
        ),
        ({"input": "x", "top_k": -5}, "top_k"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        # Checked as chat checks them, named as the client sent them.
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "no"}}}},
            "text.format",
        ),
        (
            {"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "no"}},
            "tool_choice",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]},
            "tools[0].parameters",
        ),
        ({"input": "x" * 5000}, "input"),
    ],
)
async def test_what_cannot_run_is_refused_by_name(body, param):
    async with app_client(tokenizer=tool_tokenizer()) as (client, engine):
        response = await client.post("/v1/responses", json={"model": "tiny", **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert blocks_in_use(engine) == 0


async def test_a_client_gone_mid_stream_frees_its_blocks():
    async with app_client() as (client, engine):
        body = {**BASE, "input": "Long", "max_output_tokens": 200, "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as response:
            async for line in response.aiter_lines():
                if "output_text.delta" in line:
                    break
        await until(lambda: blocks_in_use(engine) == 0, what="blocks freed")


async def test_a_thinking_models_reasoning_is_an_item_of_its_own():
    """The random model never closes the thought its template opens: the whole reply is one
    reasoning item, chat's `reasoning`, streamed as reasoning deltas."""
    settings = ServerSettings(served_model_name="tiny", reasoning_parser="deepseek_r1")
    async with app_client(settings, tokenizer=thinking_tokenizer()) as (client, engine):
        chat = await chat_reply(client, [{"role": "user", "content": "Why?"}])
        reasoning = chat["choices"][0]["message"]["reasoning"]
        result = await create(client, input="Why?")
        [item] = result["output"]
        assert item["type"] == "reasoning" and item["id"].startswith("rs_")
        assert item["content"] == [{"type": "reasoning_text", "text": reasoning}] and reasoning
        assert 0 < result["usage"]["output_tokens_details"]["reasoning_tokens"] <= 12
        response = await client.post(
            "/v1/responses", json={**BASE, "input": "Why?", "stream": True}
        )
        events = stream_events(response.text)
        deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
        assert "".join(deltas) == reasoning
        assert not [e for e in events if e["type"] == "response.output_text.delta"]
        assert blocks_in_use(engine) == 0


def test_items_open_and_close_in_reply_order():
    """Reasoning, then text, then two calls (the second's arguments in two pieces): each item
    opens when its kind changes and closes before the next opens."""
    items = OutputItems()
    events = []
    for delta in (
        {"reasoning": "Think"},
        {"reasoning": " more"},
        {"content": "Calling."},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "f", "arguments": "{}"},
                }
            ]
        },
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "g", "arguments": '{"x"'},
                }
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": ":1}"}}]},
    ):
        events += items.delta(delta)
    events += items.finish()
    assert [item["type"] for item in items.items] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert items.reasoning == "Think more" and items.text == "Calling."
    assert items.items[3]["arguments"] == '{"x":1}' and items.items[3]["call_id"] == "call_b"
    opened = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert opened == closed == [0, 1, 2, 3]
    added_at = {
        e["output_index"]: i
        for i, e in enumerate(events)
        if e["type"] == "response.output_item.added"
    }
    done_at = {
        e["output_index"]: i
        for i, e in enumerate(events)
        if e["type"] == "response.output_item.done"
    }
    assert all(done_at[i] < added_at[i + 1] for i in range(3))
    assert all(item.get("status", "completed") == "completed" for item in items.items)


async def test_each_response_gets_its_request_log_line(caplog):
    """Streamed or not, a response is logged as a chat request is: its tokens and how it
    ended (`--log-requests`)."""
    caplog.set_level("INFO", logger="conveyor.requests")
    async with app_client(tracing=Tracing(log_requests=True)) as (client, _):
        for stream in (False, True):
            body = {**BASE, "input": "Hi", "max_output_tokens": 5, "stream": stream}
            assert (await client.post("/v1/responses", json=body)).status_code == 200
        await until(lambda: len(caplog.records) >= 2, what="two request lines")
    lines = [r.fields for r in caplog.records if r.name == "conveyor.requests"]
    assert [line["stream"] for line in lines] == [False, True]
    for line in lines:
        assert line["status"] == 200 and line["finish_reasons"] == ["length"]
        assert line["operation"] == "chat" and line["completion_tokens"] == 5


async def test_logprobs_come_with_the_text_as_chat_gives_them():
    async with app_client() as (client, _):
        body = {"input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
        result = await create(client, **body)
        messages = [{"role": "user", "content": "Hi"}]
        chat = await chat_reply(client, messages, logprobs=True, top_logprobs=2)
        expected = chat["choices"][0]["logprobs"]["content"]
        [part] = result["output"][0]["content"]
        # Every token's entry (those that end no character too), as chat's up to the last bits
        # (the chat request reads the prompt's cached blocks).
        assert len(part["logprobs"]) == len(expected) == 12
        for ours, theirs in zip(part["logprobs"], expected, strict=True):
            assert ours["token"] == theirs["token"] and ours["bytes"] == theirs["bytes"]
            assert ours["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)
            assert [t["token"] for t in ours["top_logprobs"]] == [
                t["token"] for t in theirs["top_logprobs"]
            ]
        assert all(len(entry["top_logprobs"]) == 2 for entry in expected)
        assert result["top_logprobs"] == 2
        streamed = await client.post("/v1/responses", json={**BASE, **body, "stream": True})
        events = stream_events(streamed.text)
        pieces = [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"]
        joined = [entry["token"] for piece in pieces for entry in piece]
        assert joined == [entry["token"] for entry in part["logprobs"]]
        plain = await create(client, input="Hi")
        assert plain["output"][0]["content"][0]["logprobs"] == []


def test_truncation_drops_the_oldest_turn_with_the_results_of_its_calls():
    system = {"role": "system", "content": "rules"}
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}
    result = {"role": "tool", "tool_call_id": "c", "content": "r"}
    last = {"role": "user", "content": "now"}
    assert drop_oldest([system, call, result, result, last]) == [system, last]
    assert drop_oldest([system, {"role": "user", "content": "a"}, last]) == [system, last]
    assert drop_oldest([system, last]) is None and drop_oldest([last]) is None
    assert fits(500, 12, 512) and not fits(501, 12, 512) and fits(511, None, 512)


async def test_auto_truncation_keeps_the_newest_turns_that_fit():
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} " + "sky " * 12}
        for i in range(12)
    ]
    async with app_client() as (client, _):
        refused = await client.post("/v1/responses", json={**BASE, "input": turns})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
        result = await create(client, input=turns, truncation="auto", instructions="Be brief.")
        usage = result["usage"]
        assert usage["input_tokens"] + 12 <= 512 and result["truncation"] == "auto"
        # More than the newest turn alone: only as much went as had to.
        alone = await create(client, input=turns[-1:], instructions="Be brief.")
        assert usage["input_tokens"] > alone["usage"]["input_tokens"] + 100


async def test_a_stored_responses_input_items_are_listed_back():
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        result = await create(client, input=items, tools=TOOLS)
        api = AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=client)
        page = await api.responses.input_items.list(result["id"])
        assert [item.type for item in page.data] == [
            "function_call_output",
            "function_call",
            "message",
        ]
        assert page.data[2].content[0].text == "Weather?" and page.data[1].call_id == "call_1"
        assert len({item.id for item in page.data}) == 3
        url = f"/v1/responses/{result['id']}/input_items"
        first = (await client.get(url, params={"limit": 2, "order": "asc"})).json()
        assert [item["type"] for item in first["data"]] == ["message", "function_call"]
        assert first["has_more"] and first["last_id"] == first["data"][1]["id"]
        rest = (await client.get(url, params={"order": "asc", "after": first["last_id"]})).json()
        assert [item["type"] for item in rest["data"]] == ["function_call_output"]
        assert not rest["has_more"]
        refused = await client.get(url, params={"limit": 0})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "limit"


async def poll(client: httpx.AsyncClient, response_id: str, *done: str) -> dict:
    """GET the response until its status is one of `done`."""
    result: dict = {}

    async def ended() -> bool:
        nonlocal result
        result = (await client.get(f"/v1/responses/{response_id}")).json()
        return result["status"] in done

    for _ in range(1000):
        if await ended():
            return result
        await asyncio.sleep(0.01)
    raise AssertionError(f"{response_id} still {result.get('status')}")


async def test_a_background_response_is_polled_to_its_end():
    """`background: true` answers at once, queued; GET follows it to the same response a
    foreground request gets, and a continuation reads it."""
    async with app_client() as (client, engine):
        foreground = await create(client, input="Hello there")
        started = await create(client, input="Hello there", background=True)
        assert started["status"] in ("queued", "in_progress") and started["background"]
        assert started["output"] == [] and started["usage"] is None
        ended = await poll(client, started["id"], "completed", "incomplete")
        assert ended["status"] == foreground["status"]
        assert ended["output"][0]["content"][0]["text"] == output_text(foreground)
        assert ended["usage"]["output_tokens"] == foreground["usage"]["output_tokens"]
        again = await client.post(f"/v1/responses/{started['id']}/cancel")
        assert again.json()["status"] == ended["status"]  # an ended one stays as it ended
        follow = await create(client, input="And then?", previous_response_id=started["id"])
        assert follow["previous_response_id"] == started["id"]
        assert blocks_in_use(engine) == 0


async def test_cancelling_a_background_response_stops_its_request():
    async with app_client() as (client, engine):
        body = {"input": "Count", "max_output_tokens": 400, "min_tokens": 400}
        started = await create(client, **body, background=True)
        cancelled = await client.post(f"/v1/responses/{started['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert (await client.get(f"/v1/responses/{started['id']}")).json()["status"] == (
            "cancelled"
        )
        await wait_until_idle(engine)
        assert blocks_in_use(engine) == 0
        foreground = await create(client, input="Hi")
        refused = await client.post(f"/v1/responses/{foreground['id']}/cancel")
        assert refused.status_code == 400  # only background responses are cancelled
        started = await create(client, **body, background=True)
        assert (await client.delete(f"/v1/responses/{started['id']}")).status_code == 200
        assert (await client.get(f"/v1/responses/{started['id']}")).status_code == 404
        await wait_until_idle(engine)
        assert blocks_in_use(engine) == 0


async def test_a_background_stream_is_read_again_from_any_event():
    """`background` with `stream`: the events stream as a foreground stream's do, and GET
    with `stream=true` reads them again, whole or after `starting_after`, while the response
    runs or once it has ended; a foreground response cannot be streamed again."""
    async with app_client() as (client, engine):
        body = {**BASE, "input": "Hello there", "background": True, "stream": True}
        response = await client.post("/v1/responses", json=body)
        assert response.status_code == 200
        events = stream_events(response.text)
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        response_id = events[0]["response"]["id"]
        again = await client.get(f"/v1/responses/{response_id}", params={"stream": "true"})
        assert stream_events(again.text) == events
        later = await client.get(
            f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": 3}
        )
        assert named_events(later.text) == events[4:]
        stored = (await client.get(f"/v1/responses/{response_id}")).json()
        assert stored == events[-1]["response"]
        foreground = await create(client, input="Hi")
        refused = await client.get(f"/v1/responses/{foreground['id']}?stream=true")
        assert refused.status_code == 400
        assert blocks_in_use(engine) == 0


async def test_the_openai_sdk_runs_background_responses():
    """The SDK's `background=True`, `retrieve` (also as a stream from an event on) and
    `cancel` against the server."""
    async with app_client() as (client, engine):
        api = AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=client)
        started = await api.responses.create(
            model="tiny", input="Hello", max_output_tokens=8, temperature=0, background=True
        )
        assert started.status in ("queued", "in_progress") and started.background
        ended = started
        while ended.status in ("queued", "in_progress"):
            await asyncio.sleep(0.01)
            ended = await api.responses.retrieve(started.id)
        assert ended.status == "incomplete" and ended.output_text
        replay = await api.responses.retrieve(started.id, stream=True, starting_after=1)
        kinds = [event.type async for event in replay]
        assert kinds[0] != "response.created" and kinds[-1] == "response.incomplete"
        running = await api.responses.create(
            model="tiny",
            input="Count",
            max_output_tokens=400,
            background=True,
            extra_body={"min_tokens": 400},
        )
        cancelled = await api.responses.cancel(running.id)
        assert cancelled.status == "cancelled"
        await wait_until_idle(engine)
        assert blocks_in_use(engine) == 0


async def test_input_tokens_counts_what_the_response_takes():
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        api = AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=client)
        body = {"input": "Weather in Oslo?", "instructions": "Be brief.", "tools": TOOLS}
        result = await create(client, **body)
        counted = await api.responses.input_tokens.count(model="tiny", **body)
        assert counted.object == "response.input_tokens"
        assert counted.input_tokens == result["usage"]["input_tokens"]
        # The tools and instructions are counted as the template renders them.
        bare = await api.responses.input_tokens.count(model="tiny", input=body["input"])
        assert bare.input_tokens < counted.input_tokens
        # Earlier turns by id come first, as in the response that continues them.
        second = await create(client, input="And then?", previous_response_id=result["id"])
        following = await client.post(
            "/v1/responses/input_tokens",
            json={"input": "And then?", "previous_response_id": result["id"]},
        )
        assert following.json()["input_tokens"] == second["usage"]["input_tokens"]
        # The instructions alone are a conversation to count.
        alone = await client.post("/v1/responses/input_tokens", json={"instructions": "Hi"})
        assert alone.status_code == 200 and alone.json()["input_tokens"] > 0


async def test_input_tokens_counts_past_the_context_unless_truncated():
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"{i} " + "sky " * 12}
        for i in range(12)
    ]
    async with app_client() as (client, _):
        whole = await client.post("/v1/responses/input_tokens", json={"input": turns})
        assert whole.status_code == 200 and whole.json()["input_tokens"] > 512
        body = {"input": turns, "truncation": "auto", "instructions": "Be brief."}
        counted = await client.post("/v1/responses/input_tokens", json={**body, **BASE})
        result = await create(client, **body)
        assert counted.json()["input_tokens"] == result["usage"]["input_tokens"]
        assert counted.json()["input_tokens"] < whole.json()["input_tokens"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({}, 400, "input"),
        ({"input": "Hi", "previous_response_id": "resp_gone"}, 404, "previous_response_id"),
        ({"input": "Hi", "model": "other"}, 404, "model"),
        ({"input": "Hi", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": [{"type": "web_search_call"}]}, 400, "input.0.type"),
    ],
)
async def test_input_tokens_refuses_what_it_cannot_count(body, status, param):
    async with app_client() as (client, _):
        response = await client.post("/v1/responses/input_tokens", json=body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param


def test_functions_are_strict_unless_they_say_otherwise_as_the_responses_api_has_them():
    tools = [
        {"type": "function", "name": "weather", "parameters": WEATHER},
        {"type": "function", "name": "time", "parameters": TIME, "strict": False},
    ]
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi", "tools": tools})
    chat = as_chat(body, input_messages("hi"))
    assert [tool.function.strict for tool in chat.tools or []] == [True, False]
    assert strict_calls_format(chat, "hermes") is not None  # their calls are enforced
    loose = [{**tools[0], "strict": False}, tools[1]]
    body = ResponsesRequest.model_validate({"model": "tiny", "input": "hi", "tools": loose})
    assert strict_calls_format(as_chat(body, input_messages("hi")), "hermes") is None
