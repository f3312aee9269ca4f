"""vLLM's `cache_salt`: requests share cached prefix blocks only under the same salt (or none), so
one tenant cannot tell from cache hits or response times what another sent; greedy tokens do
not depend on it."""

from __future__ import annotations

from tests.server.test_server_errors import assert_error
from tests.server_utils import app_client, wait_until_idle

PROMPT = "The same long prompt, sent by two tenants, " * 4
MESSAGES = [{"role": "user", "content": PROMPT}]


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_only_requests_under_the_same_salt_share_cached_blocks():
    async with app_client(enable_prefix_caching=True) as (client, engine):

        async def complete(**extra) -> dict:
            body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **extra}
            return (await client.post("/v1/completions", json=body)).json()

        first = await complete(cache_salt="tenant-a")
        assert cached(first) == 0
        assert cached(await complete(cache_salt="tenant-a")) > 0
        assert cached(await complete(cache_salt="tenant-b")) == 0
        assert cached(await complete()) == 0  # no salt is a salt of its own
        assert cached(await complete()) > 0
        again = await complete(cache_salt="tenant-b")
        assert cached(again) > 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        await wait_until_idle(engine)
        engine.core.scheduler.block_manager.check_invariants()


async def test_chat_requests_take_a_salt_too():
    async with app_client(enable_prefix_caching=True) as (client, _):

        async def chat(**extra) -> dict:
            body = {"messages": MESSAGES, "max_tokens": 2, **extra}
            return (await client.post("/v1/chat/completions", json=body)).json()

        await chat(cache_salt="tenant-a")
        assert cached(await chat(cache_salt="tenant-a")) > 0
        assert cached(await chat(cache_salt="tenant-c")) == 0


async def test_an_empty_salt_is_refused():
    async with app_client() as (client, _):
        body = {"prompt": PROMPT, "max_tokens": 2, "cache_salt": ""}
        response = await client.post("/v1/completions", json=body)
        assert_error(response, 400, "cache_salt")
