"""Two replicas behind the real vllm-router on one machine: cache-aware routing keeps each
shared prefix on one replica, and a replica killed, drained or restarted mid-run costs no
request."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.deploy.fleet import ROOT, ROUTER, Replica, Router, free_port, tiny_model_dir
from tests.deploy.fleet_traffic import Outcomes, shared_prefix_prompts, steady_run, ttft_p50
from tests.server_utils import free_ports

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(ROUTER is None, reason="needs vllm-router (a dev extra on x86-64 Linux)"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("fleet") / "tiny")


@pytest.fixture
def replicas(model, tmp_path) -> Iterator[list[Replica]]:
    fleet = [Replica(model, tmp_path / f"replica-{i}.log") for i in range(2)]
    for replica in fleet:
        replica.launch()
    for replica in fleet:
        replica.wait()
    yield fleet
    for replica in fleet:
        if replica.process is not None and replica.process.poll() is None:
            replica.process.kill()
            replica.process.wait()


def routed(replicas: list[Replica], tmp_path: Path, policy: str) -> Router:
    return Router([r.url for r in replicas], tmp_path / f"router-{policy}.log", policy).start()


def cache_use(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """Prompt tokens found in the prefix cache, and looked up, between two scrapes."""
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    return after[hits] - before[hits], after[queries] - before[queries]


def successes(replica: Replica) -> float:
    return replica.metrics().get("vllm:request_success_total", 0.0)


def test_cache_aware_routing_keeps_each_prefix_on_one_replica(replicas, tmp_path):
    """8 groups of 1k-token prefixes, 4 requests each, in shuffled order: under cache_aware a
    group's later requests find its prefix cached; round_robin spreads every group over both
    replicas, so each misses it once per replica."""
    prompts = shared_prefix_prompts(groups=8, prefix_tokens=1000, per_group=4)
    report = {}
    for policy in ("round_robin", "cache_aware"):
        for replica in replicas:
            httpx.post(f"{replica.url}/flush_cache", timeout=10).raise_for_status()
        before = [r.metrics() for r in replicas]
        router = routed(replicas, tmp_path, policy)
        try:
            p50 = asyncio.run(ttft_p50(router.url, prompts, concurrency=2))
        finally:
            router.stop()
        use = [cache_use(b, r.metrics()) for b, r in zip(before, replicas, strict=True)]
        report[policy] = {
            "hit_rate": sum(h for h, _ in use) / sum(q for _, q in use),
            "per_replica": [round(h / q, 3) if q else None for h, q in use],
            "ttft_p50_ms": round(p50 * 1000, 1),
        }
    print(report)
    # The router took the prompts' tokens from the render route, never /tokenize.
    assert sum(r.requests_to("/v1/completions/render") for r in replicas) >= 2 * len(prompts)
    assert sum(r.requests_to("/tokenize") for r in replicas) == 0
    # Each group's first request misses: at best 3 of 4 requests hit, about 0.75 of the tokens.
    assert report["cache_aware"]["hit_rate"] > 0.65, report
    assert report["cache_aware"]["hit_rate"] > report["round_robin"]["hit_rate"] + 0.1, report


def when(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.05)


def test_replicas_killed_drained_and_restarted_cost_no_request(replicas, tmp_path):
    """200 requests or more (until the last replica is back), a quarter of them streamed, and
    four long streams running on both replicas from the start: replica A is SIGKILLed after 40
    and started again; once the router takes it back, replica B gets SIGTERM (a drain) and is
    started again. No plain request fails, a stream cut by A's death ends with an error the
    client sees (the router closes it mid-body), none hangs, the long streams on B finish, and
    the router sends traffic to both restarted replicas."""
    a, b = replicas
    router = routed(replicas, tmp_path, "cache_aware")
    pool = ThreadPoolExecutor(4)
    long_streams = [pool.submit(long_stream, router.url, i) for i in range(4)]
    when(lambda: all(running(r) >= 1 for r in replicas), "long streams on both replicas")
    events: list[str] = []
    progress = Outcomes()
    failure: list[BaseException] = []
    finished = threading.Event()

    def watch(out: Outcomes) -> None:
        progress.ok, progress.failed, progress.cut_streams = out.ok, out.failed, out.cut_streams

    def choreography() -> None:
        try:
            when(lambda: progress.done >= 40, "40 requests done")
            a.kill()
            events.append(f"A killed after {progress.done}")
            a.start()
            when(lambda: router.healthy_workers() == 2, "the router seeing A again")
            served = successes(a)
            when(lambda: successes(a) > served, "A serving again")
            events.append(f"A back after {progress.done}")
            assert b.stop() == 0
            events.append(f"B drained after {progress.done}")
            b.start()
            when(lambda: router.healthy_workers() == 2, "the router seeing B again")
            events.append(f"B back after {progress.done}")
        except BaseException as exc:
            failure.append(exc)
        finally:
            finished.set()

    try:
        controller = threading.Thread(target=choreography)
        controller.start()
        out = asyncio.run(
            steady_run(
                router.url, 200, 4, on_progress=watch, keep_going=lambda: not finished.is_set()
            )
        )
        controller.join(timeout=300)
        assert not failure, failure
        endings = [stream.result(timeout=300) for stream in long_streams]
        served_before = successes(b)
        asyncio.run(steady_run(router.url, 16, concurrency=4, streamed_every=1000))
        events.append(f"B served {successes(b) - served_before:.0f} of 16 requests after")
    finally:
        router.stop()
        pool.shutdown(wait=False, cancel_futures=True)
    print(events, out, endings)
    assert out.done >= 200
    assert out.failed == [], out.failed
    assert out.hung == 0
    assert successes(b) > served_before, events
    assert "cut" in endings and "done" in endings, endings


def running(replica: Replica) -> float:
    return replica.metrics().get("vllm:num_requests_running", 0.0)


def long_stream(url: str, i: int) -> str:
    """A stream of 2,000 tokens: "done" if it ends with [DONE], "cut" if the connection ends
    before it (an error the client sees)."""
    # Prompts that share no prefix, so that a cache-aware router spreads them.
    prompt = ["alpha story", "bravo tale", "charlie news", "delta song"][i]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2000, "ignore_eos": True}
    last = ""
    try:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120
        ) as response:
            for line in response.iter_lines():
                last = line or last
    except httpx.TransportError:
        return "cut"
    return "done" if last == "data: [DONE]" else f"ended with {last[:80]!r}"


def port_open(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    except httpx.TransportError:
        return False
    return True


def test_the_fleet_recipe_serves_through_its_router_and_stops_everything(model, tmp_path):
    router_port, first = free_port(), free_ports(2)  # the replicas take first and first + 1
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "ROUTER_PORT": str(router_port),
        "ROUTER_METRICS_PORT": str(free_port()),
        "FIRST_PORT": str(first),
        "LOGS": str(tmp_path / "logs"),
        "CONVEYOR_CPU_KERNELS": "off",
    }
    serve = ["--model", str(model), "--device", "cpu", "--served-model-name", "tiny"]
    serve += ["--kv-cache-memory", "64MiB"]
    # One KV events config for both: each replica publishes on its own port (the port + rank).
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_ports(2)}"}
    serve += ["--kv-events-config", json.dumps(events)]
    fleet = subprocess.Popen(
        ["bash", str(ROOT / "deploy" / "fleet.sh"), "2", *serve],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        router = Router([], tmp_path / "unused.log", port=router_port)

        def listening() -> bool:
            assert fleet.poll() is None, fleet.communicate()[0]
            return port_open(router_port)

        when(listening, "the router listening", 300)
        # The router serves once one replica answers; the other joins when it is up.
        when(lambda: port_open(first) and port_open(first + 1), "both replicas serving", 300)
        when(lambda: router.healthy_workers() == 2, "both replicas healthy", 300)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        for rank in (0, 1):  # each replica is its own data-parallel rank
            metrics = httpx.get(f"http://127.0.0.1:{first + rank}/metrics", timeout=30).text
            running = [
                m for m in metrics.splitlines() if m.startswith("vllm:num_requests_running{")
            ]
            assert len(running) == 1 and f'engine="{rank}"' in running[0], running
    finally:
        fleet.send_signal(signal.SIGTERM)
        output = fleet.communicate(timeout=90)[0]
    assert "router on" in output
    for port in (router_port, first, first + 1):
        assert not port_open(port), f"something still listens on {port}"


def test_replicas_with_an_api_key_stay_healthy_to_the_router(model, tmp_path):
    """The router polls /get_load without the client's key: a replica must answer it (else
    the router counts it unhealthy and serves nothing). A client's key passes through."""
    fleet = [
        Replica(model, tmp_path / f"keyed-{i}.log", args=("--api-key", "sekret")) for i in range(2)
    ]
    for replica in fleet:
        replica.launch()
    try:
        for replica in fleet:
            replica.wait()
        router = routed(fleet, tmp_path, "cache_aware")
        try:
            when(lambda: router.healthy_workers() == 2, "both keyed replicas healthy")
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
            url = f"{router.url}/v1/completions"
            key = {"Authorization": "Bearer sekret"}
            assert httpx.post(url, json=body, headers=key, timeout=60).status_code == 200
            assert httpx.post(url, json=body, timeout=60).status_code == 401
            loads = httpx.get(f"{router.url}/get_loads", timeout=10).json()["workers"]
            assert [w["load"] for w in loads] == [0, 0]  # read, not -1 (unknown)
        finally:
            router.stop()
    finally:
        for replica in fleet:
            replica.stop()
