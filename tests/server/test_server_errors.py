"""Bad input gets a clear error in OpenAI's shape, and the server stays healthy."""

from __future__ import annotations

import asyncio

import pytest

from server.settings import ServerSettings
from tests.helpers import sabotage_steps
from tests.server_utils import app_client, blocks_in_use, sse_events

MESSAGES = [{"role": "user", "content": "Hi"}]


def assert_error(response, status: int, param: str | None = None, text: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param
    if text is not None:
        assert text in error["message"]
    return error


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": ["ok", ""]}, "prompt", None),
    ({"prompt": [[1, 2], []]}, "prompt", None),
    ({}, "prompt", None),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens", None),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"prompt": "x", "temperature": -1}, "temperature", None),
    ({"prompt": "x", "temperature": "hot"}, "temperature", None),
    ({"prompt": "x", "top_p": 1.5}, "top_p", None),
    ({"prompt": "x", "n": 0}, "n", None),
    ({"prompt": "x", "n": 10_000}, "n", None),
    ({"prompt": "x", "logprobs": 50}, "logprobs", None),
    ({"prompt": "x", "presence_penalty": 9}, "presence_penalty", None),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", None),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias", None),
    ({"prompt": "x", "stop": [""]}, "stop", None),
    ({"prompt": "x", "seed": 2**70}, "seed", None),
    ({"prompt": "x", "suffix": "tail"}, "suffix", None),
    ({"prompt": "x", "best_of": 3}, "best_of", None),
    ({"prompt": [1, -4]}, "prompt", None),
    ({"prompt": [10**9]}, "prompt", None),
    ({"prompt": "x", "stream": "yes please"}, "stream", None),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": list(range(2, 80))}, "prompt", "maximum context length is 64 tokens"),
]


@pytest.mark.parametrize(("body", "param", "text"), BAD_COMPLETIONS)
async def test_bad_completion_requests_get_400(body, param, text):
    async with app_client(max_model_len=64) as (client, engine):
        response = await client.post("/v1/completions", json=body)
        assert_error(response, 400, param, text)
        assert (await client.get("/health")).status_code == 200
        assert blocks_in_use(engine) == 0 and not engine.core.has_unfinished()


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content",
    ),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 99, "logprobs": True}, "top_logprobs"),
    ({"messages": MESSAGES, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": None}]}, "messages.1"),
    (
        {"messages": MESSAGES, "stream": False, "stream_options": {"include_usage": False}},
        "stream_options",
    ),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
async def test_bad_chat_requests_get_400(body, param):
    async with app_client() as (client, engine):
        response = await client.post("/v1/chat/completions", json=body)
        assert_error(response, 400, param)
        assert blocks_in_use(engine) == 0


async def test_malformed_bodies_get_400():
    async with app_client() as (client, _):
        headers = {"content-type": "application/json"}
        for raw in (
            b"{not json",
            b"\xff\xfe\x00garbage",
            b'{"prompt": "\xc3\x28"}',
            b"",
            b"[1, 2, 3]",
        ):
            response = await client.post("/v1/completions", content=raw, headers=headers)
            assert_error(response, 400)
        assert (await client.get("/health")).status_code == 200


async def test_huge_body_gets_400():
    settings = ServerSettings(served_model_name="tiny", max_body_bytes=10_000)
    async with app_client(settings) as (client, _):
        response = await client.post("/v1/completions", json={"prompt": "x" * 20_000})
        assert_error(response, 400, text="larger than the limit")

        async def chunks():  # no content-length: counted while reading
            for _ in range(20):
                yield b" " * 1000

        response = await client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert_error(response, 400, text="larger than the limit")
        assert (await client.get("/health")).status_code == 200


async def test_unknown_model_is_404():
    async with app_client() as (client, _):
        response = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
        error = assert_error(response, 404, "model")
        assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
        response = await client.post(
            "/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES}
        )
        assert_error(response, 404, "model")


async def test_unknown_route_is_404_in_openai_shape():
    async with app_client() as (client, _):
        assert_error(await client.get("/v1/nothing"), 404)


async def test_engine_failure_before_any_output_is_a_500(monkeypatch):
    async with app_client() as (client, engine):
        sabotage_steps(engine.core, monkeypatch, message="kernel exploded")
        response = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert_error(response, 500, text="kernel exploded")
        # A stream starts with its first delta: a failure before it is a plain HTTP error.
        streamed = await client.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "stream": True}
        )
        assert_error(streamed, 500, text="kernel exploded")
        monkeypatch.undo()
        assert (await client.get("/health")).status_code == 200
        ok = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200
        assert blocks_in_use(engine) == 0


async def test_failure_after_tokens_streamed_ends_with_error_then_done(monkeypatch):
    async with app_client() as (client, engine):
        sabotage_steps(engine.core, monkeypatch, fail_on={3}, message="late failure")
        async with client.stream(
            "POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 10, "stream": True}
        ) as streamed:
            events = sse_events((await streamed.aread()).decode())
        texts = [e for e in events[:-1] if "choices" in e]
        assert len(texts) == 2 and "late failure" in events[-2]["error"]["message"]
        assert blocks_in_use(engine) == 0


async def test_empty_stream_options_need_no_stream():
    """Only stream_options that set something need a stream (vLLM's rule)."""
    async with app_client() as (client, _):
        for options in (None, {}):
            body = {"prompt": "Hi", "max_tokens": 2, "stream_options": options}
            assert (await client.post("/v1/completions", json=body)).status_code == 200


async def test_stream_options_take_booleans_only():
    """A 0 for a boolean was taken as false (schemathesis found it)."""
    async with app_client() as (client, _):
        body = {"prompt": "Hi", "stream_options": {"continuous_usage_stats": 0}}
        for path in ("/v1/completions/render", "/v1/completions"):
            refused = await client.post(path, json=body | {"max_tokens": 2})
            assert refused.status_code == 400, path


async def test_rules_that_leave_no_token_are_a_400_naming_them():
    """A format with allowed_token_ids outside it: no token may come first. The request is a
    400, streamed or not, and a request beside it is served as ever."""
    body = {
        "prompt": "Hi",
        "max_tokens": 4,
        "structured_outputs": {"choice": ["yes", "no"]},
        "allowed_token_ids": [7],
    }
    plain = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    async with app_client() as (client, engine):
        alone = (await client.post("/v1/completions", json=plain)).json()["choices"][0]["text"]
        refused, beside = await asyncio.gather(
            client.post("/v1/completions", json=body), client.post("/v1/completions", json=plain)
        )
        assert_error(refused, 400, "allowed_token_ids", "rule out every token")
        assert beside.json()["choices"][0]["text"] == alone
        streamed = await client.post("/v1/completions", json=body | {"stream": True})
        assert_error(streamed, 400, "allowed_token_ids", "the output format and allowed_token_ids")
        assert blocks_in_use(engine) == 0
