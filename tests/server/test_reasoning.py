"""A thinking model's reasoning apart from its answer (`--reasoning-parser`)."""

from __future__ import annotations

import copy
import json
import random
import re

import pytest

from engine.core.outputs import RequestOutput
from server.call_array import assemble
from server.cli import build_parser, server_settings
from server.protocol import ChatCompletionRequest
from server.reasoning import (
    THINK,
    ThinkReader,
    ThoughtTags,
    opens_in_reasoning,
    split_reasoning,
    tags_for,
)
from server.serving_chat import ChatRenderer
from server.settings import ServerSettings
from tests.helpers import CHAT_TEMPLATE, chat_tokenizer, tiny_llama, tiny_tokenizer
from tests.server_utils import app_client, blocks_in_use, sse_events

MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]

SPLITS = [
    # (reply, starts in reasoning) -> (reasoning, answer)
    (
        ("<think>Rayleigh.</think>\n\nShort light scatters.", False),
        ("Rayleigh.", "Short light scatters."),
    ),
    (("Rayleigh.</think>Short light.", True), ("Rayleigh.", "Short light.")),
    (("\n<think>\nhm</think>ok", False), ("\nhm", "ok")),
    (("Plain answer.", False), (None, "Plain answer.")),
    (("Cut short while thinking", True), ("Cut short while thinking", "")),
    (("<think>never closed", False), ("never closed", "")),
    (("a < b </thin", True), ("a < b </thin", "")),
    (("<thinking is not the tag", False), (None, "<thinking is not the tag")),
    (("</think>", True), ("", "")),
]


@pytest.mark.parametrize(("reply", "expected"), SPLITS)
def test_a_whole_reply_splits_into_reasoning_and_answer(reply, expected):
    assert split_reasoning(*reply) == expected


def split_in_pieces(
    text: str, open_at_start: bool, seed: int, tags: ThoughtTags = THINK
) -> tuple[str | None, str]:
    """What a reader makes of `text` fed in random pieces of 1 to 5 characters."""
    rng = random.Random(seed)
    reader = ThinkReader(open_at_start, tags)
    reasoning, answer, at = "", "", 0
    while at < len(text):
        step = rng.randint(1, 5)
        more, rest = reader.feed(text[at : at + step])
        reasoning, answer, at = reasoning + more, answer + rest, at + step
    more, rest = reader.finish()
    return (reasoning + more if reader.reasoned else None, answer + rest)


@pytest.mark.parametrize(("reply", "expected"), SPLITS)
def test_a_reply_cut_anywhere_splits_as_the_whole(reply, expected):
    assert all(split_in_pieces(*reply, seed) == expected for seed in range(40))


def test_a_prompt_opens_the_reasoning_where_its_generation_part_ends_with_the_tag():
    assert opens_in_reasoning("<|assistant|><think>\n")
    assert not opens_in_reasoning("<|assistant|><think>\n\n</think>\n\n")
    assert not opens_in_reasoning("<|assistant|>")


def renderer(thinking: bool, parser: str | None = None, **body) -> ChatRenderer:
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
    return ChatRenderer(
        "chatcmpl-1", "tiny", request, [1] * 5, tiny_tokenizer(), None, parser, thinking
    )


def pieces(text: str, size: int = 3) -> list[RequestOutput]:
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        RequestOutput(
            "r", 0, [1], chunk, finished=k == len(chunks) - 1, finish_reason="stop",
            num_output_tokens=k + 1,
        )
        for k, chunk in enumerate(chunks)
    ]  # fmt: skip


def streamed(render: ChatRenderer, text: str) -> list[dict]:
    return [f["delta"] for out in pieces(text) for f in render.update(0, out)]


def test_streamed_reasoning_and_calls_follow_each_other():
    reply = (
        '<think>Use the tool.</think>\n\nSure. <tool_call>{"name": "time", "arguments": '
        '{"zone": 3}}</tool_call>'
    )
    deltas = streamed(renderer(False, "hermes"), reply)
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "Use the tool."
    assert reasoning == "".join(d.get("reasoning_content", "") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
    [call] = assemble([c for d in deltas for c in d.get("tool_calls", [])])
    assert call["function"] == {"name": "time", "arguments": '{"zone": 3}'}
    # No piece of a tag reaches the client.
    assert not any("<" in d.get("reasoning", "") + (d.get("content") or "") for d in deltas)

    whole = renderer(False, "hermes")
    for out in pieces(reply):
        whole.update(0, out)
    message = whole.response()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "Use the tool."
    assert message["content"] == "Sure. " and len(message["tool_calls"]) == 1


def test_include_reasoning_false_drops_the_reasoning():
    reply = "Thinking it over.</think>Blue."
    deltas = streamed(renderer(True, include_reasoning=False), reply)
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Blue."
    whole = renderer(True, include_reasoning=False)
    for out in pieces(reply):
        whole.update(0, out)
    assert whole.response()["choices"][0]["message"] == {"role": "assistant", "content": "Blue."}


def test_a_reply_that_never_finishes_thinking_has_no_content():
    whole = renderer(True)
    for out in pieces("still thinking about it"):
        whole.update(0, out)
    message = whole.response()["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"] == "still thinking about it"


# A thinking model's template opens the reasoning in the prompt (DeepSeek-R1, Qwen3 thinking).
THINKING_TEMPLATE = CHAT_TEMPLATE.replace("<|assistant|>", "<|assistant|><think>\n")


def thinking_tokenizer():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


async def test_served_replies_of_a_thinking_template_are_reasoning():
    """The random model never closes its thought: its whole reply is the reasoning."""
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    async with app_client(tokenizer=thinking_tokenizer()) as (client, _):
        plain = (await client.post("/v1/chat/completions", json=body)).json()
    text = plain["choices"][0]["message"]["content"]
    assert "</think>" not in text and "reasoning" not in plain["choices"][0]["message"]
    settings = ServerSettings(served_model_name="tiny", reasoning_parser="deepseek_r1")
    async with app_client(settings, tokenizer=thinking_tokenizer()) as (client, engine):
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0][
            "message"
        ]
        assert message["reasoning"] == text and message["content"] is None
        response = await client.post("/v1/chat/completions", json={**body, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in sse_events(response.text) if e != "[DONE]"]
        assert "".join(d.get("reasoning", "") for d in deltas) == text
        assert not "".join(d.get("content") or "" for d in deltas)
        assert blocks_in_use(engine) == 0


def marker_setup(template: str) -> tuple[dict, int]:
    """A tokenizer with `</think>` as one token under `template`, and a model that has it."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(["</think>"])
    tokenizer.chat_template = template
    model = tiny_llama(vocab_size=len(tokenizer), max_positions=1024)  # room for written tools
    return {"tokenizer": tokenizer, "model": model}, tokenizer.convert_tokens_to_ids("</think>")


def closed_at_once(marker: int) -> dict:
    """A request whose reply closes its thought at once (a bias on the closing token `marker`)
    and then writes three digits."""
    return {
        "messages": MESSAGES,
        "max_tokens": 40,
        "seed": 4,
        "logit_bias": {str(marker): 100},
        "structured_outputs": {"regex": "[0-9]{3}"},
    }


async def test_a_format_holds_for_the_answer_after_the_thought():
    """The model closes its thought at once (a bias on `</think>`); the format then shapes the
    answer, and the reasoning is apart."""
    options, marker = marker_setup(THINKING_TEMPLATE)
    settings = ServerSettings(served_model_name="tiny", reasoning_parser="qwen3")
    body = closed_at_once(marker)
    async with app_client(settings, **options) as (client, engine):
        message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0][
            "message"
        ]
        assert message["reasoning"] == "" and re.fullmatch("[0-9]{3}", message["content"])
        weather = {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        }
        tools = [{"type": "function", "function": {"name": "weather", "parameters": weather}}]
        named = {"type": "function", "function": {"name": "weather"}}
        del body["structured_outputs"]
        called = await client.post(
            "/v1/chat/completions", json={**body, "tools": tools, "tool_choice": named}
        )
        choice = called.json()["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"])["unit"] in ("c", "f")
        assert choice["message"]["reasoning"] == "" and choice["finish_reason"] == "tool_calls"
        assert blocks_in_use(engine) == 0


async def test_a_template_that_does_not_think_gives_plain_content():
    settings = ServerSettings(served_model_name="tiny", reasoning_parser="qwen3")
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    async with app_client(tokenizer=chat_tokenizer()) as (client, _):
        plain = (await client.post("/v1/chat/completions", json=body)).json()
    async with app_client(settings, tokenizer=chat_tokenizer()) as (client, _):
        parsed = (await client.post("/v1/chat/completions", json=body)).json()
        # A reply that may open its own thought and does not: the format from its first token.
        formatted = await client.post(
            "/v1/chat/completions",
            json={**body, "max_tokens": 30, "response_format": {"type": "json_object"}},
        )
    assert parsed["choices"][0]["message"] == plain["choices"][0]["message"]
    message = formatted.json()["choices"][0]["message"]
    assert "reasoning" not in message and message["content"].startswith("{")


async def test_a_reply_that_opens_its_own_thought_thinks_then_follows_the_format():
    """Qwen3's template leaves `<think>` to the reply: the reply may think first (a bias opens
    its thought, then closes it), the format then shapes the answer, and the reasoning is
    apart. The tags are tokens of their own, as Qwen3's are."""
    tokenizer = copy.deepcopy(chat_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    model = tiny_llama(vocab_size=len(tokenizer))
    settings = ServerSettings(served_model_name="tiny", reasoning_parser="qwen3")
    body = {
        "messages": MESSAGES,
        "max_tokens": 40,
        "seed": 4,
        "logit_bias": {str(think): 100, str(end): 30},
        "structured_outputs": {"regex": "[0-9]{3}"},
    }
    async with app_client(settings, model=model, tokenizer=tokenizer) as (client, engine):
        response = await client.post("/v1/chat/completions", json=body)
        message = response.json()["choices"][0]["message"]
        assert message["reasoning"] is not None
        assert re.fullmatch("[0-9]{3}", message["content"]), message
        # A line break in the regex, raw or escaped, holds after the thought too.
        for pattern in ("[0-9]\n[0-9]", re.escape("1\n2")):
            lines = {**body, "structured_outputs": {"regex": pattern}}
            response = await client.post("/v1/chat/completions", json=lines)
            assert response.status_code == 200, response.text
            answer = response.json()["choices"][0]["message"]["content"]
            assert re.fullmatch("[0-9]\n[0-9]", answer), answer
        assert blocks_in_use(engine) == 0


@pytest.mark.parametrize("key", ["reasoning_content", "thinking"])
async def test_earlier_reasoning_reaches_the_template(key):
    """By the name Qwen3's and DeepSeek's templates read, or gpt-oss's."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = (
        f"{{% for m in messages %}}<|{{{{ m['role'] }}}}|>{{{{ m.get('{key}', '') }}}}"
        "{{ m['content'] }}\n{% endfor %}"
    )
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Why?"},
    ]
    async with app_client(tokenizer=tokenizer) as (client, _):
        renders = []
        for extra in ({}, {"reasoning": "Scattering."}, {"reasoning_content": "Scattering."}):
            messages = copy.deepcopy(history)
            messages[1].update(extra)
            response = await client.post("/v1/chat/completions/render", json={"messages": messages})
            renders.append(response.json()["token_ids"])
    assert renders[1] == renders[2] != renders[0]
    assert tokenizer.decode(renders[1]).count("Scattering.") == 1


def test_serve_and_batch_run_take_the_reply_parsers():
    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert server_settings(args).reasoning_parser == "qwen3"
    assert server_settings(build_parser().parse_args(["serve"])).reasoning_parser is None
    batch = build_parser().parse_args(
        ["batch", "run", "in.jsonl", "out.jsonl", "--reasoning-parser", "deepseek_r1",
         "--tool-call-parser", "hermes"]
    )  # fmt: skip
    assert (batch.reasoning_parser, batch.tool_call_parser) == ("deepseek_r1", "hermes")
    for reasoning, tools in [("minimax_m2", "minimax_m2"), ("ernie45", "glm47"), ("kimi_k2",) * 2]:
        argv = ["serve", "--reasoning-parser", reasoning, "--tool-call-parser", tools]
        settings = server_settings(build_parser().parse_args(argv))  # vLLM's names taken
        assert (settings.reasoning_parser, settings.tool_call_parser) == (reasoning, tools)


# Magistral's tags are special tokens; Granite 3.2's are phrases.
OTHER_SPLITS = [
    # (parser, reply, starts in reasoning) -> (reasoning, answer)
    (("mistral", "[THINK]Rayleigh.[/THINK]\n\nShort light.", False), ("Rayleigh.", "Short light.")),
    (("mistral", "Rayleigh.[/THINK]Short.", True), ("Rayleigh.", "Short.")),
    (("mistral", "[THINKING] is text", False), (None, "[THINKING] is text")),
    (("mistral", "<think>not hers</think>ok", False), (None, "<think>not hers</think>ok")),
    (
        ("granite", "Here is my thought process: Rayleigh. Here is my response: Blue.", False),
        (" Rayleigh. ", "Blue."),
    ),
    (
        ("granite", "Here's my thought process:\nhm\nHere's my response:\nBlue.", False),
        ("\nhm\n", "Blue."),
    ),
    (("granite", "Here is the answer: blue.", False), (None, "Here is the answer: blue.")),
    (("granite", "Here is my thought process: cut", False), (" cut", "")),
    (("seed_oss", "<seed:think>Sky.</seed:think>Blue.", False), ("Sky.", "Blue.")),
    (("seed_oss", "<think>not its</think>ok", False), (None, "<think>not its</think>ok")),
    (("glm45", "<think>Sky.</think>Blue.", False), ("Sky.", "Blue.")),
    (("olmo3", "Sky.</think>Blue.", True), ("Sky.", "Blue.")),
]  # fmt: skip


@pytest.mark.parametrize(("reply", "expected"), OTHER_SPLITS)
def test_other_parsers_tags_split_a_reply_cut_anywhere_as_the_whole(reply, expected):
    parser, text, open_at_start = reply
    tags = tags_for(parser)
    assert split_reasoning(text, open_at_start, tags) == expected
    assert all(split_in_pieces(text, open_at_start, seed, tags) == expected for seed in range(20))


def test_a_prompt_opens_the_reasoning_with_the_parser_s_own_tag():
    assert opens_in_reasoning("[INST]hi[/INST][THINK]", tags_for("mistral"))
    assert not opens_in_reasoning("[INST]hi[/INST][THINK]", tags_for("qwen3"))
    assert opens_in_reasoning("<think>\n", tags_for(None))


def test_a_granite_reply_s_thought_and_response_come_apart_streamed_or_whole():
    reply = "Here is my thought process: light scatters. Here is my response: Blue."
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES})

    def granite() -> ChatRenderer:
        return ChatRenderer(
            "chatcmpl-1", "tiny", request, [1], tiny_tokenizer(), thinking=False,
            thought=tags_for("granite"),
        )  # fmt: skip

    deltas = streamed(granite(), reply)
    assert "".join(d.get("reasoning", "") for d in deltas) == " light scatters. "
    assert "".join(d.get("content") or "" for d in deltas) == "Blue."
    whole = granite()
    for out in pieces(reply):
        whole.update(0, out)
    message = whole.response()["choices"][0]["message"]
    assert message["reasoning"] == " light scatters. " and message["content"] == "Blue."


async def test_magistral_s_special_tags_are_kept_in_the_text_to_be_read():
    """The template opens the thought with `[THINK]`; the model closes it at once (a bias on
    the special token `[/THINK]`), and the format shapes the answer after it."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<|assistant|>", "<|assistant|>[THINK]")
    model = tiny_llama(vocab_size=len(tokenizer))
    marker = tokenizer.convert_tokens_to_ids("[/THINK]")
    body = closed_at_once(marker)
    for parser, kept in (("mistral", True), ("qwen3", False)):
        settings = ServerSettings(served_model_name="tiny", reasoning_parser=parser)
        async with app_client(settings, tokenizer=tokenizer, model=model) as (client, _):
            render = await client.post("/v1/chat/completions/render", json=body)
            assert render.json()["sampling_params"]["skip_special_tokens"] is not kept
            if parser == "mistral":
                reply = await client.post("/v1/chat/completions", json=body)
                message = reply.json()["choices"][0]["message"]
                assert message["reasoning"] == "" and re.fullmatch("[0-9]{3}", message["content"])
