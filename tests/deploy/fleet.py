"""A fleet on one machine: `conveyor serve` replicas of a tiny random-weight model behind the
real vllm-router, each a process the caller can kill, stop and start again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import chat_tokenizer, tiny_llama
from tests.server_utils import free_port, wait_healthy

ROUTER = shutil.which("vllm-router")
ROOT = Path(__file__).resolve().parents[2]


def tiny_model_dir(folder: Path, max_positions: int = 4096) -> Path:
    """The tiny Llama and its chat tokenizer saved as a model folder `--model` can load."""
    tiny_llama(max_positions=max_positions).save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder


@dataclass
class Replica:
    """One `conveyor serve` on its own port; `start` again after `kill` or `stop`."""

    model: Path
    log: Path
    args: tuple[str, ...] = ()
    name: str = "tiny"
    # A tiny model's cache: 64 MiB hold 256k of its tokens, and start in a blink (the CPU
    # default, 4 GiB, takes seconds to commit on a small machine).
    kv_cache_memory: str = "64MiB"
    # Pure torch on one thread: the suite's replicas share a small machine.
    env: dict[str, str] = field(
        default_factory=lambda: {"CONVEYOR_CPU_KERNELS": "off", "OMP_NUM_THREADS": "1"}
    )
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Replica:
        self.launch()
        self.wait()
        return self

    def launch(self) -> None:
        command = [
            sys.executable, "-m", "server", "--model", str(self.model), "--device", "cpu",
            "--served-model-name", self.name, "--port", str(self.port),
            "--kv-cache-memory", self.kv_cache_memory, *self.args,
        ]  # fmt: skip
        env = {**os.environ, **self.env}
        with self.log.open("a") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env
            )

    def wait(self) -> None:
        assert self.process is not None
        wait_healthy(self.url, self.process)

    def kill(self) -> None:
        """SIGKILL: the replica vanishes mid-request."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM: the replica drains (refuses new requests, finishes running ones) and exits."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """This replica's counters and gauges, summed over their labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        return totals

    def requests_to(self, handler: str) -> float:
        """HTTP requests this replica answered on `handler`."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "http_requests"
            for sample in family.samples
            if sample.name == "http_requests_total" and sample.labels.get("handler") == handler
        )

    def prefix_hit_rate(self) -> float:
        metrics = self.metrics()
        queries = metrics.get("vllm:prefix_cache_queries_total", 0.0)
        return metrics.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else 0.0


@dataclass
class Router:
    """vllm-router in front of `workers`, as the fleet recipe runs it."""

    workers: list[str]
    log: Path
    policy: str = "cache_aware"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Router:
        assert ROUTER is not None
        command = [
            ROUTER, "--worker-urls", *self.workers, "--host", "127.0.0.1",
            "--port", str(self.port), "--prometheus-port", str(free_port()),
            "--policy", self.policy, "--health-check-interval-secs", "1",
            "--health-failure-threshold", "1", "--cb-timeout-duration-secs", "2",
            # Open before a request spends its 5 tries on a replica that died: each retry picks
            # among the workers whose breaker is closed.
            "--cb-failure-threshold", "3",
            "--worker-startup-timeout-secs", "120",
        ]  # fmt: skip
        with self.log.open("a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/readiness", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the router did not become ready:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def healthy_workers(self) -> int:
        """How many workers the router counts healthy: 0 while its readiness answer holds no
        count (before it has checked any, it answers in another shape)."""
        answer = httpx.get(f"{self.url}/readiness", timeout=5).json()
        return int(answer.get("healthy_workers", 0)) if isinstance(answer, dict) else 0
