"""The routes an RL trainer drives generation with (`--server-dev-mode`): pause, resume,
is_paused and abort_requests, as vLLM serves them, and SGLang's names for them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.core.config import CacheConfig, EngineConfig
from server.cli import build_parser, server_settings
from server.settings import ServerSettings
from tests.saved_models import saved_llama
from tests.server.test_metrics import scrape
from tests.server_utils import app_client, blocks_in_use, live_server, loaded_client, until

DEV = ServerSettings(served_model_name="tiny", server_dev_mode=True)
BODY = {"model": "tiny", "prompt": "Hello", "temperature": 0, "ignore_eos": True}


async def test_the_routes_are_served_only_in_dev_mode():
    async with app_client() as (client, _):
        assert (await client.post("/pause")).status_code == 404
        assert (await client.get("/is_paused")).status_code == 404
        assert (await client.post("/abort_requests", json={})).status_code == 404


async def test_a_request_made_while_paused_is_answered_after_the_resume():
    async with app_client(DEV) as (client, engine):
        reference = await client.post("/v1/completions", json={**BODY, "max_tokens": 8})
        assert (await client.post("/pause")).json() == {"status": "paused"}
        assert (await client.get("/is_paused")).json() == {"is_paused": True}
        waiting = asyncio.create_task(
            client.post("/v1/completions", json={**BODY, "max_tokens": 8})
        )
        await until(lambda: engine.num_unfinished == 1, what="the request held")
        assert not waiting.done() and not engine.core.has_unfinished()
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/resume")).json() == {"status": "resumed"}
        answer = await waiting
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        assert (await client.get("/is_paused")).json() == {"is_paused": False}


async def test_pause_aborts_a_stream_in_flight_which_ends_cleanly():
    async with live_server(DEV) as server, httpx.AsyncClient(base_url=server.url) as client:
        body = {**BODY, "max_tokens": 400, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            assert (await client.post("/pause?mode=abort")).status_code == 200
            rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
        assert blocks_in_use(server.engine) == 0
        await client.post("/resume")


@pytest.mark.parametrize(
    "query", ["mode=wait", "wait_for_inflight_requests=true&mode=abort", "mode=keep"]
)
async def test_wait_and_keep_let_the_request_finish(query):
    async with app_client(DEV) as (client, engine):
        running = asyncio.create_task(
            client.post("/v1/completions", json={**BODY, "max_tokens": 60})
        )
        await until(lambda: engine.core.has_unfinished(), what="the request running")
        assert (await client.post(f"/pause?{query}")).status_code == 200
        if "keep" in query:
            assert not running.done() and engine.core.has_unfinished()
        else:
            assert not engine.core.has_unfinished()
        await client.post("/resume")
        answer = await running
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        assert blocks_in_use(engine) == 0


async def test_a_bad_mode_is_a_400_in_openai_s_shape():
    async with app_client(DEV) as (client, _):
        response = await client.post("/pause?mode=soon")
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "mode" and error["type"] == "invalid_request_error"
        assert (await client.get("/is_paused")).json() == {"is_paused": False}


async def test_abort_requests_by_the_reply_id_or_all():
    async with app_client(DEV) as (client, engine):
        body = {**BODY, "max_tokens": 400}
        named = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-Request-Id": "mine"})
        )
        other = asyncio.create_task(client.post("/v1/completions", json=body))
        await until(lambda: engine.num_unfinished == 2, what="both requests in the engine")
        aborted = await client.post("/abort_requests", json={"request_ids": ["cmpl-mine"]})
        assert aborted.json() == {"status": "aborted", "aborted": 1}
        answer = await named
        assert answer.json()["id"] == "cmpl-mine"
        assert answer.json()["choices"][0]["finish_reason"] == "abort"
        assert not other.done()
        assert (await client.post("/abort_requests")).json()["aborted"] == 1
        assert (await other).json()["choices"][0]["finish_reason"] == "abort"
        assert blocks_in_use(engine) == 0


async def test_sglang_s_names_pause_continue_and_abort():
    async with app_client(DEV) as (client, engine):
        running = asyncio.create_task(
            client.post("/v1/completions", json={**BODY, "max_tokens": 60})
        )
        await until(lambda: engine.core.has_unfinished(), what="the request running")
        paused = await client.post("/pause_generation", json={"mode": "in_place"})
        assert paused.status_code == 200 and engine.is_paused
        assert engine.core.has_unfinished()  # kept in place
        assert (await client.post("/continue_generation")).status_code == 200
        assert (await running).json()["choices"][0]["finish_reason"] == "length"
        running = asyncio.create_task(
            client.post("/v1/completions", json={**BODY, "max_tokens": 400})
        )
        await until(lambda: engine.num_unfinished == 1, what="the request in the engine")
        aborted = await client.post("/abort_request", json={"abort_all": True})
        assert aborted.json()["aborted"] == 1
        assert (await running).json()["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize(
    ("argv", "env", "on"), [([], "", False), (["--server-dev-mode"], "", True), ([], "1", True)]
)
def test_the_flag_or_its_variable_turns_dev_mode_on(monkeypatch, argv, env, on):
    monkeypatch.setenv("CONVEYOR_SERVER_DEV_MODE", env)
    args = build_parser().parse_args(["serve", *argv])
    assert server_settings(args).server_dev_mode is on


async def test_a_trainer_s_checkpoint_is_served_after_update_weights_from_disk(tmp_path):
    served = saved_llama(tmp_path / "served", with_tokenizer=True, seed=0)
    trained = saved_llama(tmp_path / "trained", seed=3)
    body = {"model": "tiny", "prompt": [5, 9, 33, 2], "max_tokens": 6, "temperature": 0}
    body["ignore_eos"] = True
    config = EngineConfig(model=str(served), dtype="float32", cache=CacheConfig(num_blocks=64))
    async with loaded_client(config, DEV) as (client, _):
        before = (await client.post("/v1/completions", json=body)).json()
        assert (await client.get("/get_weight_version")).json() == {"weight_version": None}
        await client.post("/pause?mode=wait")
        update = {"model_path": str(trained), "weight_version": "v2", "load_format": "auto"}
        answer = await client.post("/update_weights_from_disk", json=update)
        assert answer.status_code == 200 and answer.json()["success"] is True
        await client.post("/resume")
        after = (await client.post("/v1/completions", json=body)).json()
        assert after["choices"][0]["text"] != before["choices"][0]["text"]
        assert (await client.get("/weight_info")).json() == {"weight_version": "v2"}
        bad = await client.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
        assert bad.status_code == 400 and bad.json()["success"] is False
        assert "no config.json" in bad.json()["message"]
        again = (await client.post("/v1/completions", json=body)).json()
        assert again["choices"][0]["text"] == after["choices"][0]["text"]
        renamed = await client.post("/update_weight_version", json={"new_version": "v3"})
        assert renamed.json() == {"success": True, "new_version": "v3"}
        assert (await client.get("/get_weight_version")).json() == {"weight_version": "v3"}


async def sleep_states(client: httpx.AsyncClient) -> dict[str, float]:
    """`vllm:engine_sleep_state`'s series not at 0, by state."""
    series = (await scrape(client))["vllm:engine_sleep_state"]
    return {dict(labels)["sleep_state"]: v for labels, v in series.items() if v}


async def test_sleep_and_wake_up_as_vllm_serves_them(tmp_path):
    folder = saved_llama(tmp_path, with_tokenizer=True)
    config = EngineConfig(
        model=str(folder), dtype="float32", cache=CacheConfig(num_blocks=64), enable_sleep_mode=True
    )
    body = {"model": "tiny", "prompt": [5, 9, 33, 2], "max_tokens": 6, "temperature": 0}
    async with loaded_client(config, DEV) as (client, engine):
        before = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        assert await sleep_states(client) == {"awake": 1.0}
        assert (await client.post("/sleep?level=2")).status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert await sleep_states(client) == {"discard_all": 1.0}
        waiting = asyncio.create_task(client.post("/v1/completions", json=body))
        await until(lambda: engine.num_unfinished == 1, what="the request held")
        assert (await client.post("/wake_up?tags=weights")).status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert not waiting.done()
        bad = await client.post("/wake_up?tags=gpu")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
        assert (await client.post("/wake_up")).status_code == 200
        assert (await waiting).json()["choices"][0]["text"] == before
        assert await sleep_states(client) == {"awake": 1.0}
        refused = await client.post("/sleep?level=0")
        assert refused.status_code == 400 and "level must be 1 or 2" in refused.text
