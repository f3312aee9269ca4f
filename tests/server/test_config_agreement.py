"""The same requests, greedy or seeded, with random fields (stops, penalties, biases, bad
words, logprobs, `n`, formats, tool calls, priorities, cache salts, streaming), sent at once to
servers that differ only in how they run them: drafts (suffix decoding) with a KV cache small
enough to preempt and a step budget that chunks prompts, n-gram drafts over 16-token blocks,
overlapped steps, priority classes queued for few slots, and torch's attention without prefix
caching and with long prompts chunked. Each answer must be the same as a server's that runs
them plainly, and every block free after."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import pytest

from engine.core.speculation import SpeculativeConfig
from tests.helpers import CORPUS, tiny_llama
from tests.server_utils import app_client, blocks_in_use, sse_events, wait_until_idle

WORDS = " ".join(CORPUS).split()
COUNT = 64
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"q": {"type": "string", "maxLength": 5}},
                "required": ["q"],
            },
        },
    }
    for name in ("look", "find")
]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def _words(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most)))


def _format(rng: random.Random) -> dict[str, Any]:
    return rng.choice(
        [
            {"structured_outputs": {"regex": "[a-z]{2,8}( [a-z]+)*"}},
            {"structured_outputs": {"choice": [_words(rng, 3) for _ in range(3)]}},
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            {"response_format": {"type": "json_object"}},
        ]
    )


def _fields(rng: random.Random, chat: bool, max_tokens: int) -> dict[str, Any]:
    """Each field with its own chance, so requests combine them at random."""
    menu: list[tuple[float, dict[str, Any]]] = [
        (0.3, {"ignore_eos": True}),
        (0.2, {"stop": [rng.choice(["e", "th", " a", ".", "s "])]}),
        (0.1, {"include_stop_str_in_output": True}),
        (0.15, {"stop_token_ids": [rng.randrange(2, 320) for _ in range(2)]}),
        (0.2, {"min_tokens": rng.randint(0, max_tokens)}),
        (0.2, {"logit_bias": {str(rng.randrange(2, 320)): rng.choice([-100, 5, 100])}}),
        (0.15, {"bad_words": [rng.choice(WORDS)]}),
        (0.1, {"allowed_token_ids": sorted({rng.randrange(2, 320) for _ in range(12)})}),
        (0.2, {rng.choice(["presence_penalty", "frequency_penalty"]): rng.choice([-1.5, 2.0])}),
        (0.15, {"repetition_penalty": rng.choice([0.7, 1.3])}),
        (0.2, {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}),
        (0.15, {"n": rng.randint(2, 3)}),
        (0.2, _format(rng)),
        (0.35, {"stream": True}),
        (0.4, {"priority": rng.randint(-2, 2)}),
        (0.2, {"cache_salt": rng.choice(["a", "b"])}),
    ]
    chosen: dict[str, Any] = {}
    for chance, fields in menu:
        if rng.random() < chance:
            chosen.update(fields)
    return chosen


def _request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    chat = rng.random() < 0.35
    max_tokens = rng.randint(1, 40)
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0}
    if rng.random() < 0.3:  # seeded sampling: the same tokens whatever the run
        body.update(temperature=rng.choice([0.5, 1.2]), seed=rng.randrange(1000))
    body.update(_fields(rng, chat, max_tokens))
    if chat:
        body["messages"] = [{"role": "user", "content": _words(rng, 10)}]
        if rng.random() < 0.2:  # calls forced by the tool choice, in the tools' format
            body.pop("structured_outputs", None)
            body.pop("response_format", None)
            body.update(tools=TOOLS, tool_choice=rng.choice(["required", "none"]), max_tokens=40)
        return "/v1/chat/completions", body
    prompt = _words(rng, 24)
    body["prompt"] = f"{prompt} {prompt}" if rng.random() < 0.3 else prompt  # repeats to draft
    return "/v1/completions", body


def _answer(body: dict[str, Any], status: int, text: str) -> Any:
    """What must agree: each choice's text (tool calls included), finish reason and logprob
    tokens, and the token counts (not the cached ones: blocks of another size cache other
    prefixes); an error's status and message."""
    if status != 200:
        return status, json.loads(text)["error"]["message"]
    if body.get("stream"):
        texts: dict[int, str] = {}
        calls: dict[tuple[int, int], str] = {}
        finishes: dict[int, str] = {}
        errors = []
        for event in sse_events(text)[:-1]:
            if "error" in event:  # a request that failed after it streamed tokens
                errors.append(event["error"]["message"])
            for choice in event.get("choices", []):
                index, delta = choice["index"], choice.get("delta", {})
                texts[index] = texts.get(index, "") + (
                    choice.get("text") or delta.get("content") or ""
                )
                for call in delta.get("tool_calls") or []:  # pieces as they streamed, joined
                    function = call.get("function", {})
                    key = (index, call["index"])
                    calls[key] = calls.get(key, "") + (function.get("name") or "")
                    calls[key] += function.get("arguments") or ""
                finishes[index] = choice.get("finish_reason") or finishes.get(index, "")
        texts_in_order = sorted((i, t, finishes[i]) for i, t in texts.items())
        return texts_in_order, sorted(calls.items()), errors
    payload = json.loads(text)
    answers = []
    for choice in payload["choices"]:
        message = choice.get("message")
        # Tool call ids are random; the calls' names and arguments must agree.
        calls = [call["function"] for call in (message or {}).get("tool_calls") or []]
        content = message and (message["content"] or "") + json.dumps(calls)
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens") or [e["token"] for e in logprobs.get("content") or []]
        answers.append(
            (choice["index"], content or choice.get("text"), choice["finish_reason"], tokens)
        )
    usage = {k: v for k, v in payload["usage"].items() if k != "prompt_tokens_details"}
    return sorted(answers), usage


async def _answers(requests: list[tuple[str, dict[str, Any]]], **options: Any) -> list[Any]:
    async with app_client(model=MODEL, **options) as (client, engine):

        async def send(path: str, body: dict[str, Any]) -> Any:
            response = await client.post(path, json=body, timeout=120)
            assert response.status_code < 500, response.text
            return _answer(body, response.status_code, response.text)

        answers = await asyncio.gather(*(send(path, body) for path, body in requests))
        await wait_until_idle(engine, timeout=60)
        assert blocks_in_use(engine) == 0
        metrics = (await client.get("/metrics")).text
        return [answers, engine.core.scheduler.num_preemptions, metrics]


SUFFIX = {
    "method": "suffix",
    "num_speculative_tokens": 8,
    "suffix_decoding_max_spec_factor": 4.0,
    "suffix_decoding_min_token_prob": 0.0,
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1}
# A context long enough for the tools' prompt (about 800 tokens with the tiny tokenizer).
MODEL = tiny_llama(max_positions=2048)
PLAIN = dict(async_scheduling=False, num_blocks=1024)
WAYS = {
    # 300 blocks of 4 hold 1200 tokens, more than any request needs: preemptions, and the
    # same answers as a longer context.
    "drafts-preempted-chunked": dict(
        speculative=SpeculativeConfig.of(SUFFIX), num_blocks=300, max_num_batched_tokens=64
    ),
    "ngram-16-token-blocks": dict(
        speculative=SpeculativeConfig.of(NGRAM), block_size=16, num_blocks=256
    ),
    "overlapped": dict(async_scheduling=True, num_blocks=1024),
    # Priority classes queued for few slots: requests run in another order, beside others.
    "priority-few-slots": dict(
        scheduling_policy="priority", max_num_seqs=6, num_blocks=300, async_scheduling=False
    ),
    "torch-attention-no-prefix-cache": dict(
        attention_backend="torch",
        enable_prefix_caching=False,
        long_prefill_token_threshold=16,
        num_blocks=1024,
    ),
}


@pytest.fixture(scope="module")
def requests_and_plain() -> tuple[list[tuple[str, dict[str, Any]]], list[Any]]:
    rng = random.Random(11)
    requests = [_request(rng) for _ in range(COUNT)]
    plain = asyncio.run(_answers(requests, **PLAIN))
    return requests, plain[0]


@pytest.mark.parametrize("way", sorted(WAYS))
def test_the_same_requests_get_the_same_answers_however_the_server_runs_them(
    way: str, requests_and_plain: tuple[list[tuple[str, dict[str, Any]]], list[Any]]
):
    requests, plain = requests_and_plain
    refused = [req for req, answer in zip(requests, plain, strict=True) if answer[0] == 400]
    assert len(refused) < COUNT // 8, refused  # a few: an n above best_of's, ...
    answers, preemptions, metrics = asyncio.run(_answers(requests, **WAYS[way]))
    for request, expected, answer in zip(requests, plain, answers, strict=True):
        assert answer == expected, request
    if way.startswith("drafts"):  # the run did what it is named for
        assert preemptions > 0
        accepted = re.search(r"^vllm:spec_decode_num_accepted_tokens_total\S* (\S+)", metrics, re.M)
        assert accepted is not None and float(accepted.group(1)) > 0
