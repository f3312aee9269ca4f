"""How much one hostile request slows everyone else: a victim's completion time alone, and that
of victims sent one after another while each hostile request runs (their median and the
slowest), with the slowest /health answer meanwhile, against a live server on a tiny
random-weight model (the costs measured are the server's own: parsing, validation, tokenizing,
stop-string matching; curl sends the hostile bodies from its own process).

    PYTHONPATH=. python benchmarks/hostile_latency.py [only the cases whose name has this]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from server.lifecycle import freeze_heap
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
    "an 8 MB prompt (under the body limit, too long)": {
        "prompt": "hello " * 1_390_000,
        "max_tokens": 1,
    },
    "a 2,500-char prompt (tokenized, then too long)": {"prompt": "hi " * 833, "max_tokens": 1},
    "4,000 prompts": {"prompt": ["Hi"] * 4_000, "max_tokens": 1},
    "1,000 prompts (allowed)": {"prompt": ["Hi"] * 1_000, "max_tokens": 1},
    "1,000 prompts streamed, 16 tokens each (allowed)": {
        "prompt": ["Hi"] * 1_000,
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
    },
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


async def send_with_curl(url: str, payload: Path) -> int:
    """The hostile request from another process (curl), so that writing its body costs this
    process nothing: what the victim sees is the server's cost alone."""
    curl = await asyncio.create_subprocess_exec(
        "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
        "-H", "content-type: application/json", "--data-binary", f"@{payload}",
        f"{url}/v1/completions",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await curl.communicate()
    return int(out or 0)


async def main(repeats: int = 3, only: str = "") -> None:
    victim = json.dumps(VICTIM).encode()
    folder = Path(tempfile.mkdtemp(prefix="hostile-"))
    async with (
        live_server() as server,
        httpx.AsyncClient(base_url=server.url, timeout=600) as client,
    ):
        freeze_heap()  # as `conveyor serve` does once the model is loaded
        alone = statistics.median([(await timed(client, victim))[0] for _ in range(9)])
        print(
            f"victim alone: {alone * 1000:.0f} ms (median of 9); beside: the median and the "
            f"slowest of the victims sent one after another while the request runs ({repeats} runs)"
        )
        print(
            f"{'hostile request':55} {'status':>6} {'victim':>8} {'ratio':>6} {'slowest':>8}"
            f" {'/health max':>12}"
        )
        for index, (name, body) in enumerate(HOSTILE.items()):
            if only not in name:
                continue
            payload = folder / f"{index}.json"
            payload.write_bytes(json.dumps(body).encode())
            besides: list[float] = []
            worst, status = 0.0, 0
            for _ in range(repeats):
                stop = asyncio.Event()
                probe = asyncio.create_task(health_worst(client, stop))
                hostile = asyncio.create_task(send_with_curl(server.url, payload))
                besides.append((await timed(client, victim))[0])
                while not hostile.done():
                    besides.append((await timed(client, victim))[0])
                status = await hostile
                stop.set()
                worst = max(worst, await probe)
            beside = statistics.median(besides)
            print(
                f"{name:55} {status:>6} {beside * 1000:6.0f}ms {beside / alone:6.2f} "
                f"{max(besides) * 1000:6.0f}ms {worst * 1000:10.0f}ms"
            )


if __name__ == "__main__":
    asyncio.run(main(only=sys.argv[1] if len(sys.argv) > 1 else ""))
