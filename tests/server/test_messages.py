"""Anthropic's Messages API (`/v1/messages`) on a random-weight model: the reply is the one chat
gives for the same conversation, streamed as Anthropic's typed events that build the same
content blocks, tool calls as `tool_use` blocks and back as `tool_result`s, thinking as its own
blocks, token counts, errors in Anthropic's shape, and the Anthropic SDK reading all of it."""

from __future__ import annotations

import copy
import json

import anthropic
import httpx
import jsonschema
import pytest
from anthropic import AsyncAnthropic

from server.messages_protocol import MessagesRequest, chat_messages
from server.serving_messages import ContentBlocks
from server.settings import ServerSettings
from tests.helpers import tiny_tokenizer
from tests.server.test_reasoning import thinking_tokenizer
from tests.server.test_tool_calls import SCHEMAS, TIME, WEATHER, tool_tokenizer
from tests.server_utils import app_client, blocks_in_use, live_server, named_events

BASE = {"model": "tiny", "temperature": 0, "max_tokens": 12}
TOOLS = [
    {"name": "weather", "input_schema": WEATHER},
    {"name": "time", "description": "Now.", "input_schema": TIME},
]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "description": "Now.", "parameters": TIME}},
]


async def create(client: httpx.AsyncClient, **body) -> dict:
    response = await client.post("/v1/messages", json={**BASE, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def chat_reply(client: httpx.AsyncClient, messages: list[dict], **body) -> dict:
    payload = {"model": "tiny", "temperature": 0, "max_tokens": 12, "messages": messages}
    response = await client.post("/v1/chat/completions", json={**payload, **body})
    assert response.status_code == 200, response.text
    return response.json()


def text_of(message: dict) -> str:
    return "".join(block["text"] for block in message["content"] if block["type"] == "text")


async def test_the_reply_is_chats_for_the_same_conversation():
    async with app_client() as (client, engine):
        messages = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
        result = await create(client, system="Be brief.", messages=messages)
        expected = await chat_reply(
            client,
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"},
            ],
        )
        assert result["type"] == "message" and result["id"].startswith("msg_")
        assert result["role"] == "assistant" and result["model"] == "tiny"
        assert text_of(result) == expected["choices"][0]["message"]["content"]
        assert result["stop_reason"] == "max_tokens" and result["stop_sequence"] is None
        usage, chat = result["usage"], expected["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == chat["prompt_tokens"]
        assert usage["output_tokens"] == chat["completion_tokens"] == 12
        # The second run of the same prompt read its cached blocks.
        again = await create(client, system="Be brief.", messages=messages)
        assert again["usage"]["cache_read_input_tokens"] > 0
        assert blocks_in_use(engine) == 0


async def test_a_stream_builds_the_same_message():
    messages = [{"role": "user", "content": "Tell me a story"}]
    async with app_client() as (client, engine):
        whole = await create(client, messages=messages)
        response = await client.post(
            "/v1/messages", json={**BASE, "messages": messages, "stream": True}
        )
        assert response.headers["content-type"].startswith("text/event-stream")
        events = named_events(response.text)
        kinds = [e["type"] for e in events]
        assert kinds[:3] == ["message_start", "ping", "content_block_start"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(kinds[3:-3]) == {"content_block_delta"}
        start = events[0]["message"]
        assert start["content"] == [] and start["stop_reason"] is None
        assert start["usage"]["output_tokens"] == 0
        assert events[2]["content_block"] == {"type": "text", "text": ""}
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert {d["type"] for d in deltas} == {"text_delta"}
        assert "".join(d["text"] for d in deltas) == text_of(whole)
        final = events[-2]
        assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert final["usage"]["output_tokens"] == 12
        assert blocks_in_use(engine) == 0


def sdk(url: str, api_key: str = "unused") -> AsyncAnthropic:
    """The Anthropic SDK on a live server (it brings its own HTTP client)."""
    return AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0)


async def test_the_anthropic_sdk_reads_messages_and_their_streams():
    async with live_server() as server:
        api = sdk(server.url)
        messages: list = [{"role": "user", "content": "Hello"}]
        greedy = {"temperature": 0}  # the SDK leaves sampling fields to extra_body
        result = await api.messages.create(
            model="tiny", max_tokens=8, messages=messages, extra_body=greedy
        )
        assert result.stop_reason == "max_tokens" and result.usage.output_tokens == 8
        [block] = result.content
        assert block.type == "text" and block.text
        texts = []
        async with api.messages.stream(
            model="tiny", max_tokens=8, messages=messages, extra_body=greedy
        ) as stream:
            async for text in stream.text_stream:
                texts.append(text)
            final = await stream.get_final_message()
        assert "".join(texts) == block.text == final.content[0].text
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
        counted = await api.messages.count_tokens(model="tiny", messages=messages)
        assert counted.input_tokens == result.usage.input_tokens + (
            result.usage.cache_read_input_tokens or 0
        )


async def test_a_last_assistant_turn_is_a_prefill_the_reply_continues():
    conversation = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "My favourite is"},
    ]
    async with app_client() as (client, _):
        result = await create(client, messages=conversation)
        expected = await chat_reply(
            client, conversation, add_generation_prompt=False, continue_final_message=True
        )
        assert text_of(result) == expected["choices"][0]["message"]["content"]
        fresh = await create(client, messages=conversation[:1])
        assert text_of(fresh) != text_of(result)
        # Counted as it runs: the prefill continues, no new assistant turn opens.
        counted = await client.post("/v1/messages/count_tokens", json={"messages": conversation})
        usage = result["usage"]
        seen = usage["input_tokens"] + usage["cache_read_input_tokens"]
        assert counted.json()["input_tokens"] == seen


async def test_a_stop_sequence_ends_the_message_and_is_named():
    messages = [{"role": "user", "content": "Count with me"}]
    async with app_client() as (client, _):
        text = text_of(await create(client, messages=messages))
        stop = text[3:6]
        assert stop.strip(), "the reply has a stop string to find"
        result = await create(client, messages=messages, stop_sequences=[stop])
        assert result["stop_reason"] == "stop_sequence" and result["stop_sequence"] == stop
        assert text_of(result) == text[: text.index(stop)]


async def test_a_named_tool_is_called_with_input_that_fits_its_schema():
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    choice = {"type": "tool", "name": "weather"}
    async with app_client(tokenizer=tool_tokenizer()) as (client, engine):
        body = {"messages": messages, "tools": TOOLS, "tool_choice": choice, "max_tokens": 80}
        result = await create(client, **body, seed=5, temperature=0.8)
        assert result["stop_reason"] == "tool_use"
        [call] = result["content"]
        assert call["type"] == "tool_use" and call["name"] == "weather" and call["id"]
        jsonschema.validate(call["input"], WEATHER)
        response = await client.post(
            "/v1/messages", json={**BASE, **body, "seed": 5, "temperature": 0.8, "stream": True}
        )
        events = named_events(response.text)
        [start] = [e for e in events if e["type"] == "content_block_start"]
        assert start["content_block"]["type"] == "tool_use"
        assert start["content_block"]["input"] == {}
        partial = "".join(
            e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
        )
        assert json.loads(partial) == call["input"]
        assert events[-2]["delta"]["stop_reason"] == "tool_use"
        assert blocks_in_use(engine) == 0
    async with live_server(tokenizer=tool_tokenizer()) as server:
        # "any" must call some tool (one, here); the SDK reads the call's input as an object.
        any_call = await sdk(server.url).messages.create(
            model="tiny",
            max_tokens=80,
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )
        [block] = any_call.content
        assert block.type == "tool_use" and any_call.stop_reason == "tool_use"
        jsonschema.validate(block.input, SCHEMAS[block.name])


async def test_tool_use_and_tool_result_turns_render_as_chat_renders_calls_and_results():
    conversation = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "weather",
                    "input": {"city": "Oslo", "unit": "c"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 degrees"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    request = MessagesRequest.model_validate({**BASE, "messages": conversation})
    chat = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "arguments": json.dumps({"city": "Oslo", "unit": "c"}),
                    },
                }
            ],
            "reasoning_content": "Look it up.",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "4 degrees", "name": "weather"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat_messages(request) == chat
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        result = await create(client, messages=conversation, tools=TOOLS)
        expected = await chat_reply(client, chat, tools=CHAT_TOOLS)
        assert text_of(result) == expected["choices"][0]["message"]["content"]
        counted = await client.post(
            "/v1/messages/count_tokens", json={"model": "tiny", "messages": conversation}
        )
        with_tools = await client.post(
            "/v1/messages/count_tokens",
            json={"model": "tiny", "messages": conversation, "tools": TOOLS},
        )
        assert with_tools.json()["input_tokens"] == expected["usage"]["prompt_tokens"]
        assert counted.json()["input_tokens"] < with_tools.json()["input_tokens"]


async def test_thinking_comes_back_as_thinking_blocks():
    settings = ServerSettings(served_model_name="tiny", reasoning_parser="deepseek_r1")
    body = {"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 12}
    async with app_client(settings, tokenizer=thinking_tokenizer()) as (client, _):
        result = await create(client, **body)
        # The random model never closes its thought: all of the reply is thinking.
        [block] = result["content"]
        assert block["type"] == "thinking" and block["thinking"] and block["signature"] == ""
        response = await client.post("/v1/messages", json={**BASE, **body, "stream": True})
        events = named_events(response.text)
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert {d["type"] for d in deltas} == {"thinking_delta"}
        assert "".join(d["thinking"] for d in deltas) == block["thinking"]


async def test_an_output_format_holds_the_reply_to_its_schema():
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    async with live_server() as server:
        result = await sdk(server.url).messages.create(
            model="tiny",
            max_tokens=60,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )
    assert result.stop_reason == "end_turn"
    [block] = result.content
    assert block.type == "text"
    jsonschema.validate(json.loads(block.text), schema)


def test_content_blocks_close_one_before_the_next_opens():
    blocks = ContentBlocks()
    events = blocks.delta({"reasoning": "hm"}) + blocks.delta({"content": "Hi"})
    events += blocks.delta(
        {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]}
    )
    events += blocks.delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    events += blocks.finish()
    kinds = [(e["type"], e["index"]) for e in events]
    assert kinds == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
    ]
    assert blocks.content() == [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
    ]


@pytest.mark.parametrize(
    ("body", "status", "kind", "words"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            400,
            "invalid_request_error",
            "'document' are not supported",
        ),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
            "client tools",
        ),
        ({"tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "tool's name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
            400,
            "invalid_request_error",
            "nope",
        ),
        ({"model": "other"}, 404, "not_found_error", "other"),
    ],
)
async def test_bad_requests_get_anthropics_error_shape(body, status, kind, words):
    payload = {**BASE, "messages": [{"role": "user", "content": "Hi"}], **body}
    payload = {key: value for key, value in payload.items() if value is not None}
    async with app_client(tokenizer=tool_tokenizer()) as (client, engine):
        response = await client.post("/v1/messages", json=payload)
        assert response.status_code == status, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == kind
        assert words in error["error"]["message"]
        # Other routes keep OpenAI's shape.
        openai = await client.post("/v1/chat/completions", json={"model": "other"})
        assert "type" in openai.json()["error"]
        assert blocks_in_use(engine) == 0


async def test_the_sdk_raises_its_own_errors_and_the_api_key_may_come_as_x_api_key():
    settings = ServerSettings(served_model_name="tiny", api_key="sesame")
    async with live_server(settings) as server:
        messages: list = [{"role": "user", "content": "Hi"}]
        good = sdk(server.url, "sesame")
        result = await good.messages.create(
            model="tiny", max_tokens=4, messages=messages, extra_body={"ignore_eos": True}
        )
        assert result.usage.output_tokens == 4
        bad = sdk(server.url, "wrong")
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.create(model="tiny", max_tokens=4, messages=messages)
        async with httpx.AsyncClient(base_url=server.url) as client:
            body = {"model": "tiny", "max_tokens": 4, "messages": messages}
            refused = await client.post("/v1/messages", json=body, headers={"x-api-key": "no"})
            assert refused.status_code == 401
            assert refused.json()["error"]["type"] == "authentication_error"
            # The same key as a bearer token, as OpenAI's clients send it.
            bearer = {"authorization": "Bearer sesame"}
            assert (await client.post("/v1/messages", json=body, headers=bearer)).is_success
        with pytest.raises(anthropic.BadRequestError, match="temperature"):
            await good.messages.create(
                model="tiny", max_tokens=4, messages=messages, extra_body={"temperature": 5}
            )


async def test_thinking_reaches_the_template_as_thinking_models_read_it():
    """`thinking` sets Qwen3's `enable_thinking` and Granite's `thinking`; `adaptive` (and no
    `thinking`) leave the template's default; chat_template_kwargs win."""
    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined %}[think={{ enable_thinking }}]{% endif %}"
        "{% if thinking is defined %}[granite={{ thinking }}]{% endif %}"
    )
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = template
    messages = [{"role": "user", "content": "Hello world"}]
    cases = {
        "enabled": (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            "[think=True][granite=True]",
        ),
        "disabled": ({"thinking": {"type": "disabled"}}, "[think=False][granite=False]"),
        "adaptive": ({"thinking": {"type": "adaptive"}}, ""),
        "absent": ({}, ""),
        "overridden": (
            {"thinking": {"type": "disabled"}, "chat_template_kwargs": {"enable_thinking": True}},
            "[think=True][granite=False]",
        ),
    }
    async with app_client(tokenizer=tokenizer) as (client, _):
        for name, (fields, suffix) in cases.items():
            expected = len(tokenizer("Hello world" + suffix, add_special_tokens=False)["input_ids"])
            reply = await client.post(
                "/v1/messages", json={**BASE, "messages": messages, "max_tokens": 1, **fields}
            )
            usage = reply.json()["usage"]
            assert usage["input_tokens"] + usage["cache_read_input_tokens"] == expected, name
            if name != "overridden":  # count_tokens takes no chat_template_kwargs
                count = await client.post(
                    "/v1/messages/count_tokens", json={"messages": messages, **fields}
                )
                assert count.json() == {"input_tokens": expected}, name
