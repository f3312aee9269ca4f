"""Prometheus metrics with vLLM's names, types, labels and buckets, on a registry passed in.

Engine stats arrive as plain `StepStats` objects after every step; HTTP requests are counted by
an ASGI middleware. Nothing here touches a global registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.core.config import ServingInfo
from engine.core.request import FinishReason
from engine.core.sampling_params import STRUCTURED_KINDS
from engine.core.stats import DraftStats, FinishedRequestStats, StepStats
from engine.kv.residency import Eviction

LABELS = ["model_name", "engine"]
COMPILE_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
TOKEN_LATENCY_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
# A KV block's seconds in the prefix cache (vLLM's buckets for its residency histograms).
RESIDENCY_BUCKETS = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
    600, 1200, 1800,
]  # fmt: skip
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
HTTP_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def build_1_2_5_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`, as vLLM sizes its token-count histograms."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return buckets
            buckets.append(value)
        exponent += 1


# `vllm:engine_sleep_state`'s states, by sleep level (0: awake).
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class _DraftCounters:
    """vLLM's speculative decoding counters, registered where drafts are verified: drafts,
    draft tokens, tokens kept, and tokens kept at each position of a draft."""

    def __init__(self, metrics: EngineMetrics, registry: CollectorRegistry, most: int) -> None:
        labels, counter = metrics._labels, metrics._counter
        self.drafts = counter(
            registry, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."
        )
        self.draft_tokens = counter(
            registry, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.accepted = counter(
            registry, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*LABELS, "position"],
            registry=registry,
        )
        self.per_position = [per_position.labels(*labels, str(p)) for p in range(most)]

    def record(self, stats: DraftStats) -> None:
        self.drafts.inc(stats.num_drafts)
        self.draft_tokens.inc(stats.num_draft_tokens)
        self.accepted.inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.accepted_per_position):
            self.per_position[position].inc(count)


class _ResidencyHistograms:
    """vLLM's KV cache residency histograms, registered with `--kv-cache-metrics`: what each
    sampled block evicted from the prefix cache reports (`engine/kv/residency.py`)."""

    def __init__(self, metrics: EngineMetrics, registry: CollectorRegistry) -> None:
        h = metrics._histogram
        sampled = " Sampled (--kv-cache-metrics-sample)."
        self.lifetime = h(
            registry,
            "vllm:kv_block_lifetime_seconds",
            "Histogram of KV cache block lifetime from allocation to eviction." + sampled,
            RESIDENCY_BUCKETS,
        )
        self.idle = h(
            registry,
            "vllm:kv_block_idle_before_evict_seconds",
            "Histogram of idle time before KV cache block eviction." + sampled,
            RESIDENCY_BUCKETS,
        )
        self.reuse_gap = h(
            registry,
            "vllm:kv_block_reuse_gap_seconds",
            "Histogram of time between consecutive reuses of a KV cache block." + sampled,
            RESIDENCY_BUCKETS,
        )

    def record(self, evictions: list[Eviction]) -> None:
        for eviction in evictions:
            self.lifetime.observe(eviction.lifetime)
            self.idle.observe(eviction.idle)
            for gap in eviction.reuse_gaps:
                self.reuse_gap.observe(gap)


class EngineMetrics:
    """The `vllm:` metrics of one served model."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        info: ServingInfo,
        sleep_level: Callable[[], int] = lambda: 0,
    ) -> None:
        self._labels = (model_name, str(info.data_parallel_rank))
        self._sleep_level = sleep_level
        # Requests with sequences still running: (sequences finished, most tokens so far).
        self._generation_groups: dict[str, tuple[int, int]] = {}
        self._define_gauges(registry, info)
        self._define_counters(registry)
        self._define_histograms(registry, info.max_model_len)
        self._define_structured(registry)
        self._drafts: _DraftCounters | None = None
        if info.num_speculative_tokens:
            self._drafts = _DraftCounters(self, registry, info.num_speculative_tokens)
        self._residency: _ResidencyHistograms | None = None
        if info.kv_cache_metrics:
            self._residency = _ResidencyHistograms(self, registry)

    def _gauge(self, registry: CollectorRegistry, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, registry=registry).labels(*self._labels)

    def _counter(self, registry: CollectorRegistry, name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=registry).labels(*self._labels)

    def _counters_by(
        self, registry: CollectorRegistry, name: str, doc: str, label: str, values: Iterable[str]
    ) -> dict[str, Counter]:
        """One counter per value of `label` (each series there from the start, at 0)."""
        family = Counter(name, doc, [*LABELS, label], registry=registry)
        return {value: family.labels(*self._labels, value) for value in values}

    def _histogram(
        self, registry: CollectorRegistry, name: str, doc: str, buckets: Sequence[float]
    ) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(
            *self._labels
        )

    def _define_gauges(self, registry: CollectorRegistry, info: ServingInfo) -> None:
        self.running = self._gauge(
            registry, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = self._gauge(
            registry, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by why they wait: capacity or deferred.",
            [*LABELS, "reason"],
            registry=registry,
        )
        self.waiting_capacity = by_reason.labels(*self._labels, "capacity")
        self.waiting_deferred = by_reason.labels(*self._labels, "deferred")
        self.kv_usage = self._gauge(
            registry, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.gpu_kv_usage = self._gauge(
            registry,
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. Older name of vllm:kv_cache_usage_perc.",
        )
        cache_info = {
            "block_size": str(info.block_size),
            "num_gpu_blocks": str(info.num_blocks),
            "cache_dtype": info.kv_cache_dtype or info.dtype,
            "device": info.device,
            "enable_prefix_caching": str(info.enable_prefix_caching),
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the cache configuration.",
            [*LABELS, *cache_info],
            registry=registry,
        ).labels(*self._labels, *cache_info.values()).set(1)
        Gauge(
            "conveyor:parallel_config_info",
            "Information of the parallel configuration: the tensor-parallel ranks.",
            [*LABELS, "tensor_parallel_size"],
            registry=registry,
        ).labels(*self._labels, str(info.tensor_parallel_size)).set(1)
        # vLLM's adapter gauge, read by the Gateway API Inference Extension's endpoint picker:
        # the adapters running and waiting requests run (comma-separated), and how many one
        # step may run; its value is when it was last updated, read at the scrape so that no
        # step pays for it. One series at a time: a change of adapters replaces it.
        self._lora_family = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        )
        self._lora_labels = (str(info.max_loras), "", "")
        self._lora_family.labels(*self._lora_labels).set_function(time.time)
        sleep_state = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            [*LABELS, "sleep_state"],
            registry=registry,
        )
        for level, state in enumerate(SLEEP_STATES):
            sleep_state.labels(*self._labels, state).set_function(self._is_level(level))

    def _is_level(self, level: int) -> Callable[[], float]:
        return lambda: float(self._sleep_level() == level)

    def _define_counters(self, registry: CollectorRegistry) -> None:
        self.prompt_tokens = self._counter(
            registry, "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = self._counter(
            registry, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.preemptions = self._counter(
            registry, "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.rejections = self._counter(
            registry, "vllm:admission_rejections", "Requests turned away by admission control."
        )
        self.cached_prompt_tokens = self._counter(
            registry,
            "vllm:prompt_tokens_cached",
            "Prompt tokens read from the prefix cache rather than computed.",
        )
        self.prompt_sources = self._counters_by(
            registry,
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            "source",
            ("local_compute", "local_cache_hit", "external_kv_transfer"),
        )
        self.prefix_queries = self._counter(
            registry,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = self._counter(
            registry,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        self.success = self._counters_by(
            registry,
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            (str(reason) for reason in FinishReason),
        )

    def _define_structured(self, registry: CollectorRegistry) -> None:
        """Conveyor's own: requests that ask for an output format, and format compile times."""
        self.structured = self._counters_by(
            registry,
            "conveyor:structured_output_requests",
            "Requests that asked for an output format, by kind.",
            "kind",
            STRUCTURED_KINDS,
        )
        self.grammar_compile = self._histogram(
            registry,
            "conveyor:structured_output_compile_seconds",
            "Seconds to compile an output format not compiled before.",
            COMPILE_BUCKETS,
        )

    def _define_histograms(self, registry: CollectorRegistry, max_model_len: int) -> None:
        tokens = build_1_2_5_buckets(max_model_len)
        h = self._histogram
        self.ttft = h(
            registry,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = h(
            registry,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot_request = h(
            registry,
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.tpot = h(
            registry,
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (older name of "
            "vllm:inter_token_latency_seconds).",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = h(
            registry,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = h(
            registry,
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = h(
            registry,
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = h(
            registry,
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = h(
            registry,
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_len = h(
            registry, "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.computed_len = h(
            registry,
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens each request computed (those not found in the prefix cache).",
            tokens,
        )
        self.generation_len = h(
            registry,
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            tokens,
        )
        self.max_generation_len = h(
            registry,
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = h(
            registry,
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            [1, 2, 5, 10, 20],
        )
        self.params_max_tokens = h(
            registry,
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tokens,
        )
        self.iteration_tokens = h(
            registry,
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS,
        )

    def record(self, stats: StepStats) -> None:
        """Fold one step's stats in (the engine calls this after every step)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.waiting_deferred.set(stats.num_waiting_deferred)
        self.waiting_capacity.set(stats.num_waiting - stats.num_waiting_deferred)
        self.rejections.inc(stats.num_rejections)
        self.kv_usage.set(stats.kv_cache_usage)
        self.gpu_kv_usage.set(stats.kv_cache_usage)
        self.preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        cached = stats.num_cached_prompt_tokens
        self.cached_prompt_tokens.inc(cached)
        self.prompt_sources["local_cache_hit"].inc(cached)
        self.prompt_sources["local_compute"].inc(stats.num_prompt_tokens - cached)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.prefix_queries.inc(stats.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits)
        if stats.num_prompt_tokens or stats.num_generation_tokens:
            self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        for latency in stats.inter_token_latencies:
            self.itl.observe(latency)
            self.tpot.observe(latency)
        for params in stats.new_requests:
            self.params_n.observe(params.n)
            self.params_max_tokens.observe(params.max_tokens)
            if params.structured is not None:
                self.structured[params.structured].inc()
        for seconds in stats.grammar_compile_seconds:
            self.grammar_compile.observe(seconds)
        for finished in stats.finished:
            self._record_finished(finished)
        if stats.running_loras is not None:
            self._record_loras(stats.running_loras, stats.waiting_loras)
        if self._drafts is not None:
            self._drafts.record(stats.drafts)
        if self._residency is not None:
            self._residency.record(stats.kv_evictions)

    def _record_loras(self, running: tuple[str, ...], waiting: tuple[str, ...]) -> None:
        labels = (self._lora_labels[0], ",".join(waiting), ",".join(running))
        if labels == self._lora_labels:
            return
        self._lora_family.remove(*self._lora_labels)
        self._lora_family.labels(*labels).set_function(time.time)
        self._lora_labels = labels

    def _record_finished(self, finished: FinishedRequestStats) -> None:
        self.success[finished.finish_reason].inc()
        self.e2e.observe(finished.e2e_latency)
        self.prompt_len.observe(finished.num_prompt_tokens)
        self.computed_len.observe(finished.num_prompt_tokens - finished.num_cached_tokens)
        self.generation_len.observe(finished.num_generation_tokens)
        self._observe_max_generation(finished)
        optional = (
            (self.queue, finished.queue_time),
            (self.ttft, finished.time_to_first_token),
            (self.prefill, finished.prefill_time),
            (self.decode, finished.decode_time),
            (self.inference, finished.inference_time),
            (self.tpot_request, finished.time_per_output_token),
        )
        for histogram, value in optional:
            if value is not None:
                histogram.observe(value)

    def _observe_max_generation(self, finished: FinishedRequestStats) -> None:
        """One observation a request, as vLLM records it: the most tokens any of its `n`
        sequences generated, once the last of them finishes."""
        seen, most = self._generation_groups.pop(finished.parent_id, (0, 0))
        seen, most = seen + 1, max(most, finished.num_generation_tokens)
        if seen < finished.siblings:
            self._generation_groups[finished.parent_id] = (seen, most)
        else:
            self.max_generation_len.observe(most)


class HTTPMetrics:
    """Request counts and durations by route template, method and status."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["handler", "method", "status"]
        self.requests = Counter(
            "http_requests",
            "Total number of requests by handler, method and status.",
            labels,
            registry=registry,
        )
        self.duration = Histogram(
            "http_request_duration_seconds",
            "Duration of HTTP requests in seconds.",
            labels,
            buckets=HTTP_LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        labels = (handler, method, f"{status // 100}xx")
        self.requests.labels(*labels).inc()
        self.duration.labels(*labels).observe(seconds)


class HTTPMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or "none"
            self.metrics.observe(handler, scope["method"], status, time.perf_counter() - start)


def build_registry() -> CollectorRegistry:
    """A fresh registry with the process and platform collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
