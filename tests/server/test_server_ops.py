"""Models, health, version, tokenize, API keys, request ids, CORS, queue limits, disconnects and
shutdown."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.requests import ClientDisconnect

from server.app import build_app
from server.cli import build_parser, server_settings
from server.http_protocol import uvicorn_config
from server.settings import ServerSettings
from tests.helpers import chat_tokenizer, sabotage_steps
from tests.server_utils import (
    app_client,
    blocks_in_use,
    live_server,
    tiny_engine,
    until,
    wait_until_idle,
)

ROOT = Path(__file__).resolve().parents[2]

LONG = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}


async def test_models_health_version():
    async with app_client(max_model_len=128) as (client, _):
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        [model] = models["data"]
        assert model["id"] == "tiny" and model["object"] == "model"
        assert model["max_model_len"] == 128
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/version")).json()["version"]


async def test_a_model_is_retrieved_by_any_name_it_is_served_under():
    """OpenAI's `GET /v1/models/{model}` (the SDK's `models.retrieve`), a hub id's slash kept."""
    settings = ServerSettings(served_model_name="org/tiny", served_model_aliases=("alias",))
    async with app_client(settings) as (client, _):
        listed = (await client.get("/v1/models")).json()["data"]
        for card in listed:
            retrieved = await client.get(f"/v1/models/{card['id']}")
            assert retrieved.status_code == 200
            assert {**retrieved.json(), "created": 0} == {**card, "created": 0}
        missing = await client.get("/v1/models/org/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"


async def test_health_is_503_when_the_engine_is_down():
    async with app_client() as (client, engine):
        await engine.shutdown()
        assert (await client.get("/health")).status_code == 503
        response = await client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error"


async def test_tokenize_and_detokenize_round_trip():
    tokenizer = chat_tokenizer()
    async with app_client(max_model_len=128) as (client, _):
        body = (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
        assert body["tokens"] == tokenizer("Hello world")["input_ids"]
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 128
        text = (await client.post("/detokenize", json={"tokens": body["tokens"]})).json()
        assert text["prompt"] == "Hello world"
        chat = (
            await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
        ).json()
        assert chat["count"] > 2
        bad = await client.post("/detokenize", json={"tokens": [10**8]})
        assert bad.status_code == 400
        assert body["token_strs"] is None  # vLLM's field, filled only when asked for
        for asked in ({"prompt": "Hello world"}, {"messages": [{"role": "user", "content": "Hi"}]}):
            named = await client.post("/tokenize", json={**asked, "return_token_strs": True})
            named_body = named.json()
            expected = tokenizer.convert_ids_to_tokens(named_body["tokens"])
            assert named_body["token_strs"] == expected and len(expected) == named_body["count"]


async def test_api_key_guards_the_api_but_not_health():
    settings = ServerSettings(served_model_name="tiny", api_key="sesame")
    async with app_client(settings) as (client, _):
        body = {"prompt": "Hello", "max_tokens": 2}
        missing = await client.post("/v1/completions", json=body)
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        wrong = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        assert (await client.get("/v1/models")).status_code == 401
        right = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}
        )
        assert right.status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/version")).status_code == 200


async def test_request_id_header_is_echoed_or_made():
    async with app_client() as (client, _):
        body = {"prompt": "Hello", "max_tokens": 1}
        mine = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-1"})
        assert mine.headers["x-request-id"] == "abc-1"
        made = await client.post("/v1/completions", json=body)
        assert len(made.headers["x-request-id"]) >= 16
        again = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-1"})
        assert again.status_code == 200  # a reused client id does not clash inside the engine


async def test_an_unexpected_error_is_a_500_in_openai_s_shape_and_goes_no_further(monkeypatch):
    """A bug in a handler answers its request with a 500 (request id and all) and stops there:
    the exception does not reach the server, which would drop the client's connection."""
    from server.logprobs import CompletionLogprobs

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(CompletionLogprobs, "add", broken)
    async with app_client() as (client, engine):  # the transport raises what reaches it
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "logprobs": 1}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 500
        assert response.json()["error"] == {
            "message": "Internal server error: ValueError",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        assert response.headers["x-request-id"]
        del body["logprobs"]
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        await wait_until_idle(engine)
        assert blocks_in_use(engine) == 0


async def test_cors_only_when_allowed():
    async with app_client(ServerSettings(allowed_origins=("https://ui.example",))) as (client, _):
        response = await client.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert response.headers["access-control-allow-origin"] == "https://ui.example"
    async with app_client() as (client, _):
        response = await client.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert "access-control-allow-origin" not in response.headers


async def test_vllm_s_cors_flags_reach_the_preflight_answer():
    argv = ["serve", "--allowed-origins", '["https://ui.example"]', "--allowed-methods", "GET,POST"]
    argv += ["--allowed-headers", '["Authorization"]', "--allow-credentials"]
    settings = server_settings(build_parser().parse_args(argv))
    assert settings.allowed_origins == ("https://ui.example",)
    async with app_client(settings) as (client, _):
        preflight = await client.options(
            "/v1/chat/completions",
            headers={
                "Origin": "https://ui.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "Authorization",
            },
        )
        refused = await client.options(
            "/v1/chat/completions",
            headers={"Origin": "https://ui.example", "Access-Control-Request-Method": "DELETE"},
        )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert set(preflight.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    assert refused.status_code == 400


async def test_a_unix_domain_socket_serves_instead_of_a_port(tmp_path):
    """vLLM's `--uds`: uvicorn listens on the socket file, and a client reaches it there."""
    path = str(tmp_path / "conveyor.sock")
    settings = ServerSettings(served_model_name="tiny")
    app = build_app(tiny_engine(), settings)
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, "warning", settings, uds=path))
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or task.done(), what="the server to start")
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://conveyor") as client:
            models = await client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        assert server.servers[0].sockets[0].family == socket.AF_UNIX
    finally:
        server.should_exit = True
        await task


async def test_full_queue_gets_503_with_retry_after(monkeypatch):
    async with live_server(max_waiting_requests=1, max_num_seqs=1) as server:
        engine = server.engine
        sabotage_steps(engine.core, monkeypatch, fail_on=set(), delay=0.02)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            scheduler = engine.core.scheduler
            running = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await until(lambda: scheduler.num_running == 1)
            queued = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await until(lambda: scheduler.num_waiting == 1)
            refused = await client.post("/v1/completions", json=LONG)
            assert refused.status_code == 503
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["type"] == "server_error"
            running.cancel()
            queued.cancel()
            await asyncio.gather(running, queued, return_exceptions=True)
        await wait_until_idle(engine)


async def test_streaming_client_that_disconnects_frees_its_blocks():
    async with live_server() as server:
        engine = server.engine
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
            assert blocks_in_use(engine) > 0
        await wait_until_idle(engine)
        assert engine.core.scheduler.num_running == 0


async def test_non_streaming_client_that_disconnects_frees_its_blocks():
    async with live_server() as server:
        engine = server.engine
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            task = asyncio.create_task(client.post("/v1/completions", json=LONG))
            await until(lambda: blocks_in_use(engine) > 0)
            assert blocks_in_use(engine) > 0
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await wait_until_idle(engine)


async def test_draining_server_refuses_new_work_but_finishes_running():
    async with live_server() as server:
        engine = server.engine
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            running = asyncio.create_task(
                client.post(
                    "/v1/completions",
                    json={"prompt": "Hello", "max_tokens": 30, "ignore_eos": True},
                )
            )
            await until(lambda: blocks_in_use(engine) > 0)
            server.app.state.draining = True  # what SIGTERM does
            refused = await client.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503
            assert (await client.get("/health")).status_code == 503
            finished = await running
            assert finished.status_code == 200
            assert finished.json()["usage"]["completion_tokens"] == 30


async def test_a_wrong_key_is_refused_before_the_body_is_read():
    settings = ServerSettings(served_model_name="tiny", api_key="sesame")
    async with app_client(settings) as (client, _):
        read = []

        async def body():
            read.append(True)
            yield b'{"prompt": "Hello", "max_tokens": 2}'

        refused = await client.post(
            "/v1/completions", content=body(), headers={"content-type": "application/json"}
        )
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert read == []  # the body was never pulled
        preflight = await client.options("/v1/completions")
        assert preflight.status_code != 401
        assert (await client.get("/metrics")).status_code == 200


@pytest.mark.parametrize("given", ["x" * 129, "evil\tid", "a" * 10_000])
async def test_a_long_or_odd_request_id_is_replaced_not_echoed(given):
    async with app_client() as (client, _):
        reply = await client.post(
            "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 1},
            headers={"X-Request-Id": given},
        )
        assert reply.status_code == 200
        assert reply.headers["x-request-id"] != given
        assert len(reply.headers["x-request-id"]) == 32


def test_the_loaded_model_is_frozen_out_of_full_collections():
    """After `freeze_heap` a full collection walks only what serving allocates, not the
    hundreds of thousands of objects torch and the model left (run in a fresh interpreter: a
    frozen heap stays frozen)."""
    script = (
        "import gc, torch, transformers; from tests.helpers import tiny_llama;"
        "model = tiny_llama(); gc.collect();"
        "before = len(gc.get_objects(generation=2));"
        "from server.lifecycle import freeze_heap; frozen = freeze_heap();"
        "print(before, frozen, len(gc.get_objects(generation=2)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    before, frozen, after = map(int, result.stdout.split())
    assert frozen >= before > 100_000
    assert after < before // 100


async def test_a_stream_whose_client_left_before_its_first_write_is_aborted():
    """The response's first send fails (the client went between the first delta and the
    first write): the stream's generator never starts, yet its request is aborted, not left
    running unread."""
    async with app_client() as (_, engine):
        app = build_app(engine, ServerSettings(served_model_name="tiny"))
        finished: list[str] = []
        engine.stat_loggers.append(
            lambda stats: finished.extend(f.finish_reason for f in stats.finished)
        )
        body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        request = {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

        bodies = [request]

        async def receive() -> dict:
            if bodies:
                return bodies.pop()
            await asyncio.Event().wait()  # the disconnect shows only as the failed send
            raise AssertionError("unreachable")

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                raise OSError("the client is gone")

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "root_path": "",
        }  # fmt: skip
        with pytest.raises(ClientDisconnect):
            await app(scope, receive, send)
        await until(lambda: bool(finished), what="the request finished")
        assert finished == ["abort"]
        await wait_until_idle(engine)


async def test_a_response_s_id_carries_the_client_s_request_id():
    """As vLLM: `PREFIX-` and the `X-Request-Id` header, else the body's `request_id`, else a
    fresh one; the same id twice at once serves both."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with app_client() as (client, engine):
        headed = await client.post(
            "/v1/chat/completions", json=chat, headers={"X-Request-Id": "gateway-7"}
        )
        assert headed.json()["id"] == "chatcmpl-gateway-7"
        assert headed.headers["x-request-id"] == "gateway-7"
        named = await client.post("/v1/completions", json={"prompt": "Hi", "request_id": "job-3"})
        assert named.json()["id"] == "cmpl-job-3"
        both = await client.post(
            "/v1/completions",
            json={"prompt": "Hi", "request_id": "job-3", "max_tokens": 2},
            headers={"X-Request-Id": "gateway-8"},
        )
        assert both.json()["id"] == "cmpl-gateway-8"
        fresh = (await client.post("/v1/completions", json={"prompt": "Hi"})).json()["id"]
        assert re.fullmatch("cmpl-[0-9a-f]{32}", fresh)
        same = {"prompt": "Hi", "request_id": "same", "max_tokens": 8, "ignore_eos": True}
        twice = await asyncio.gather(*(client.post("/v1/completions", json=same) for _ in range(2)))
        assert [r.json()["id"] for r in twice] == ["cmpl-same", "cmpl-same"]
        odd = await client.post("/v1/completions", json={"prompt": "Hi", "request_id": "a\nb"})
        assert odd.status_code == 400 and odd.json()["error"]["param"] == "request_id"
        assert blocks_in_use(engine) == 0
