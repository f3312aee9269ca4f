"""The routes a router in front of many replicas reads: load, server and model info, the
prefix-cache flush, and the adapter gauge the Gateway API Inference Extension scrapes."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from server.settings import ServerSettings
from tests.server_utils import app_client, until, wait_until_idle

PROMPT = "the quick brown fox jumps over the lazy dog " * 4


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_load_counts_the_requests_in_the_engine():
    async with app_client() as (client, engine):
        assert (await client.get("/get_load")).json() == {"load": 0}
        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
        running = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)]
        await until(lambda: engine.num_unfinished == 3, what="three requests in the engine")
        assert (await client.get("/get_load")).json() == {"load": 3}
        assert (await client.get("/load")).json() == {"server_load": 3}
        await asyncio.gather(*running)
        assert (await client.get("/get_load")).json() == {"load": 0}


async def test_server_and_model_info_describe_the_replica():
    async with app_client() as (client, _):
        info = (await client.get("/get_server_info")).json()
        assert info["served_model_name"] == "tiny"
        assert info["block_size"] == info["kv_block_size"] == 4
        assert info["num_gpu_blocks"] == 256
        assert info["dtype"] == "float32"
        assert info["max_model_len"] == 512
        model = (await client.get("/get_model_info")).json()
        assert model["served_model_name"] == "tiny"
        assert model["is_generation"] is True


async def test_flushing_the_prefix_cache_forgets_cached_prompts():
    async with app_client(enable_prefix_caching=True) as (client, engine):
        body = {"prompt": PROMPT, "max_tokens": 2}
        await client.post("/v1/completions", json=body)
        again = (await client.post("/v1/completions", json=body)).json()
        assert cached_tokens(again) > 0
        for path in ("/flush_cache", "/reset_prefix_cache"):
            flushed = await client.post(path)
            assert flushed.status_code == 200
            assert flushed.json()["status"] == "ok"
            after = (await client.post("/v1/completions", json=body)).json()
            assert cached_tokens(after) == 0
        assert (await client.post("/flush_cache")).json()["forgotten_blocks"] > 0
        await wait_until_idle(engine)
        engine.core.scheduler.block_manager.check_invariants()


async def test_a_flush_leaves_running_requests_their_blocks():
    async with app_client(enable_prefix_caching=True) as (client, engine):
        body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        alone = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        await client.post("/flush_cache")
        running = asyncio.create_task(client.post("/v1/completions", json=body))
        await until(lambda: engine.core.has_unfinished(), what="a running request")
        await client.post("/flush_cache")
        assert (await running).json()["choices"][0]["text"] == alone
        await wait_until_idle(engine)
        engine.core.scheduler.block_manager.check_invariants()


async def test_the_flush_needs_the_api_key_and_the_load_stays_open():
    """vllm-router polls /get_load without the key (a replica it cannot read is unhealthy to
    it); the count is on /metrics, open too."""
    settings = ServerSettings(served_model_name="tiny", api_key="secret")
    async with app_client(settings) as (client, _):
        assert (await client.post("/flush_cache")).status_code == 401
        assert (await client.get("/get_server_info")).status_code == 401
        key = {"Authorization": "Bearer secret"}
        assert (await client.post("/flush_cache", headers=key)).status_code == 200
        assert (await client.get("/get_load")).json() == {"load": 0}
        assert (await client.get("/load")).json() == {"server_load": 0}


async def test_the_adapter_gauge_says_no_adapters():
    async with app_client() as (client, _):
        await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["vllm:lora_requests_info"].samples
    assert sample.labels == {
        "max_lora": "0",
        "waiting_lora_adapters": "",
        "running_lora_adapters": "",
    }
    assert sample.value > 1.7e9  # when it was last updated, in seconds since the epoch


async def test_completion_render_gives_each_prompt_s_tokens_and_its_sampling_params():
    async with app_client() as (client, _):
        body = {"prompt": ["Hello there", "Bye"], "max_tokens": 7, "temperature": 0.5}
        rendered = (await client.post("/v1/completions/render", json=body)).json()
        assert [r["model"] for r in rendered] == ["tiny", "tiny"]
        for text, one in zip(body["prompt"], rendered, strict=True):
            tokens = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
            assert one["token_ids"] == tokens
            assert one["sampling_params"]["max_tokens"] == 7
            assert one["sampling_params"]["temperature"] == 0.5
        assert rendered[0]["request_id"] != rendered[1]["request_id"]
        ids = (await client.post("/v1/completions/render", json={"prompt": [5, 6, 7]})).json()
        assert ids[0]["token_ids"] == [5, 6, 7]


async def test_chat_render_gives_the_templated_prompt_s_tokens():
    async with app_client() as (client, _):
        messages = [{"role": "user", "content": "Hi there"}]
        rendered = await client.post(
            "/v1/chat/completions/render", json={"messages": messages, "max_tokens": 3}
        )
        tokenized = await client.post(
            "/tokenize", json={"messages": messages, "add_generation_prompt": True}
        )
        assert rendered.json()["token_ids"] == tokenized.json()["tokens"]
        assert rendered.json()["sampling_params"]["max_tokens"] == 3


async def test_render_refuses_what_the_request_itself_would_refuse():
    async with app_client() as (client, _):
        too_long = await client.post("/v1/completions/render", json={"prompt": "hi " * 5000})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["param"] == "prompt"
        wrong_model = await client.post(
            "/v1/chat/completions/render",
            json={"model": "other", "messages": [{"role": "user", "content": "x"}]},
        )
        assert wrong_model.status_code == 404
