"""Server test harness: a tiny engine behind the app, in-process or on a real port."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from engine.core.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from server.app import build_app
from server.http_protocol import uvicorn_config
from server.settings import ServerSettings
from server.tracing import Tracing
from tests.helpers import chat_tokenizer, tiny_core, tiny_llama

_MODEL = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free now, below the kernel's range for outgoing
    connections (a port the kernel picks for one may be taken again before a server binds it,
    as may the ones after it)."""
    rng = random.Random()
    for _ in range(500):
        first = rng.randrange(20000, 32000 - count)
        if all(_bindable(first + offset) for offset in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports found")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    """Return once the server process at `url` answers /health with 200; fail the test with its
    output if it exits first, or kill it if it is not healthy within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            pytest.fail(f"{url} exited early:\n{output}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"{url} did not become healthy")


def server_process(
    *argv: str, timeout: float = 300, own_group: bool = False
) -> tuple[subprocess.Popen, str]:
    """`python -m server ARGV` (as `conveyor serve ARGV`) on a free port, its output piped;
    returns once /health answers 200. `own_group`: in a process group of its own, as a terminal
    starts it (Ctrl-C signals the whole group)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "--port", str(port), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=own_group,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, timeout=timeout)
    return process, url


def shared_tiny_model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_llama()
    return _MODEL


def tiny_engine(model: Any = None, **core_options: Any) -> AsyncEngine:
    options = {"tokenizer": chat_tokenizer(), **core_options}
    return AsyncEngine(*tiny_core(model or shared_tiny_model(), **options))


@asynccontextmanager
async def app_client(
    settings: ServerSettings | None = None, tracing: Tracing | None = None, **core_options: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncEngine]]:
    """An httpx client on the ASGI app (no socket); the engine loop runs meanwhile."""
    engine = tiny_engine(**core_options)
    app = build_app(engine, settings or ServerSettings(served_model_name="tiny"), tracing=tracing)
    await engine.start()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, engine
    finally:
        await engine.shutdown()


@asynccontextmanager
async def loaded_client(
    config: EngineConfig, settings: ServerSettings
) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncEngine]]:
    """As `app_client`, over an engine that loaded `config.model` as `conveyor serve` does."""
    engine = AsyncEngine.from_config(config)
    app = build_app(engine, settings)
    await engine.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, engine
    finally:
        await engine.shutdown()


@dataclass(slots=True)
class LiveServer:
    url: str
    engine: AsyncEngine
    app: FastAPI


@asynccontextmanager
async def live_server(
    settings: ServerSettings | None = None, tracing: Tracing | None = None, **core_options: Any
) -> AsyncIterator[LiveServer]:
    """The app under uvicorn on a free local port, in this event loop."""
    engine = tiny_engine(**core_options)
    settings = settings or ServerSettings(served_model_name="tiny")
    app = build_app(engine, settings, tracing=tracing)
    config = uvicorn_config(app, "127.0.0.1", 0, "warning", settings)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        scheme = "https" if settings.tls else "http"
        yield LiveServer(f"{scheme}://127.0.0.1:{port}", engine, app)
    finally:
        server.should_exit = True
        await task


def sse_events(body: str) -> list[Any]:
    """Parse a server-sent event stream strictly: `data: ...` blocks separated by blank lines."""
    assert body.endswith("\n\n"), "stream must end with a blank line"
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: "), f"bad event {block!r}"
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]", "stream must end with [DONE]"
    return events


def named_events(body: str) -> list[dict[str, Any]]:
    """Parse a stream of named events strictly (the Responses and Messages APIs): `event: TYPE`
    then `data: JSON` blocks, the data's type the event's name, and no `[DONE]`."""
    assert body.endswith("\n\n")
    events = []
    for block in body[:-2].split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == head[len("event: ") :]
        events.append(event)
    return events


def blocks_in_use(engine: AsyncEngine) -> int:
    return engine.core.scheduler.block_manager.num_used_blocks


async def until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `condition` while the event loop runs the server; fail after `timeout` seconds."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not reached in {timeout} s")


async def wait_until_idle(engine: AsyncEngine, timeout: float = 5.0) -> None:
    await until(
        lambda: blocks_in_use(engine) == 0 and not engine.core.has_unfinished(),
        timeout,
        "an idle engine with every KV block free",
    )
