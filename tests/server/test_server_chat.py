"""POST /v1/chat/completions through the app on a tiny engine."""

from __future__ import annotations

import pytest

from server.settings import ServerSettings
from tests.helpers import chat_tokenizer, tiny_tokenizer
from tests.server_utils import app_client, blocks_in_use, sse_events

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


def counts(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


async def chat(client, **body):
    response = await client.post(
        "/v1/chat/completions", json={**GREEDY, "messages": MESSAGES, **body}
    )
    assert response.status_code == 200, response.text
    return response.json()


async def test_chat_shape_usage_and_template():
    async with app_client() as (client, engine):
        body = await chat(client, max_tokens=6)
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        [choice] = body["choices"]
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] == "length"
        tokenizer = chat_tokenizer()
        text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        prompt_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert body["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 6,
            "total_tokens": prompt_tokens + 6,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert blocks_in_use(engine) == 0


async def test_content_parts_equal_plain_content():
    parts = [
        {
            "role": "system",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        },
        {"role": "user", "content": [{"type": "text", "text": "Hello there"}]},
    ]
    async with app_client() as (client, _):
        plain = await chat(client, max_tokens=5)
        from_parts = await chat(client, max_tokens=5, messages=parts)
        assert from_parts["choices"][0]["message"] == plain["choices"][0]["message"]
        assert counts(from_parts["usage"]) == counts(plain["usage"])
        # The same prompt again: its full blocks come from the prefix cache.
        cached = from_parts["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < from_parts["usage"]["prompt_tokens"]


async def test_max_completion_tokens_wins_over_max_tokens():
    async with app_client() as (client, _):
        body = await chat(client, max_tokens=9, max_completion_tokens=3)
        assert body["usage"]["completion_tokens"] == 3


async def test_chat_logprobs_and_top_logprobs():
    async with app_client() as (client, _):
        body = await chat(client, max_tokens=4, logprobs=True, top_logprobs=2)
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == 4
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert entry["bytes"] == list(entry["token"].encode())
            assert len(entry["top_logprobs"]) == 2
            assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        without = await chat(client, max_tokens=4)
        assert without["choices"][0]["logprobs"] is None


async def test_streaming_chat_role_first_finish_last():
    async with app_client() as (client, _):
        whole = await chat(client, max_tokens=8, n=2, temperature=1.0, seed=5)
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                **GREEDY,
                "messages": MESSAGES,
                "max_tokens": 8,
                "n": 2,
                "temperature": 1.0,
                "seed": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            events = sse_events((await r.aread()).decode())
        chunks = events[:-1]
        assert chunks[-1]["choices"] == []
        assert counts(chunks[-1]["usage"]) == counts(whole["usage"])
        for index in (0, 1):
            mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert mine[-1]["finish_reason"] == "length"
            assert all(m["finish_reason"] is None for m in mine[:-1])
            text = "".join(m["delta"].get("content", "") for m in mine)
            assert text == whole["choices"][index]["message"]["content"]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_model_without_chat_template_is_a_400():
    async with app_client(tokenizer=tiny_tokenizer()) as (client, _):
        response = await client.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3}
        )
        assert response.status_code == 400
        assert "chat template" in response.json()["error"]["message"]
        completion = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200


async def test_served_model_name_defaults_to_the_model():
    async with app_client(ServerSettings()) as (client, _):
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "tiny-llama"
        ok = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 2},
        )
        assert ok.status_code == 200
