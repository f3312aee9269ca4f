"""CPU time the server's own Python spends on each streamed token: `--concurrency` streaming
completions through the real app (routes, middleware, renderers, metrics, the engine loop's
dispatch), called in-process as ASGI, over a stand-in engine core that emits one token per
request per step at no cost. Sockets and HTTP parsing are left out; so is the model.

    python benchmarks/streaming_overhead.py --concurrency 64 --tokens 256 --rounds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from concurrent.futures import Executor, Future
from contextlib import asynccontextmanager
from typing import Any

from engine.core.async_engine import AsyncEngine
from engine.core.config import ServingInfo
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.stats import StepStats
from server.app import build_app


class OneTokenCore:
    """What `AsyncEngine` uses of `EngineCore`: every step gives each request one token."""

    max_tokens = 1 << 20
    tokenizer = None
    processor = None  # a text model
    loras = None  # no LoRA adapters
    profiler = None  # no profiles on demand

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, *extras: Any) -> None:
        pass

    def drop_retired(self) -> None:
        pass

    def admit(self, *args: Any) -> bool:
        return False

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **options: Any
    ) -> None:
        self.requests[request_id] = [0, params.max_tokens or 16]

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
        return []

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        return []

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def watch(self, on_failure: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def take_stats(self) -> StepStats:
        stats = StepStats(len(self.requests), 0, 0.0)
        stats.num_generation_tokens = len(self.requests)
        stats.inter_token_latencies = [0.02] * len(self.requests)
        return stats

    def step(self) -> list[RequestOutput]:
        outputs = []
        for request_id, progress in list(self.requests.items()):
            progress[0] += 1
            done = progress[0] >= progress[1]
            outputs.append(
                RequestOutput(
                    request_id,
                    0,
                    [7],
                    " a",
                    finished=done,
                    finish_reason="length" if done else None,
                    num_prompt_tokens=16,
                    num_output_tokens=progress[0],
                )
            )
            if done:
                del self.requests[request_id]
        return outputs


class InlineExecutor(Executor):
    """Runs each step on the calling thread, so one thread's CPU time holds everything."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


async def stream_one(app: Any, tokens: int) -> int:
    """One streaming completion; returns the bytes of its events."""
    body = json.dumps({"prompt": [5] * 16, "max_tokens": tokens, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    requested = False
    never = asyncio.Event()
    received = 0

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal received
        received += len(message.get("body", b""))

    await app(scope, receive, send)
    return received


@asynccontextmanager
async def stand_in_app() -> AsyncIterator[Any]:
    """The real app over `OneTokenCore`, its engine loop running on the calling thread."""
    info = ServingInfo(
        model_name="stand-in",
        max_model_len=1 << 20,
        dtype="bfloat16",
        device="cpu",
        num_blocks=1,
        block_size=16,
    )
    engine = AsyncEngine(OneTokenCore(), info, InlineExecutor())  # type: ignore[arg-type]
    app = build_app(engine)
    await engine.start()
    try:
        yield app
    finally:
        await engine.shutdown()


async def measure(concurrency: int, tokens: int, rounds: int) -> list[float]:
    per_token_us = []
    async with stand_in_app() as app:
        for _ in range(rounds):
            start = time.thread_time()
            sizes = await asyncio.gather(*(stream_one(app, tokens) for _ in range(concurrency)))
            if not all(sizes):
                raise RuntimeError("a stream came back empty")
            per_token_us.append((time.thread_time() - start) / (concurrency * tokens) * 1e6)
    return per_token_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    per_token = runner(measure(args.concurrency, args.tokens, args.rounds))
    print(
        json.dumps(
            {
                "concurrency": args.concurrency,
                "tokens": args.tokens,
                "us_per_token_min": round(min(per_token), 2),
                "us_per_token_median": round(statistics.median(per_token), 2),
                "rounds": [round(x, 2) for x in per_token],
            }
        )
    )


if __name__ == "__main__":
    main()
