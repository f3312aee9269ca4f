"""Hostile requests beside four normal streams: the hostile one gets its 4xx (or a correct 200),
the victims finish with the tokens they get alone, and the server stays healthy with every KV
block back in the pool."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.server_utils import app_client, blocks_in_use, sse_events, wait_until_idle

VICTIM = {"max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True}
# Formats sent as JSON text, which the body's own parser does not hold to its nesting limit.
DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
DEEP_TAG = (
    '{"format": ' + '{"type": "or", "elements": [' * 600 + '{"type": "any_text"}' + "]}" * 600 + "}"
)
HOSTILE: list[tuple[str, dict[str, Any] | bytes, int]] = [
    ("top_k past int64", {"prompt": "Hi", "max_tokens": 4, "top_k": 2**63, "temperature": 1}, 200),
    ("temperature that underflows", {"prompt": "Hi", "max_tokens": 4, "temperature": 1e-38}, 200),
    ("many long stop strings", {"prompt": "Hi", "max_tokens": 4, "stop": ["x" * 3000] * 100}, 400),
    ("thousands of prompts", {"prompt": ["Hi"] * 4000, "max_tokens": 1}, 400),
    ("lone surrogate", b'{"prompt": "\\ud800", "max_tokens": 2}', 400),
    (
        "huge logit_bias",
        {"prompt": "Hi", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(2000)}},
        400,
    ),
    ("n in the billions", {"prompt": "Hi", "max_tokens": 2, "n": 10**9}, 400),
    ("negative max_tokens", {"prompt": "Hi", "max_tokens": -1}, 400),
    ("token id past the vocabulary", {"prompt": [1, 2, 10**12], "max_tokens": 2}, 400),
    ("penalty out of range", {"prompt": "Hi", "max_tokens": 2, "presence_penalty": 1e308}, 400),
    ("logprobs past the limit", {"prompt": "Hi", "max_tokens": 2, "logprobs": 10**6}, 400),
    ("schema nested 5000 deep", {"prompt": "Hi", "max_tokens": 2, "guided_json": DEEP_SCHEMA}, 400),
    (
        "deep schema with a JSON option",
        {
            "prompt": "Hi",
            "max_tokens": 2,
            "structured_outputs": {"json": DEEP_SCHEMA, "disable_additional_properties": True},
        },
        400,
    ),
    (
        "structural tag nested 600 deep",
        {"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"structural_tag": DEEP_TAG}},
        400,
    ),
]


async def victim_tokens(client, i: int) -> list[str]:
    async with client.stream(
        "POST", "/v1/completions", json={"prompt": f"Story {i}:", **VICTIM}
    ) as reply:
        assert reply.status_code == 200
        body = "".join([chunk async for chunk in reply.aiter_text()])
    events = sse_events(body)
    assert not any("error" in e for e in events[:-1] if isinstance(e, dict)), events
    return [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]


async def send(client, body: dict[str, Any] | bytes):
    if isinstance(body, bytes):
        return await client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    return await client.post("/v1/completions", json=body)


@pytest.mark.parametrize(("name", "body", "status"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_a_hostile_request_hurts_no_other_stream(name, body, status):
    async with app_client() as (client, engine):
        alone = [await victim_tokens(client, i) for i in range(4)]
        *victims, hostile = await asyncio.gather(
            *(victim_tokens(client, i) for i in range(4)), send(client, body)
        )
        assert hostile.status_code == status, hostile.text
        if status >= 400:
            assert set(hostile.json()["error"]) == {"message", "type", "param", "code"}
        assert victims == alone
        assert (await client.get("/health")).status_code == 200
        await wait_until_idle(engine)
        assert blocks_in_use(engine) == 0
