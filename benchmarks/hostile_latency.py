"""How much one hostile request slows everyone else: a victim's completion time alone and beside
each hostile request, and the slowest /health answer meanwhile, against a live server on a tiny
random-weight model (the costs measured are the server's own: parsing, validation, tokenizing,
stop-string matching).

    PYTHONPATH=. python benchmarks/hostile_latency.py
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from tests.server_utils import live_server

VICTIM = {"prompt": "Story:", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
HOSTILE: dict[str, dict[str, Any]] = {
    "10,000 stop strings of 3,000 chars (30 MB)": {
        "prompt": "Hi",
        "max_tokens": 4,
        "stop": ["x" * 3000] * 10_000,
    },
    "2,000 stop strings of 3,000 chars": {
        "prompt": "Hi",
        "max_tokens": 4,
        "stop": ["x" * 3000] * 2_000,
    },
    "200 tokens, no stop strings (a plain neighbour)": {
        "prompt": "Hi",
        "max_tokens": 200,
        "ignore_eos": True,
    },
    "64 stop strings of 1,024 chars, 200 tokens (allowed)": {
        "prompt": "Hi",
        "max_tokens": 200,
        "ignore_eos": True,
        "stop": [f"{i:04d}" + "x" * 1020 for i in range(64)],
    },
    "a 30 MB prompt": {"prompt": "hello " * 5_000_000, "max_tokens": 1},
    "a 2,500-char prompt (tokenized, then too long)": {"prompt": "hi " * 833, "max_tokens": 1},
    "4,000 prompts": {"prompt": ["Hi"] * 4_000, "max_tokens": 1},
    "1,000 prompts (allowed)": {"prompt": ["Hi"] * 1_000, "max_tokens": 1},
}


async def timed(client: httpx.AsyncClient, body: bytes) -> tuple[float, int]:
    start = time.perf_counter()
    reply = await client.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    return time.perf_counter() - start, reply.status_code


async def health_worst(client: httpx.AsyncClient, stop: asyncio.Event) -> float:
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        await client.get("/health")
        worst = max(worst, time.perf_counter() - start)
        await asyncio.sleep(0.01)
    return worst


async def main() -> None:
    victim = json.dumps(VICTIM).encode()
    async with (
        live_server() as server,
        httpx.AsyncClient(base_url=server.url, timeout=600) as client,
    ):
        alone = statistics.median([(await timed(client, victim))[0] for _ in range(5)])
        print(f"victim alone: {alone * 1000:.0f} ms")
        print(
            f"{'hostile request':55} {'status':>6} {'victim':>8} {'ratio':>6} {'/health max':>12}"
        )
        for name, body in HOSTILE.items():
            payload = json.dumps(body).encode()
            stop = asyncio.Event()
            probe = asyncio.create_task(health_worst(client, stop))
            hostile = asyncio.create_task(timed(client, payload))
            await asyncio.sleep(0)
            beside, _ = await timed(client, victim)
            _, status = await hostile
            stop.set()
            worst = await probe
            print(
                f"{name:55} {status:>6} {beside * 1000:6.0f}ms {beside / alone:6.2f} "
                f"{worst * 1000:10.0f}ms"
            )


if __name__ == "__main__":
    asyncio.run(main())
