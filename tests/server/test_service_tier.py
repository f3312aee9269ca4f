"""OpenAI's `service_tier`: "flex" runs a request in the capacity no other request wants (the
batch lane), any other tier as every request runs; a reply names the tier it ran in, where the
request named one."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.server_utils import app_client, live_server, sse_events

CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hello"}],
    "temperature": 0,
    "max_tokens": 4,
}


async def test_a_reply_names_the_tier_it_ran_in_where_the_request_named_one():
    async with app_client() as (client, _):
        replies = {}
        for tier in ["flex", "auto", "priority", None]:
            body = {**CHAT, **({"service_tier": tier} if tier else {})}
            replies[tier] = (await client.post("/v1/chat/completions", json=body)).json()
        streamed = await client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "stream": True}
            | {"service_tier": "flex"},
        )
        response = await client.post(
            "/v1/responses",
            json={"model": "tiny", "input": "Hi", "max_output_tokens": 3, "service_tier": "flex"},
        )
        refused = await client.post("/v1/chat/completions", json={**CHAT, "service_tier": "gold"})
    assert replies["flex"]["service_tier"] == "flex"
    assert replies["auto"]["service_tier"] == replies["priority"]["service_tier"] == "default"
    assert "service_tier" not in replies[None]
    assert all(event["service_tier"] == "flex" for event in sse_events(streamed.text)[:-1])
    assert response.json()["service_tier"] == "flex"
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "service_tier"


async def test_a_flex_request_waits_while_a_default_one_runs():
    """A short flex request sent while a long default one streams ends after it; without the
    tier it would end first."""
    finished: list[str] = []
    async with (
        live_server(max_num_seqs=4) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as client,
    ):
        body = {**CHAT, "max_tokens": 120, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # it runs

            async def flex() -> None:
                reply = await client.post(
                    "/v1/chat/completions", json={**CHAT, "service_tier": "flex"}
                )
                assert reply.status_code == 200
                finished.append("flex")

            task = asyncio.create_task(flex())
            async for _ in lines:
                pass
            finished.append("default")
            await task
    assert finished == ["default", "flex"]
