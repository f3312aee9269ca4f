"""gpt-oss's Harmony replies: the analysis channel is the reasoning, the final channel the
content, messages to functions the tool calls, whether whole or streamed in pieces cut
anywhere; a Harmony chat template turns this on by itself and keeps special tokens."""

from __future__ import annotations

import copy
import json
import random

import pytest

from engine.core.outputs import RequestOutput
from server.call_array import assemble
from server.harmony import HarmonyReader, is_harmony, split_harmony
from server.protocol import ChatCompletionRequest
from server.serving_chat import ChatRenderer
from tests.helpers import tiny_llama, tiny_tokenizer
from tests.server_utils import app_client

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather; 3 < 4.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
SPLITS = [
    # reply -> (reasoning, content, [(name, arguments)])
    (
        ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
        ("The user wants the weather; 3 < 4.", "It is sunny.", []),
    ),
    (
        ANALYSIS + CALL,
        ("The user wants the weather; 3 < 4.", "", [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        # A preamble to no one is content; the recipient may stand before the channel.
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f"
        '<|channel|>commentary json<|message|>{"a": 1}<|call|>',
        ("", "Checking.", [("f", '{"a": 1}')]),
    ),
    # Cut short (the final marker is an end token the text leaves out) and no header at all.
    ("<|channel|>analysis<|message|>Still thinking", ("Still thinking", "", [])),
    ("<|channel|>final<|message|>Paris", ("", "Paris", [])),
    ("Plain text.", ("", "Plain text.", [])),
]


def calls_of(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize(("reply", "expected"), SPLITS)
def test_a_whole_reply_splits_into_reasoning_content_and_calls(reply, expected):
    reasoning, content, calls = split_harmony(reply)
    assert (reasoning, content, calls_of(calls)) == expected


@pytest.mark.parametrize(("reply", "expected"), SPLITS)
def test_a_reply_cut_anywhere_splits_as_the_whole(reply, expected):
    for seed in range(40):
        rng = random.Random(seed)
        reader, at = HarmonyReader(), 0
        reasoning, content, calls = "", "", []
        while at < len(reply):
            step = rng.randint(1, 6)
            more, text, found = reader.feed(reply[at : at + step])
            reasoning, content, calls, at = (
                reasoning + more,
                content + text,
                calls + found,
                at + step,
            )
        more, text, found = reader.finish()
        whole = assemble(calls + found)
        assert (reasoning + more, content + text, calls_of(whole)) == expected


def renderer(**body) -> ChatRenderer:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], **body}
    )
    return ChatRenderer("chatcmpl-1", "tiny", request, [1] * 5, tiny_tokenizer(), None, "openai")


def pieces(text: str, size: int = 4) -> list[RequestOutput]:
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        RequestOutput(
            "r", 0, [1], chunk, finished=k == len(chunks) - 1, finish_reason="stop",
            num_output_tokens=k + 1,
        )
        for k, chunk in enumerate(chunks)
    ]  # fmt: skip


def test_streamed_and_whole_messages_carry_reasoning_content_and_calls():
    reply = ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>One moment.<|end|>" + CALL
    stream = renderer()
    fragments = [f for out in pieces(reply) for f in stream.update(0, out)]
    deltas = [f["delta"] for f in fragments]
    assert "".join(d.get("reasoning", "") for d in deltas) == "The user wants the weather; 3 < 4."
    assert "".join(d.get("content") or "" for d in deltas) == "One moment."
    entries = [c for d in deltas for c in d.get("tool_calls", [])]
    # The name once the message's header is read, then the arguments as they arrive.
    assert len(entries) > 1 and entries[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert {entry["index"] for entry in entries} == {0}
    [call] = assemble(entries)
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert fragments[-1]["finish_reason"] == "tool_calls"
    # No piece of a marker reaches the client.
    assert not any("<|" in d.get("reasoning", "") + (d.get("content") or "") for d in deltas)

    whole = renderer(include_reasoning=False)
    for out in pieces(reply):
        whole.update(0, out)
    [choice] = whole.response()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "One moment." and "reasoning" not in message
    assert calls_of(message["tool_calls"]) == [("get_weather", '{"city": "Paris"}')]


# The shape of gpt-oss's template: each message between `<|start|>` and `<|end|>`, the reply
# opened at `<|start|>assistant` (the analysis and final channels are the model's to write).
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
    "{# <|channel|>final #}"
)
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]


def harmony_tokenizer():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


async def test_a_harmony_template_keeps_special_tokens_and_reads_its_replies():
    """Without any parser flag: the request runs with special tokens in its text, and the
    reply reaches the client with no marker in its content."""
    assert is_harmony(HARMONY_TEMPLATE) and not is_harmony("{{ messages }}")
    tokenizer = harmony_tokenizer()
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    model = tiny_llama(vocab_size=len(tokenizer))
    async with app_client(model=model, tokenizer=tokenizer) as (client, _):
        rendered = await client.post("/v1/chat/completions/render", json=body)
        reply = await client.post("/v1/chat/completions", json=body)
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["sampling_params"]["skip_special_tokens"] is False
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert "<|" not in (message["content"] or "") + message.get("reasoning", "")


async def test_a_harmony_reply_under_tool_choice_none_is_offered_no_tools():
    """gpt-oss's replies are read as messages, calls included, whatever the choice: under
    tool_choice "none" its template is given no tools to call."""
    tokenizer = harmony_tokenizer()
    tokenizer.chat_template = HARMONY_TEMPLATE.replace(
        "{% for m in messages %}",
        "{% if tools %}<|start|>developer<|message|>{{ tools | tojson }}<|end|>{% endif %}"
        "{% for m in messages %}",
    )
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [tool]}
    model = tiny_llama(vocab_size=len(tokenizer))
    async with app_client(model=model, tokenizer=tokenizer) as (client, _):
        offered = await client.post("/v1/chat/completions/render", json=body)
        none = await client.post(
            "/v1/chat/completions/render", json={**body, "tool_choice": "none"}
        )
        plain = await client.post("/v1/chat/completions/render", json={**body, "tools": None})
    assert len(offered.json()["token_ids"]) > len(plain.json()["token_ids"])
    assert none.json()["token_ids"] == plain.json()["token_ids"]
