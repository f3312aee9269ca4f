"""A log line every few seconds while the engine works, as vLLM writes one: the prompt and
generation throughput over the interval, the requests running and waiting, the KV cache's use
and the prefix cache's hit rate (`--disable-log-stats` turns it off). An idle server writes one
line of zeros after its last busy interval, then nothing until the next request."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from engine.core.stats import StepStats

logger = logging.getLogger("conveyor.stats")
# Seconds between lines, as vLLM's default.
INTERVAL = 10.0


@dataclass(slots=True)
class _Interval:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0


class StatsLog:
    """Folds each step's stats in (`record`, an engine stat logger) and writes a line per
    interval (`run`)."""

    def __init__(self) -> None:
        self._interval = _Interval()
        self._running = 0
        self._waiting = 0
        self._kv_usage = 0.0
        self._queries = 0
        self._hits = 0
        self._was_busy = False

    def record(self, stats: StepStats) -> None:
        self._interval.prompt_tokens += stats.num_prompt_tokens
        self._interval.generation_tokens += stats.num_generation_tokens
        self._interval.preemptions += stats.num_preemptions
        self._running, self._waiting = stats.num_running, stats.num_waiting
        self._kv_usage = stats.kv_cache_usage
        self._queries += stats.prefix_cache_queries
        self._hits += stats.prefix_cache_hits

    def line(self, seconds: float) -> tuple[str, dict[str, float]] | None:
        """The line for the `seconds` since the last one, and its figures; None where this
        interval and the last were idle. Starts the next interval."""
        interval, self._interval = self._interval, _Interval()
        busy = bool(
            interval.prompt_tokens or interval.generation_tokens or self._running or self._waiting
        )
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        figures = {
            "prompt_throughput": interval.prompt_tokens / seconds,
            "generation_throughput": interval.generation_tokens / seconds,
            "running": self._running,
            "waiting": self._waiting,
            "kv_cache_usage": self._kv_usage,
            "prefix_cache_hit_rate": self._hits / self._queries if self._queries else 0.0,
            "preemptions": interval.preemptions,
        }
        text = (
            f"Avg prompt throughput: {figures['prompt_throughput']:.1f} tokens/s, "
            f"Avg generation throughput: {figures['generation_throughput']:.1f} tokens/s, "
            f"Running: {self._running} reqs, Waiting: {self._waiting} reqs, "
            f"KV cache usage: {100 * self._kv_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * figures['prefix_cache_hit_rate']:.1f}%"
        )
        if interval.preemptions:
            text += f", Preemptions: {interval.preemptions}"
        return text, figures

    async def run(self, interval: float = INTERVAL) -> None:
        """Write a line every `interval` seconds until cancelled."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            found = self.line(now - last)
            last = now
            if found is not None:
                text, figures = found
                logger.info(text, extra={"fields": figures, "fields_in_message": True})
