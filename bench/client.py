"""Streaming requests to any OpenAI-compatible server, timed the way `vllm bench serve` times
them.

The client shares the machine with the server it loads, so it reads the stream with aiohttp (a
C-accelerated HTTP parser) and splits the events itself: about a third of the CPU time per
streamed token that httpx's line iterator took, time that the server gets back.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from bench.workloads import BenchRequest


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    status: int = 0
    finish_reason: str | None = None
    priority: int = 0
    # When it was sent, in seconds from the start of the run.
    start: float = 0.0

    @property
    def timed_out(self) -> bool:
        return self.status == 504 or self.finish_reason == "timeout"

    @property
    def rejected(self) -> bool:
        return self.status in (429, 503)

    def token_times(self) -> list[float]:
        """When each streamed piece arrived, from the start of the run."""
        times = [self.start + self.ttft] if self.ttft else []
        for gap in self.itls:
            times.append(times[-1] + gap)
        return times

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


def request_body(
    request: BenchRequest,
    endpoint: str,
    model: str,
    ignore_eos: bool,
    temperature: float,
    timeout: float | None = None,
) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": request.output_len,
        "stream": True,
        "temperature": temperature,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if request.priority:
        body["priority"] = request.priority
    if timeout is not None:
        body["timeout"] = timeout
    if request.response_format is not None:
        body["response_format"] = request.response_format
    if endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def sse_data(pieces: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream arriving in pieces cut anywhere, as
    soon as each line is whole, however long."""
    pending = bytearray()
    async for piece in pieces:
        pending += piece
        if b"\n" not in piece:
            continue
        *lines, rest = pending.split(b"\n")
        pending = bytearray(rest)
        for line in lines:
            if line.startswith(b"data: "):
                yield line[6:].rstrip(b"\r").decode()
    if pending.startswith(b"data: "):
        yield pending[6:].rstrip(b"\r").decode()


async def send(
    session: aiohttp.ClientSession, url: str, body: dict, prompt_len: int
) -> RequestResult:
    """Stream one request to `url`; the first chunk with text marks the first token."""
    result = RequestResult(ok=False, prompt_len=prompt_len, priority=body.get("priority", 0))
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(url, json=body) as response:
            result.status = response.status
            if response.status != 200:
                result.e2e = time.perf_counter() - start
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for data in sse_data(response.content.iter_any()):
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    result.e2e = time.perf_counter() - start
                    return result
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if _chunk_text(chunk) or (chunk.get("choices") and chunks == 0):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    chunks += 1
                    last = now
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_len = result.output_len or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens received"
    return result
