"""The stats line every few seconds while the engine works, as vLLM writes one
(`server/stats_log.py`): throughputs over the interval, requests, KV cache use and prefix hit
rate; one line of zeros after the last busy interval, then silence; `--disable-log-stats`."""

from __future__ import annotations

import logging

import httpx
import pytest

from engine.core.stats import StepStats
from server.cli import build_parser, server_settings
from server.settings import ServerSettings
from server.stats_log import StatsLog
from tests.server_utils import live_server, until


def step(prompt: int = 0, generated: int = 0, running: int = 0, waiting: int = 0, **more):
    return StepStats(
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=more.pop("kv", 0.0),
        num_prompt_tokens=prompt,
        num_generation_tokens=generated,
        **more,
    )


def test_a_line_sums_its_interval_and_idle_intervals_write_one_line_of_zeros():
    stats = StatsLog()
    assert stats.line(10.0) is None  # idle from the start: nothing
    stats.record(
        step(
            prompt=300,
            generated=20,
            running=2,
            waiting=1,
            kv=0.25,
            prefix_cache_queries=300,
            prefix_cache_hits=100,
        )
    )
    stats.record(step(generated=30, running=2, kv=0.3, num_preemptions=1))
    text, figures = stats.line(10.0)
    assert figures["prompt_throughput"] == 30.0 and figures["generation_throughput"] == 5.0
    assert (figures["running"], figures["waiting"]) == (2, 0)
    assert text == (
        "Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 30.0%, "
        "Prefix cache hit rate: 33.3%, Preemptions: 1"
    )
    stats.record(step())  # the requests finished
    text, figures = stats.line(10.0)
    assert figures["generation_throughput"] == 0.0 and "Running: 0 reqs" in text
    assert "Preemptions" not in text
    assert stats.line(10.0) is None and stats.line(10.0) is None


async def test_a_served_request_shows_in_the_next_line(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, logger="conveyor.stats")
    settings = ServerSettings(served_model_name="tiny", log_stats_interval=0.05)
    async with live_server(settings) as server, httpx.AsyncClient() as client:
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        reply = await client.post(f"{server.url}/v1/completions", json=body)
        assert reply.status_code == 200

        def generated() -> bool:
            return any(
                r.name == "conveyor.stats" and r.fields["generation_throughput"] > 0
                for r in caplog.records
            )

        await until(generated, what="a stats line with the request's tokens")
        line = next(r for r in caplog.records if r.name == "conveyor.stats")
        assert line.getMessage().startswith("Avg prompt throughput: ")


def test_the_stats_line_is_on_by_default_and_off_on_request():
    assert server_settings(build_parser().parse_args(["serve"])).log_stats_interval == 10.0
    args = build_parser().parse_args(["serve", "--disable-log-stats"])
    assert server_settings(args).log_stats_interval is None
