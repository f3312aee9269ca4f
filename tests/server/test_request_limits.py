"""Limits on a request's lists: past one, a 400 naming the field, before any engine work."""

from __future__ import annotations

import pytest

from server.cli import build_parser, server_settings
from server.limits import RequestLimits
from server.settings import ServerSettings
from tests.helpers import tiny_llama
from tests.server_utils import app_client

LIMITS = RequestLimits(
    max_stop_strings=3, max_stop_string_chars=8, max_prompts=2, max_logit_bias=2, max_messages=2
)
SETTINGS = ServerSettings(served_model_name="tiny", limits=LIMITS)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"stop": ["a", "b", "c", "d"]}, "stop"),
        ("/v1/completions", {"stop": "x" * 9}, "stop"),
        ("/v1/completions", {"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids"),
        ("/v1/completions", {"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [3], [4]]}, "prompt"),
        ("/v1/chat/completions", {"messages": HELLO * 3}, "messages"),
        ("/v1/chat/completions", {"stop": ["a", "b", "c", "d"]}, "stop"),
    ],
)
async def test_a_request_past_a_limit_is_refused_naming_the_field(path, extra, param):
    body = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": HELLO}
    async with app_client(SETTINGS) as (client, engine):
        response = await client.post(path, json={**body, "max_tokens": 2, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert "At most" in error["message"]
        assert not engine.core.has_unfinished()


async def test_a_request_at_the_limits_is_served():
    async with app_client(SETTINGS) as (client, _):
        response = await client.post(
            "/v1/completions",
            json={
                "prompt": ["a", "b"],
                "max_tokens": 2,
                "stop": ["x" * 8, "b", "c"],
                "logit_bias": {"1": 1, "2": 1},
            },
        )
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2


def test_the_limits_are_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "--max-stop-strings",
            "5",
            "--max-prompts",
            "7",
            "--max-stop-string-chars",
            "9",
            "--max-logit-bias",
            "11",
            "--max-messages",
            "13",
        ]
    )
    assert server_settings(args).limits == RequestLimits(5, 9, 7, 11, 13)
    defaults = server_settings(build_parser().parse_args(["serve"])).limits
    assert defaults == RequestLimits()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "model": "\\ud800", "max_tokens": 2}', "model"),
        ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            "messages",
        ),
    ],
)
async def test_a_lone_surrogate_is_a_400_and_the_server_carries_on(path, body, param):
    async with app_client() as (client, _):
        response = await client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"].startswith(param) and "lone surrogate" in error["message"]
        assert (await client.get("/health")).status_code == 200
        ok = await client.post("/v1/completions", json={"prompt": "a 🚀 b", "max_tokens": 2})
        assert ok.status_code == 200


@pytest.mark.parametrize(
    ("path", "size", "off_loop"),
    [
        ("/v1/completions", 100, False),
        ("/v1/completions", 20_000, True),
        ("/v1/chat/completions", 100, False),
        ("/v1/chat/completions", 20_000, True),
    ],
)
async def test_large_bodies_are_tokenized_off_the_event_loop(monkeypatch, path, size, off_loop):
    import threading

    from server import serving_chat, tokenization

    # A prompt is tokenized by the helper completions and embeddings share.
    module, name = (
        (tokenization, "prompt_token_ids") if "chat" not in path else (serving_chat, "chat_prompt")
    )
    real, threads = getattr(module, name), []

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    text = "Hello " * (size // 6)
    body = (
        {"prompt": text}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": text}]}
    )
    # A context long enough that this much text may fit, so it is tokenized.
    long_context = {"model": tiny_llama(max_positions=4096), "max_model_len": 4096}
    async with app_client(**long_context, num_blocks=1024) as (client, _):
        await client.post(path, json={**body, "max_tokens": 1})
    assert len(threads) == 1
    assert (threads[0] is not threading.main_thread()) == off_loop


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_text_too_long_for_the_context_is_refused_without_tokenizing(monkeypatch, path):
    """No token spells more than the vocabulary's longest entry, so longer text than the context
    times that is refused at once; text just under it is tokenized and measured as before."""
    from server import serving_chat, tokenization
    from server.tokenization import longest_token_chars

    # A prompt is tokenized by the helper completions and embeddings share.
    module, name = (
        (tokenization, "prompt_token_ids") if "chat" not in path else (serving_chat, "chat_prompt")
    )
    real, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)

    def body(chars: int) -> dict:
        text = "a" * chars
        if "chat" in path:
            return {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        return {"prompt": text, "max_tokens": 1}

    async with app_client(max_model_len=64) as (client, engine):
        longest = longest_token_chars(engine.tokenizer)
        response = await client.post(path, json=body(64 * longest))
        assert response.status_code == 400
        error = response.json()["error"]
        assert "at least 64 tokens" in error["message"]
        assert error["param"] == ("messages" if "chat" in path else "prompt")
        assert calls == []
        response = await client.post(path, json=body(63 * longest))
        assert response.status_code == 400  # too long once tokenized, but it was tokenized
        assert "at least" not in response.json()["error"]["message"]
        assert calls == [1]
