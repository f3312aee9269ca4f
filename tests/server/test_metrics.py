"""/metrics speaks vLLM's names, and its values are true."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engine.core.speculation import SpeculativeConfig
from engine.core.stats import StepStats
from server.metrics import build_1_2_5_buckets
from tests.helpers import chat_tokenizer, sabotage_steps
from tests.server_utils import app_client, wait_until_idle

TOKENIZER = chat_tokenizer()


async def scrape(client) -> dict[str, dict[tuple, float]]:
    """Samples by name, keyed by their sorted label items."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    matches = [
        v
        for key, v in samples[name].items()
        if all((k, str(val)) in key for k, val in labels.items())
    ]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_max_num_generation_tokens_bucket",
    "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket",
    "vllm:iteration_tokens_total_bucket",
    "vllm:cache_config_info",
    "process_cpu_seconds_total",
    "http_requests_total",
    "http_request_duration_seconds_bucket",
]


async def test_all_vllm_metric_names_are_exposed_with_the_model_label():
    async with app_client() as (client, _):
        await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        samples = await scrape(client)
        for name in VLLM_NAMES:
            assert name in samples, name
        assert value(samples, "vllm:num_requests_running", model_name="tiny") == 0
        info = value(
            samples,
            "vllm:cache_config_info",
            model_name="tiny",
            block_size=4,
            cache_dtype="float32",
        )
        assert info == 1
        buckets = {dict(k)["le"] for k in samples["vllm:request_prompt_tokens_bucket"]}
        assert buckets == {str(float(b)) for b in build_1_2_5_buckets(512)} | {"+Inf"}


async def test_counters_and_histograms_are_true(monkeypatch):
    async with app_client() as (client, engine):
        seen: list[StepStats] = []
        engine.stat_loggers.append(seen.append)
        prompts = ["Hello world", "The quick brown fox", "Hello"]
        for prompt in prompts:
            response = await client.post(
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            )
            assert response.json()["choices"][0]["finish_reason"] == "length"
        full = (
            await client.post(
                "/v1/completions",
                json={"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            )
        ).json()["choices"][0]["text"]
        stopped = await client.post(
            "/v1/completions",
            json={
                "prompt": "Hello",
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
                "stop": full[3:7],
            },
        )
        assert stopped.json()["choices"][0]["finish_reason"] == "stop"
        stop_tokens = stopped.json()["usage"]["completion_tokens"]

        stream = engine.submit(TOKENIZER("Hello")["input_ids"], _params(max_tokens=400))
        await stream.__anext__()
        await stream.aclose()  # abort after the first token
        await wait_until_idle(engine)

        sabotage_steps(engine.core, monkeypatch)
        failed = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert failed.status_code == 500
        monkeypatch.undo()
        await asyncio.sleep(0.05)

        samples = await scrape(client)
        reasons = {
            r: value(samples, "vllm:request_success_total", finished_reason=r)
            for r in ("length", "stop", "abort", "error")
        }
        # three prompts and the 12-token run end by length; one stop; one abort; one failure
        assert reasons == {"length": 4, "stop": 1, "abort": 1, "error": 1}

        hello = len(TOKENIZER("Hello")["input_ids"])
        prompt_lens = [len(TOKENIZER(p)["input_ids"]) for p in prompts]
        # Prompts count once, when their first token arrives (the failed one never did).
        assert value(samples, "vllm:prompt_tokens_total") == sum(prompt_lens) + 3 * hello
        # The aborted request made two tokens: the next step starts as soon as a step's outputs
        # are handed over, so the abort sent after the first token lands after the second.
        generated = 3 * 5 + 12 + stop_tokens + 2
        assert value(samples, "vllm:generation_tokens_total") == generated
        assert value(samples, "vllm:e2e_request_latency_seconds_count") == 7
        assert value(samples, "vllm:time_to_first_token_seconds_count") == 6
        assert value(samples, "vllm:request_params_n_count") == 7
        assert value(samples, "vllm:request_generation_tokens_sum") == generated
        assert value(samples, "vllm:inter_token_latency_seconds_count") == generated - 6
        assert value(samples, "vllm:num_requests_running") == 0
        assert value(samples, "vllm:num_requests_waiting") == 0
        assert value(samples, "vllm:kv_cache_usage_perc") == 0
        assert value(samples, "http_requests_total", handler="/v1/completions", status="2xx") == 5
        assert value(samples, "http_requests_total", handler="/v1/completions", status="5xx") == 1

        finished = [f for stats in seen for f in stats.finished]
        assert len(finished) == 7
        for stats in finished:
            if stats.time_to_first_token is not None:
                assert 0 <= stats.time_to_first_token <= stats.e2e_latency
                assert stats.queue_time <= stats.time_to_first_token
            assert stats.e2e_latency >= (stats.inference_time or 0)


async def test_kv_cache_usage_is_reported_while_running():
    async with app_client() as (client, engine):
        seen: list[StepStats] = []
        engine.stat_loggers.append(seen.append)
        stream = engine.submit([40, 41, 42, 43, 44], _params(max_tokens=20))
        async for _ in stream:
            pass
        busy = [s for s in seen if s.num_running]
        assert busy and all(0 < s.kv_cache_usage <= 1 for s in busy)
        samples = await scrape(client)
        assert value(samples, "vllm:kv_cache_usage_perc") == 0
        assert value(samples, "vllm:gpu_cache_usage_perc") == 0


def _params(max_tokens: int):
    from engine.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


async def test_max_generation_tokens_is_one_observation_per_request():
    async with app_client() as (client, _):
        before = await scrape(client)
        count = value(before, "vllm:request_max_num_generation_tokens_count")
        total = value(before, "vllm:request_max_num_generation_tokens_sum")
        response = await client.post(
            "/v1/completions",
            json={
                "prompt": "Hello",
                "max_tokens": 6,
                "n": 3,
                "temperature": 1,
                "seed": 5,
                "ignore_eos": True,
            },
        )
        assert len(response.json()["choices"]) == 3
        samples = await scrape(client)
        assert value(samples, "vllm:request_max_num_generation_tokens_count") == count + 1
        assert value(samples, "vllm:request_max_num_generation_tokens_sum") == total + 6
        # Each sequence's own length still goes to request_generation_tokens.
        assert value(samples, "vllm:request_generation_tokens_count") == 3


def test_max_generation_tokens_takes_the_longest_sequence_once_all_finish():
    from prometheus_client import CollectorRegistry

    from engine.core.config import ServingInfo
    from engine.core.stats import FinishedRequestStats
    from server.metrics import EngineMetrics

    registry = CollectorRegistry()
    metrics = EngineMetrics(
        registry,
        "m",
        ServingInfo(
            model_name="m",
            max_model_len=64,
            dtype="float32",
            device="cpu",
            num_blocks=8,
            block_size=4,
        ),
    )

    def finished(parent: str, tokens: int, siblings: int) -> StepStats:
        stats = StepStats(0, 0, 0.0)
        stats.finished.append(
            FinishedRequestStats(
                "length", 3, tokens, 1.0, None, None, None, None, None, parent, siblings
            )
        )
        return stats

    def observed() -> tuple[float, float]:
        name = "vllm:request_max_num_generation_tokens"
        return (
            registry.get_sample_value(f"{name}_count", {"model_name": "m", "engine": "0"}),
            registry.get_sample_value(f"{name}_sum", {"model_name": "m", "engine": "0"}),
        )

    for tokens in (2, 7):
        metrics.record(finished("a", tokens, 3))
    metrics.record(finished("b", 5, 1))
    assert observed() == (1, 5)  # "a" still has a sequence running
    metrics.record(finished("a", 4, 3))
    assert observed() == (2, 12)


async def test_preemptions_are_counted():
    # 12 blocks of 4 tokens hold 48; three sequences of 5 + 20 tokens need 21 blocks.
    async with app_client(num_blocks=12, block_size=4) as (client, engine):
        seen: list[StepStats] = []
        engine.stat_loggers.append(seen.append)
        replies = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={
                        "prompt": [40 + i, 41, 42, 43, 44],
                        "max_tokens": 20,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                for i in range(3)
            )
        )
        assert all(r.status_code == 200 for r in replies)
        preempted = sum(s.num_preemptions for s in seen)
        assert preempted > 0
        samples = await scrape(client)
        assert value(samples, "vllm:num_preemptions_total") == preempted


async def test_docs_name_every_engine_metric():
    """docs/metrics.md lists every `vllm:` and `conveyor:` family the server exports."""
    documented = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    async with app_client() as (client, _):
        response = await client.get("/metrics")
    families = {
        family.name
        for family in text_string_to_metric_families(response.text)
        if family.name.startswith(("vllm:", "conveyor:")) and not family.name.endswith("_created")
    }
    assert len(families) > 20
    missing = [
        name
        for name in sorted(families)
        if name not in documented and f"{name}_total" not in documented
    ]
    assert not missing, missing


async def test_speculation_counters_are_true():
    """vLLM's `spec_decode` counters hold what the engine verified, registered only where it
    speculates; generation tokens count every kept draft."""
    spec = SpeculativeConfig(3, 1, 2)
    async with app_client(speculative=spec) as (client, engine):
        seen: list[StepStats] = []
        engine.stat_loggers.append(seen.append)
        loop = [40, 41, 42, 43] * 6
        replies = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={
                        "prompt": loop[i:],
                        "max_tokens": 30,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )
                for i in range(3)
            )
        )
        assert all(r.json()["usage"]["completion_tokens"] == 30 for r in replies)
        samples = await scrape(client)
    drafts = sum(s.drafts.num_drafts for s in seen)
    accepted = sum(s.drafts.num_accepted_tokens for s in seen)
    assert drafts > 0
    assert value(samples, "vllm:spec_decode_num_drafts_total") == drafts
    assert value(samples, "vllm:spec_decode_num_draft_tokens_total") == sum(
        s.drafts.num_draft_tokens for s in seen
    )
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    positions = [
        value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p)
        for p in range(3)
    ]
    assert sum(positions) == accepted and positions == sorted(positions, reverse=True)
    assert value(samples, "vllm:generation_tokens_total") == 90
    async with app_client() as (client, _):
        assert "vllm:spec_decode_num_drafts_total" not in await scrape(client)


async def test_cached_prompt_tokens_split_the_prompt_tokens_by_where_their_kv_came_from():
    """A prompt sent twice reads its full blocks from the prefix cache the second time: the
    cached and computed counts add up to the prompt tokens, and match the usage's."""
    async with app_client(enable_prefix_caching=True) as (client, engine):
        body = {"prompt": "the quick brown fox jumps over the lazy dog", "max_tokens": 2}
        usages = [
            (await client.post("/v1/completions", json=body)).json()["usage"] for _ in range(2)
        ]
        await wait_until_idle(engine)
        samples = await scrape(client)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0
    assert value(samples, "vllm:prompt_tokens_total") == prompt
    assert value(samples, "vllm:prompt_tokens_cached_total") == cached
    split = {
        source: value(samples, "vllm:prompt_tokens_by_source_total", source=source)
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert split == {
        "local_compute": prompt - cached,
        "local_cache_hit": cached,
        "external_kv_transfer": 0,
    }
    assert value(samples, "vllm:request_prefill_kv_computed_tokens_sum") == prompt - cached
    assert value(samples, "vllm:request_prefill_kv_computed_tokens_count") == 2


async def test_a_data_parallel_rank_labels_its_metrics_with_its_engine():
    """vLLM labels each rank's metrics with its engine index: a fleet's replicas stay apart in
    one Prometheus (`--data-parallel-rank`)."""
    async with app_client(tokenizer=TOKENIZER, data_parallel_rank=2) as (client, _):
        samples = await scrape(client)
        engines = {dict(key).get("engine") for key in samples["vllm:num_requests_running"]}
        assert engines == {"2"}
