"""A request's head (its line and headers) is bounded in size and in time, on a real socket:
oversized heads get a 431, slow or missing ones are cut off, and ordinary requests on a
kept-alive connection are untouched."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import httpx

from server.settings import ServerSettings
from tests.server_utils import live_server

SETTINGS = ServerSettings(served_model_name="tiny", max_head_bytes=4096, head_timeout=0.5)
GET_HEALTH = b"GET /health HTTP/1.1\r\nhost: test\r\n\r\n"


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    return await asyncio.open_connection(parts.hostname, parts.port)


async def response_and_close(reader: asyncio.StreamReader) -> tuple[int | None, bytes]:
    """The status and body of what the server sends before closing (None: closed silently)."""
    data = await asyncio.wait_for(reader.read(), timeout=5)
    if not data:
        return None, b""
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def healthy(url: str) -> bool:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{url}/health")).status_code == 200


async def test_an_oversized_head_gets_a_431_before_it_is_buffered():
    async with live_server(SETTINGS) as server:
        reader, writer = await connect(server.url)
        writer.write(b"GET /health HTTP/1.1\r\nhost: test\r\nx-big: " + b"a" * 8192)
        status, body = await response_and_close(reader)
        writer.close()
        assert status == 431
        assert "over 4096 bytes" in json.loads(body)["error"]["message"]
        assert await healthy(server.url)


async def trickle(writer: asyncio.StreamWriter) -> None:
    """A byte every 0.1 s, never a whole head."""
    try:
        while True:
            await asyncio.sleep(0.1)
            writer.write(b"x")
            await writer.drain()
    except ConnectionError:
        pass


async def test_a_head_that_trickles_in_is_cut_off_with_a_408():
    async with live_server(SETTINGS) as server:
        reader, writer = await connect(server.url)
        writer.write(b"GET /health HTTP/1.1\r\n")
        slow = asyncio.create_task(trickle(writer))
        status, body = await response_and_close(reader)
        slow.cancel()
        writer.close()
        assert status == 408
        # The head timeout's own answer (the trickle alone would never end the head).
        assert "did not arrive" in json.loads(body)["error"]["message"]
        assert await healthy(server.url)


async def test_a_connection_that_sends_nothing_is_closed():
    async with live_server(SETTINGS) as server:
        reader, writer = await connect(server.url)
        status, _ = await response_and_close(reader)
        writer.close()
        assert status is None


async def test_requests_on_a_kept_alive_connection_are_untouched():
    """A head under the limit passes however long the response takes, and the next request on
    the same connection gets a fresh allowance of time and bytes."""
    settings = ServerSettings(served_model_name="tiny", max_head_bytes=4096, head_timeout=1.0)
    async with live_server(settings) as server:
        reader, writer = await connect(server.url)
        for _ in range(3):
            writer.write(
                GET_HEALTH.replace(b"\r\n\r\n", b"\r\nx-pad: " + b"p" * 3000 + b"\r\n\r\n")
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            assert head.startswith(b"HTTP/1.1 200")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            await asyncio.sleep(0.6)  # within the head timeout, which the three together are not
        writer.close()


async def test_a_large_body_is_not_counted_as_head():
    """The body often arrives in the same read as the head: it does not count against the
    head's limit, on a fresh connection or a kept-alive one."""
    body = {"model": "tiny", "prompt": "hello " * 100_000, "max_tokens": 1}
    async with live_server(SETTINGS) as server, httpx.AsyncClient() as client:
        for _ in range(2):
            response = await client.post(f"{server.url}/v1/completions", json=body)
            assert response.status_code == 400  # the prompt is past the context
            assert "maximum context length" in response.json()["error"]["message"]


async def test_a_head_of_too_many_headers_gets_a_431_and_its_app_never_runs():
    """Past `max_head_count` header lines (vLLM's h11 limit, 256 by default) the request is
    refused whole, even where the lines are short; at the limit, and on the next request of a
    kept-alive connection, it is served."""
    settings = ServerSettings(served_model_name="tiny", max_head_count=8)
    lines = [b"x-h%d: v" % i for i in range(8)]  # with `host`: 9
    async with live_server(settings) as server:
        reader, writer = await connect(server.url)
        writer.write(b"\r\n".join([b"POST /v1/completions HTTP/1.1", b"host: t", *lines]))
        writer.write(b"\r\ncontent-length: 2\r\n\r\n{}")
        status, body = await response_and_close(reader)
        writer.close()
        assert status == 431
        assert "more than 8 headers" in json.loads(body)["error"]["message"]
        reader, writer = await connect(server.url)
        for _ in range(2):
            writer.write(
                b"\r\n".join([b"GET /health HTTP/1.1", b"host: t", *lines[:7]]) + b"\r\n\r\n"
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            assert head.startswith(b"HTTP/1.1 200")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.close()
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{server.url}/metrics")).text
        assert 'handler="/v1/completions"' not in metrics  # the refused request reached nothing
