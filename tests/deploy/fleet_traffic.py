"""Traffic for a fleet: shared-prefix groups (what cache-aware routing is for) and a steady run
of plain and streamed requests whose every outcome is counted."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.helpers import CORPUS, chat_tokenizer

WORDS = sorted({word for line in CORPUS for word in line.split()})


def shared_prefix_prompts(
    groups: int, prefix_tokens: int, per_group: int, seed: int = 0, tokenizer: Any = None
) -> list[str]:
    """`per_group` prompts for each of `groups` prefixes of about `prefix_tokens` tokens (of
    `tokenizer`, the tiny one by default), each with its own short question, in a shuffled
    order (no policy gets affinity by accident)."""
    rng = random.Random(seed)
    tokenizer = tokenizer or chat_tokenizer()
    prompts = []
    for group in range(groups):
        words = [f"document {group}:"]
        while len(tokenizer(" ".join(words))["input_ids"]) < prefix_tokens:
            words.extend(rng.choice(WORDS) for _ in range(16))
        prefix = " ".join(words)
        prompts += [
            f"{prefix}\nquestion {group}.{i}: {rng.choice(WORDS)}?" for i in range(per_group)
        ]
    rng.shuffle(prompts)
    return prompts


async def time_to_first_token(
    client: httpx.AsyncClient, url: str, prompt: str, model: str = "tiny"
) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}
    start = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
        assert first is not None
        return first


async def ttft_p50(url: str, prompts: list[str], concurrency: int, model: str = "tiny") -> float:
    """Send `prompts` through `url`, `concurrency` at a time; the median time to first token."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(prompt: str) -> float:
            async with gate:
                return await time_to_first_token(client, url, prompt, model)

        return statistics.median(await asyncio.gather(*(one(p) for p in prompts)))


@dataclass
class Outcomes:
    """What happened to each request of a run."""

    ok: int = 0
    failed: list[str] = field(default_factory=list)  # non-streamed requests that failed
    cut_streams: list[str] = field(default_factory=list)  # streams that ended with an error
    hung: int = 0

    @property
    def done(self) -> int:
        return self.ok + len(self.failed) + len(self.cut_streams) + self.hung


def _request(i: int, stream: bool) -> dict:
    """Prompts that share no prefix, so a cache-aware router balances them by load."""
    prompt = f"{i} {WORDS[i % len(WORDS)]} {WORDS[i * 7 % len(WORDS)]}:"
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": stream,
    }


async def _plain(client: httpx.AsyncClient, url: str, i: int, out: Outcomes) -> None:
    body = _request(i, stream=False)
    try:
        response = await client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError as exc:
        out.failed.append(f"{i}: {type(exc).__name__} {exc}")
        return
    if response.status_code == 200 and len(response.json()["choices"][0]["text"]) > 0:
        out.ok += 1
    else:
        out.failed.append(f"{i}: {response.status_code} {response.text[:200]}")


async def _streamed(client: httpx.AsyncClient, url: str, i: int, out: Outcomes) -> None:
    """A stream either ends with `[DONE]` after its chunks, or carries an error (a status, an
    error event, or a connection closed before `[DONE]`) that the client can see."""
    body = _request(i, stream=True)
    events: list[str] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.cut_streams.append(f"{i}: status {response.status_code}")
                return
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
    except httpx.HTTPError as exc:
        out.cut_streams.append(f"{i}: {type(exc).__name__} after {len(events)} events")
        return
    if events and events[-1] == "[DONE]" and not any('"error"' in e for e in events):
        out.ok += 1
    elif any("error" in json.loads(e) for e in events if e != "[DONE]"):
        out.cut_streams.append(f"{i}: error event")
    else:
        out.cut_streams.append(f"{i}: ended without [DONE] after {len(events)} events")


async def steady_run(
    url: str,
    count: int,
    concurrency: int,
    on_progress: Callable[[Outcomes], None] | None = None,
    streamed_every: int = 4,
    keep_going: Callable[[], bool] = lambda: False,
    timeout: float = 120,
) -> Outcomes:
    """At least `count` requests through `url`, `concurrency` at a time, and more while
    `keep_going()`; every `streamed_every`-th is streamed. `on_progress` sees the tally after
    each."""
    out = Outcomes()
    sent = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10)) as client:

        async def worker() -> None:
            nonlocal sent
            while sent < count or keep_going():
                i, sent = sent, sent + 1
                send = _streamed if i % streamed_every == 0 else _plain
                try:
                    await asyncio.wait_for(send(client, url, i, out), timeout)
                except TimeoutError:
                    out.hung += 1
                if on_progress is not None:
                    on_progress(out)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out
