"""Streaming requests to any OpenAI-compatible server, timed the way `vllm bench serve` times
them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

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

    @property
    def timed_out(self) -> bool:
        return self.status == 504 or self.finish_reason == "timeout"

    @property
    def rejected(self) -> bool:
        return self.status in (429, 503)

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


def request_body(request: BenchRequest, endpoint: str, model: str, ignore_eos: bool,
                 temperature: float, timeout: float | None = None) -> dict:
    body: dict = {"model": model, "max_tokens": request.output_len, "stream": True,
                  "temperature": temperature, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if request.priority:
        body["priority"] = request.priority
    if timeout is not None:
        body["timeout"] = timeout
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


async def send(client: httpx.AsyncClient, endpoint: str, body: dict,
               prompt_len: int) -> RequestResult:
    """Stream one request; the first chunk with text marks the first token."""
    result = RequestResult(ok=False, prompt_len=prompt_len, priority=body.get("priority", 0))
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.e2e = time.perf_counter() - start
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
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
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_len = result.output_len or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens received"
    return result
