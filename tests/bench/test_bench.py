"""The benchmark tools: workloads, the report, a live load run and the offline comparison."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench import offline
from bench.client import RequestResult, sse_data
from bench.report import (
    overload,
    parse_slo,
    peak_concurrency,
    percentile,
    summarize,
    table,
)
from bench.serve import arrival_delays, run_load
from bench.workloads import (
    random_workload,
    shared_prefix_workload,
    trace_workload,
    with_json_schema,
    with_priorities,
)
from engine.core.profiling import ProfilerConfig
from tests.helpers import tiny_llama, tiny_tokenizer
from tests.server_utils import live_server, wait_until_idle

ROOT = Path(__file__).resolve().parents[2]
POOL = list(range(10, 300))


def test_percentile_matches_numpy():
    rng = random.Random(0)
    values = [rng.random() for _ in range(101)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_random_workload_lengths_and_fresh_prompts():
    first = random_workload(50, 100, 40, POOL, seed=1, range_ratio=0.2)
    again = random_workload(50, 100, 40, POOL, seed=1, range_ratio=0.2)
    other = random_workload(50, 100, 40, POOL, seed=2, range_ratio=0.2)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert all(80 <= r.prompt_len == len(r.prompt) <= 120 for r in first)
    assert all(32 <= r.output_len <= 48 for r in first)
    assert len({r.prompt_len for r in first}) > 1


def test_shared_prefix_workload_shares_exactly_the_prefix():
    requests = shared_prefix_workload(8, 64, 8, 16, POOL, seed=3)
    prefixes = {tuple(r.prompt[:64]) for r in requests}
    assert len(prefixes) == 1
    assert len({tuple(r.prompt[64:]) for r in requests}) == 8
    assert all(r.prompt_len == 72 for r in requests)


def test_sample_trace_replays_in_time_order():
    requests = trace_workload(ROOT / "benchmarks" / "sample_trace.jsonl", POOL, seed=0)
    arrivals = [r.arrival for r in requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and len(requests) == 40
    assert any(isinstance(r.prompt, str) for r in requests)


def test_report_throughput_latencies_and_goodput():
    results = [
        RequestResult(True, 10, output_len=11, ttft=0.1, e2e=1.1, itls=[0.1] * 10),
        RequestResult(True, 10, output_len=11, ttft=0.5, e2e=2.5, itls=[0.2] * 10),
        RequestResult(False, 10, error="HTTP 500"),
    ]
    summary = summarize(
        results, duration=2.0, percentiles=[50], slo=parse_slo(["ttft:200", "tpot:150"])
    )
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["output_throughput"] == 11.0
    assert summary["mean_ttft_ms"] == pytest.approx(300)
    assert summary["p50_tpot_ms"] == pytest.approx(150)
    assert summary["goodput"] == 0.5  # only the first meets both limits
    assert summary["errors"] == ["HTTP 500"]
    with pytest.raises(ValueError):
        parse_slo(["latency:5"])


def test_report_peak_output_throughput_and_concurrency():
    # Sent at 0.0, 0.5 and 1.0 s: pieces at 0.25, 0.5, ..., 2.25 s; at 0.75, 1.25, 1.75 s (its
    # last piece holding two tokens); and a failure from 1.0 to 1.2 s.
    results = [
        RequestResult(True, 4, output_len=9, ttft=0.25, e2e=2.25, itls=[0.25] * 8),
        RequestResult(True, 4, output_len=4, ttft=0.25, e2e=1.25, itls=[0.5, 0.5], start=0.5),
        RequestResult(False, 4, e2e=0.2, error="HTTP 500", start=1.0),
        RequestResult(False, 4, error="refused", start=1.0),
    ]
    first, second = (r.token_times() for r in results[:2])
    assert first == [0.25 * k for k in range(1, 10)]
    assert second == [0.75, 1.25, 1.75]
    # Second 0 holds 3 + 1 tokens, second 1 holds 4 + 1 + 2, second 2 holds 2.
    assert summarize(results, 2.5, [50], {})["peak_output_throughput"] == 7.0
    # All three spans overlap from 1.0 to 1.2 s; the failure with no span counts for none.
    assert summarize(results, 2.5, [50], {})["peak_concurrent_requests"] == 3
    back_to_back = [
        RequestResult(True, 4, output_len=1, ttft=0.1, e2e=1.0, start=s) for s in (0.0, 1.0, 2.0)
    ]
    assert summarize(back_to_back, 3.0, [50], {})["peak_concurrent_requests"] == 1
    assert "Peak concurrent requests" in table(summarize(back_to_back, 3.0, [50], {}))


async def test_sse_data_joins_events_cut_anywhere():
    events = [
        b'data: {"a": 1}\n\n',
        b"data: " + b"x" * 200_000 + b"\r\n\n",
        b": ping\n\n",
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)

    async def pieces(size: int):
        for i in range(0, len(stream), size):
            yield stream[i : i + size]

    for size in (1, 7, 4096, len(stream)):
        assert [d async for d in sse_data(pieces(size))] == ['{"a": 1}', "x" * 200_000, "[DONE]"]


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_the_rate_and_the_burstiness(burstiness):
    """Gaps between arrivals are gamma-distributed with shape `burstiness` and mean 1 / rate,
    so their coefficient of variation is 1 / sqrt(burstiness): 2 (bursty), 1 (Poisson), 0.5."""
    requests = random_workload(20_000, 4, 4, POOL, seed=0)
    delays = arrival_delays(requests, 8.0, seed=7, burstiness=burstiness)
    gaps = np.diff(delays)
    assert delays[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness**-0.5, rel=0.1)
    assert arrival_delays(requests, 8.0, seed=7, burstiness=burstiness) == delays


def test_arrivals_without_a_rate_or_from_a_trace_ignore_burstiness():
    requests = random_workload(5, 4, 4, POOL, seed=0)
    assert arrival_delays(requests, math.inf, seed=0, burstiness=0.1) == [0.0] * 5
    trace = trace_workload(ROOT / "benchmarks" / "sample_trace.jsonl", POOL, seed=0)
    assert arrival_delays(trace, 2.0, seed=0, burstiness=0.1) == [r.arrival for r in trace]
    with pytest.raises(ValueError, match="burstiness must be positive"):
        arrival_delays(requests, 2.0, seed=0, burstiness=0.0)


def load_args(**overrides) -> argparse.Namespace:
    defaults = dict(
        base_url="",
        endpoint="/v1/completions",
        model=None,
        api_key=None,
        max_concurrency=None,
        request_rate=math.inf,
        burstiness=1.0,
        seed=0,
        ignore_eos=True,
        temperature=0.0,
        timeout=None,
        profile=False,
    )
    return argparse.Namespace(**{**defaults, **overrides})


@pytest.mark.parametrize(
    "shape",
    [{"max_concurrency": 3}, {"request_rate": 50.0}, {"request_rate": 50.0, "burstiness": 0.3}],
)
async def test_load_run_against_a_live_server(shape):
    requests = random_workload(9, 12, 6, POOL, seed=4, range_ratio=0.5)
    async with live_server() as server:
        args = load_args(base_url=server.url, **shape)
        results, duration = await run_load(args, requests, progress=False)
        await wait_until_idle(server.engine)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [r.output_len for r in requests]
    for result in results:
        assert 0 < result.ttft <= result.e2e <= duration
        assert 0 <= result.start <= result.start + result.e2e <= duration
        assert len(result.itls) <= result.output_len - 1
    assert 1 <= peak_concurrency(results) <= shape.get("max_concurrency", len(requests))


async def test_a_profiled_run_leaves_the_servers_trace(tmp_path, capsys):
    requests = random_workload(3, 12, 4, POOL, seed=4)
    traces = ProfilerConfig("torch", str(tmp_path), torch_profiler_with_stack=False)
    async with live_server(profiler=traces) as server:
        args = load_args(base_url=server.url, profile=True)
        results, _ = await run_load(args, requests, progress=False)
        # The profile ended with the run: another stop finds none running.
        async with httpx.AsyncClient() as client:
            assert (await client.post(f"{server.url}/stop_profile")).status_code == 400
    assert all(r.ok for r in results)
    [trace] = tmp_path.glob("*.pt.trace.json.gz")
    assert str(trace) in capsys.readouterr().err


async def test_load_survives_a_server_that_closes_kept_alive_connections():
    """A server that answers one request per connection and drops the connection when a second
    one arrives on it (llama.cpp's server closes after 5): every request still gets through."""
    reply = (
        b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
        b'data: {"choices": [{"text": "b", "finish_reason": "length"}], '
        b'"usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n'
    )

    async def one_request_per_connection(reader, writer) -> None:
        served = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length")
            )
            await reader.readexactly(length)
            if served:  # a second request on a kept-alive connection: dropped unanswered
                writer.close()
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(reply), reply)
            )
            await writer.drain()
            served += 1

    server = await asyncio.start_server(one_request_per_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        requests = random_workload(6, 8, 2, POOL, seed=6)
        args = load_args(base_url=f"http://127.0.0.1:{port}", model="m", max_concurrency=1)
        results, _ = await run_load(args, requests, progress=False)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [2] * 6


def test_load_runs_on_uvloop_where_installed():
    """The client shares the machine with the server it loads: it takes uvloop's lighter loop."""
    import uvloop

    from bench.serve import _loop_factory

    assert _loop_factory() is uvloop.new_event_loop


async def test_chat_endpoint_load():
    requests = [r for r in random_workload(4, 8, 5, POOL, seed=5)]
    text = [
        type(r)(tiny_tokenizer().decode(r.prompt), r.prompt_len, r.output_len) for r in requests
    ]
    async with live_server() as server:
        args = load_args(base_url=server.url, endpoint="/v1/chat/completions")
        results, _ = await run_load(args, text, progress=False)
    assert all(r.ok and r.output_len == 5 for r in results), [r.error for r in results]


@pytest.mark.parametrize("fresh", [False, True])
async def test_json_schema_load_against_a_live_server(fresh: bool):
    """Each request asks for a JSON object holding one string: the same schema for all (compiled
    once), or a schema of its own (compiled per request)."""
    requests = with_json_schema(random_workload(4, 8, 12, POOL, seed=6), fresh)
    names = [r.response_format["json_schema"]["name"] for r in requests]
    assert len(set(names)) == (4 if fresh else 1)
    async with live_server() as server:
        args = load_args(base_url=server.url, ignore_eos=False, temperature=1.0)
        results, _ = await run_load(args, requests, progress=False)
        await wait_until_idle(server.engine)
        compiled = server.engine.core.grammars
        assert compiled is not None and len(compiled) == (4 if fresh else 1)
    assert all(r.ok for r in results), [r.error for r in results]


def test_offline_comparison_writes_results_and_plots(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    parser = argparse.ArgumentParser()
    offline.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--num-requests",
            "12",
            "--batch-size",
            "4",
            "--min-input-len",
            "4",
            "--max-input-len",
            "24",
            "--min-output-len",
            "2",
            "--max-output-len",
            "24",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert offline.main(args) == 0
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    modes = {r["mode"]: r for r in report["results"]}
    assert set(modes) == {"continuous", "static", "generate"}
    expected = sum(offline.make_workload(args, 320).output_lens)
    assert all(r["output_tokens"] == expected for r in modes.values())
    assert set(report["throughput_ratios"]) == {"continuous_vs_static", "continuous_vs_generate"}
    for name in ("throughput.png", "latency_cdf.png", "kv_cache_usage.png"):
        assert (tmp_path / "out" / name).stat().st_size > 1000


def test_priority_mix_and_overload_report():
    requests = with_priorities(random_workload(200, 8, 4, POOL, seed=1), 0.2, seed=1)
    share = sum(r.priority == 0 for r in requests) / len(requests)
    assert 0.1 < share < 0.3 and {r.priority for r in requests} == {0, 1}
    results = [
        RequestResult(True, 8, output_len=4, ttft=0.1, e2e=0.5, priority=0),
        RequestResult(False, 8, status=503, e2e=0.01, priority=1),
        RequestResult(
            False,
            8,
            output_len=2,
            ttft=2.0,
            e2e=3.0,
            status=200,
            finish_reason="timeout",
            priority=1,
        ),
        RequestResult(False, 8, status=504, e2e=5.0, priority=1),
    ]
    report = overload(results, duration=10.0, percentiles=[50, 99])
    assert report["deadline_goodput"] == 0.1
    assert report["rejected"] == 1 and report["timed_out"] == 2
    assert report["longest_wait_s"] == 5.0
    assert report["by_class"]["high"]["completed_on_time"] == 1
    assert report["by_class"]["low"]["timed_out"] == 2


async def test_load_with_priorities_and_deadlines_against_a_live_server():
    requests = with_priorities(random_workload(8, 8, 6, POOL, seed=6), 0.5, seed=6)
    async with live_server(scheduling_policy="priority") as server:
        args = load_args(base_url=server.url, timeout=30.0, max_concurrency=4)
        results, duration = await run_load(args, requests, progress=False)
        await wait_until_idle(server.engine)
    assert all(r.ok and not r.timed_out for r in results), [r.error for r in results]
    assert {r.priority for r in results} == {r.priority for r in requests}
    assert overload(results, duration, [50])["deadline_goodput"] > 0
