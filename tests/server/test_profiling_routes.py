"""vLLM's `/start_profile` and `/stop_profile`, served with `--profiler-config` only: one
profile at a time, its files named in the answer, misuse answered in OpenAI's error shape."""

from __future__ import annotations

from pathlib import Path

from engine.core.profiling import ProfilerConfig
from tests.server_utils import app_client

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


async def test_a_profile_is_started_and_stopped_over_http(tmp_path):
    config = ProfilerConfig("torch", str(tmp_path), torch_profiler_with_stack=False)
    async with app_client(profiler=config) as (client, _):
        assert (await client.post("/start_profile")).json() == {"status": "started"}
        again = await client.post("/start_profile")
        assert again.status_code == 400
        assert again.json()["error"]["code"] == "profiler_running"
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        stopped = (await client.post("/stop_profile")).json()
        assert stopped["status"] == "stopped"
        assert {Path(name).parent for name in stopped["files"]} == {tmp_path}
        assert all(Path(name).stat().st_size > 0 for name in stopped["files"])
        idle = await client.post("/stop_profile")
        assert idle.status_code == 400 and idle.json()["error"]["type"] == "invalid_request_error"


async def test_the_routes_are_not_served_without_the_config():
    async with app_client() as (client, _):
        assert (await client.post("/start_profile")).status_code == 404
        assert (await client.post("/stop_profile")).status_code == 404
