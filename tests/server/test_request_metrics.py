"""vLLM's per-request `metrics`: a lone sequence's timings (`--enable-per-request-metrics`)
and its verification steps (`--per-request-spec-decode-metrics`) on chat, completion and
Responses replies, streamed on the usage chunk; null for several sequences, absent when off;
the steps summed over requests are /metrics' spec-decode counters."""

from __future__ import annotations

from typing import Any

import pytest

from engine.core.speculation import PREDICTION_DRAFTS, SpeculativeConfig
from server.settings import ServerSettings
from tests.server_utils import app_client, sse_events

TIMED = ServerSettings(served_model_name="tiny", per_request_metrics=True)
CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hello Hello Hello Hello"}],
    "temperature": 0,
    "max_tokens": 20,
    "ignore_eos": True,
}
TIMING_FIELDS = {
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
}


async def _post(client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_no_metrics_unless_the_server_reports_them():
    async with app_client() as (client, _):
        reply = await _post(client, "/v1/chat/completions", CHAT)
    assert "metrics" not in reply


async def test_a_lone_sequence_s_timings_hang_together():
    async with app_client(TIMED) as (client, _):
        chat = await _post(client, "/v1/chat/completions", CHAT)
        one = await _post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 1})
        completion = await _post(
            client,
            "/v1/completions",
            {"model": "tiny", "prompt": "Hi there", "max_tokens": 5, "ignore_eos": True},
        )
    for reply, tokens in [(chat, 20), (completion, 5)]:
        metrics = reply["metrics"]
        assert set(metrics) == TIMING_FIELDS
        assert all(metrics[field] >= 0 for field in TIMING_FIELDS)
        assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / (tokens - 1))
        total_ms = metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]
        assert metrics["tokens_per_second"] == pytest.approx(tokens / total_ms * 1000.0)
    assert one["metrics"]["mean_itl_ms"] is None
    assert one["metrics"]["generation_time_ms"] == 0.0


async def test_several_sequences_report_null_and_a_stream_reports_on_its_usage_chunk():
    async with app_client(TIMED) as (client, _):
        several = await _post(client, "/v1/chat/completions", {**CHAT, "n": 2})
        prompts = await _post(
            client,
            "/v1/completions",
            {"model": "tiny", "prompt": ["a b", "c d"], "max_tokens": 3},
        )
        streamed = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        )
        unused = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert several["metrics"] is None and prompts["metrics"] is None
    events = sse_events(streamed.text)[:-1]
    assert [("metrics" in e) for e in events] == [False] * (len(events) - 1) + [True]
    assert set(events[-1]["metrics"]) == TIMING_FIELDS and events[-1]["usage"]
    assert not any("metrics" in e for e in sse_events(unused.text)[:-1])


async def test_a_response_of_the_responses_api_carries_them():
    async with app_client(TIMED) as (client, _):
        reply = await _post(
            client,
            "/v1/responses",
            {"model": "tiny", "input": "Hello", "max_output_tokens": 6, "temperature": 0},
        )
    assert reply["status"] in ("completed", "incomplete")
    assert set(reply["metrics"]) == TIMING_FIELDS


def _counter(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert len(lines) == 1, lines
    return float(lines[0].rsplit(" ", 1)[1])


@pytest.mark.parametrize("level", ["summary", "detailed"])
async def test_verification_steps_add_up_to_the_spec_decode_counters(level: str):
    spec = SpeculativeConfig(3, 1, 3, disable_by_batch_size=8)
    async with app_client(speculative=spec, spec_metrics=level) as (client, _):
        found = []
        for prompt in ["Hello Hello Hello Hello", "world world world", "Hi"]:
            body = {**CHAT, "messages": [{"role": "user", "content": prompt}]}
            found.append((await _post(client, "/v1/chat/completions", body))["metrics"])
        counters = (await client.get("/metrics")).text
    steps = [metrics["speculative_decoding"] for metrics in found]
    assert all(set(metrics) == {"speculative_decoding"} for metrics in found)
    for step in steps:
        assert step["num_spec_tokens"] == 3 and len(step["acceptance_histogram"]) == 4
        assert sum(step["acceptance_histogram"]) == step["num_spec_steps"]
        by_length = step["acceptance_histogram_by_draft_length"]
        assert sum(sum(counts) for counts in by_length.values()) == step["num_spec_steps"]
        if step["num_spec_steps"]:
            assert step["mean_acceptance_length"] == pytest.approx(
                1 + step["num_accepted_draft_tokens"] / step["num_spec_steps"]
            )
        if level == "detailed":
            assert len(step["per_step_drafted"]) == step["num_spec_steps"]
            assert sum(step["per_step_accepted"]) == step["num_accepted_draft_tokens"]
            assert sum(step["per_step_drafted"]) == step["num_draft_tokens"]
        else:
            assert "per_step_accepted" not in step
    assert sum(s["num_spec_steps"] for s in steps) > 0
    for field, counter in [
        ("num_spec_steps", "vllm:spec_decode_num_drafts_total"),
        ("num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total"),
        ("num_accepted_draft_tokens", "vllm:spec_decode_num_accepted_tokens_total"),
    ]:
        assert sum(s[field] for s in steps) == _counter(counters, counter), field


async def test_a_prediction_s_steps_are_reported_without_a_speculative_config():
    async with app_client(spec_metrics="summary") as (client, _):
        plain = await _post(client, "/v1/chat/completions", CHAT)
        assert plain["metrics"] == {"speculative_decoding": None}
        text = plain["choices"][0]["message"]["content"]
        body = {**CHAT, "prediction": {"type": "content", "content": text}}
        predicted = await _post(client, "/v1/chat/completions", body)
    step = predicted["metrics"]["speculative_decoding"]
    details = predicted["usage"]["completion_tokens_details"]
    assert step["num_spec_tokens"] == PREDICTION_DRAFTS
    assert step["num_accepted_draft_tokens"] == details["accepted_prediction_tokens"]
    assert step["num_draft_tokens"] == (
        details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
    )
