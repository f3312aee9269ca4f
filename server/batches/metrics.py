"""The Batch API's metrics, read when `/metrics` is scraped: batches by status and their lines
by state from the store, lines in flight and batch tokens from the runner."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.batches.jobs import STAGE_TIMES, BatchStore
from server.batches.runner import BatchRunner
from server.batches.state import Lazy

STATUSES = ("validating", *STAGE_TIMES)
LINE_STATES = ("pending", "running", "completed", "failed")


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry, jobs: Lazy[BatchStore], runner: BatchRunner):
        self.jobs = jobs
        self.runner = runner
        registry.register(self)

    def describe(self) -> Iterator[Any]:
        yield from self._families()

    def collect(self) -> Iterator[Any]:
        statuses: dict[str, int] = {}
        lines = {"completed": 0, "failed": 0, "unfinished": 0}
        store = self.jobs.existing()
        if store is not None:
            statuses, lines = store.totals()
        running = self.runner.in_flight
        states = {
            "pending": max(0, lines["unfinished"] - running),
            "running": running,
            "completed": lines["completed"],
            "failed": lines["failed"],
        }
        yield from self._families(statuses, states, self.runner.tokens)

    @staticmethod
    def _families(
        statuses: dict[str, int] | None = None,
        states: dict[str, int] | None = None,
        tokens: dict[str, int] | None = None,
    ) -> Iterator[Any]:
        batches = GaugeMetricFamily("conveyor:batches", "Batches by status.", labels=["status"])
        for status in STATUSES:
            batches.add_metric([status], (statuses or {}).get(status, 0))
        lines = GaugeMetricFamily(
            "conveyor:batch_lines", "Requests of batches by state.", labels=["state"]
        )
        for state in LINE_STATES:
            lines.add_metric([state], (states or {}).get(state, 0))
        counted = CounterMetricFamily(
            "conveyor:batch_tokens", "Tokens of batch requests served, by kind.", labels=["kind"]
        )
        for kind in ("prompt", "generation"):
            counted.add_metric([kind], (tokens or {}).get(kind, 0))
        yield batches
        yield lines
        yield counted
