"""`conveyor bench serve`: load any OpenAI-compatible server and report like `vllm bench serve`."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import RequestResult, request_body, send
from bench.report import overload, parse_slo, summarize, table
from bench.workloads import (
    BenchRequest,
    as_text,
    random_workload,
    shared_prefix_workload,
    token_pool,
    trace_workload,
    with_json_schema,
    with_priorities,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="folder or hub id used to draw prompts (default: the embedded model)",
    )
    parser.add_argument("--dataset", default="random", choices=["random", "trace", "shared-prefix"])
    parser.add_argument("--trace", type=Path, default=None, help="JSONL trace for --dataset trace")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--shared-prefix-len", type=int, default=1024)
    parser.add_argument("--shared-suffix-len", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default: all at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="with --request-rate: shape of the gamma-distributed gaps between "
        "arrivals; 1 is Poisson, below 1 burstier, above 1 steadier",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="with --request-rate: send rate x duration requests",
    )
    parser.add_argument(
        "--priority-mix",
        type=float,
        default=0.0,
        help="share of high-priority (0) requests; the rest get priority 1",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="per-request deadline in seconds (the request field timeout)",
    )
    parser.add_argument(
        "--json-schema",
        choices=["none", "repeated", "fresh"],
        default="none",
        help="ask for a JSON object holding one string (response_format json_schema): the same "
        "schema for every request, or a fresh one per request (each compiled anew)",
    )
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--slo",
        nargs="*",
        default=[],
        help="goodput limits in ms, e.g. ttft:500 tpot:50 e2el:10000",
    )
    parser.add_argument("--percentiles", default="50,90,99")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the server over the run (POST /start_profile before, /stop_profile "
        "after; the server needs --profiler-config)",
    )


def load_tokenizer(name: str | None):
    from transformers import AutoTokenizer

    if name is None:
        from engine.loading.default_model import ensure_default_model

        name = str(ensure_default_model())
    return AutoTokenizer.from_pretrained(name)


def build_workload(args: argparse.Namespace, tokenizer) -> list[BenchRequest]:
    pool = token_pool(tokenizer)
    if args.dataset == "trace":
        if args.trace is None:
            raise SystemExit("--dataset trace needs --trace FILE")
        requests = trace_workload(
            args.trace, pool, args.seed, lambda text: len(tokenizer(text)["input_ids"])
        )
    elif args.dataset == "shared-prefix":
        requests = shared_prefix_workload(
            args.num_prompts,
            args.shared_prefix_len,
            args.shared_suffix_len,
            args.random_output_len,
            pool,
            args.seed,
        )
    else:
        count = args.num_prompts
        if args.duration is not None and args.request_rate != float("inf"):
            count = max(1, round(args.request_rate * args.duration))
        requests = random_workload(
            count,
            args.random_input_len,
            args.random_output_len,
            pool,
            args.seed,
            args.random_range_ratio,
        )
    if args.priority_mix > 0:
        requests = with_priorities(requests, args.priority_mix, args.seed)
    if args.json_schema != "none":
        requests = with_json_schema(requests, fresh=args.json_schema == "fresh")
    if args.endpoint.endswith("/chat/completions"):
        requests = as_text(requests, tokenizer)
    return requests


async def _model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


def arrival_delays(
    requests: list[BenchRequest], rate: float, seed: int, burstiness: float = 1.0
) -> list[float]:
    """Seconds from the start at which each request is sent: a trace's own times, all at once
    at an infinite rate, else gaps drawn from a gamma distribution of shape `burstiness` and
    mean 1 / rate (exponential, so Poisson arrivals, at a burstiness of 1)."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if all(r.arrival is not None for r in requests):
        return [r.arrival or 0.0 for r in requests]
    if rate == float("inf"):
        return [0.0] * len(requests)
    rng = random.Random(seed)
    delays, now = [], 0.0
    for _ in requests:
        delays.append(now)
        if burstiness == 1.0:
            now += rng.expovariate(rate)
        else:
            now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return delays


async def run_load(
    args: argparse.Namespace, requests: list[BenchRequest], progress: bool = True
) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No connection limit and no deadline: --max-concurrency shapes the load, --timeout is the
    # server's business. A connection per request, as vLLM's benchmark opens: servers that close
    # a kept-alive connection after a few requests (llama.cpp's, after 5) would otherwise fail
    # the request sent on it as it closes.
    base_url = args.base_url.rstrip("/")
    session = aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=None),
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
    )
    async with session:
        model = args.model or await _model_name(session, base_url)
        gate = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
        delays = arrival_delays(requests, args.request_rate, args.seed, args.burstiness)
        bar = _progress(len(requests), progress)
        if args.profile:
            await _profile(session, base_url, "start")
        start = time.perf_counter()

        async def one(request: BenchRequest, delay: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            async with gate:
                body = request_body(
                    request, args.endpoint, model, args.ignore_eos, args.temperature, args.timeout
                )
                sent = time.perf_counter() - start
                result = await send(session, base_url + args.endpoint, body, request.prompt_len)
                result.start = sent
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, d) for r, d in zip(requests, delays, strict=True)))
        duration = time.perf_counter() - start
        bar.close()
        if args.profile:
            files = (await _profile(session, base_url, "stop")).get("files", [])
            print(f"profile: {', '.join(files) or 'saved by the server'}", file=sys.stderr)
    return list(results), duration


async def _profile(session: aiohttp.ClientSession, base_url: str, action: str) -> dict[str, Any]:
    """`POST /{action}_profile`; its JSON answer (vLLM's is empty)."""
    async with session.post(f"{base_url}/{action}_profile") as response:
        text = await response.text()
        if response.status != 200:
            raise SystemExit(f"/{action}_profile answered {response.status}: {text}")
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, file=sys.stderr, desc="requests")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (it comes with uvicorn[standard]): the client
    shares the machine with the server it loads, and spends less CPU time per streamed token
    on it."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(args: argparse.Namespace) -> int:
    if args.burstiness <= 0:
        raise SystemExit(f"--burstiness must be positive, got {args.burstiness}")
    slo = parse_slo(args.slo)
    tokenizer = load_tokenizer(args.tokenizer)
    requests = build_workload(args, tokenizer)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        results, duration = runner.run(run_load(args, requests))
    percentiles = [int(p) for p in args.percentiles.split(",") if p]
    summary = summarize(results, duration, percentiles, slo)
    if args.priority_mix > 0 or args.timeout is not None:
        summary["overload"] = overload(results, duration, percentiles)
    summary.update(
        {
            "endpoint": args.endpoint,
            "dataset": args.dataset,
            "max_concurrency": args.max_concurrency,
            "request_rate": args.request_rate,
            "burstiness": args.burstiness,
            "num_prompts": len(requests),
        }
    )
    print(table(summary))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    failures_expected = args.timeout is not None or args.priority_mix > 0
    return 0 if summary["failed"] == 0 or failures_expected else 1
