"""Every field of a completion and a chat request, each set in turn to each of a set of hostile
values (wrong types, nulls, NaN and infinities, integers past 64 bits, lone surrogates, long
strings, nested lists): each answer is a 200 or a 4xx in OpenAI's error shape, never a 5xx, and
afterwards the server is healthy with every KV block free. The fields come from the request
models, so a field added later is covered too."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server_utils import app_client, wait_until_idle

HOSTILE: list[Any] = [
    None, True, 0, -1, 2**64 + 1, -(2**70), 1.5, 1e308, float("nan"), float("inf"),
    "", "\ud800", "a" * 5000, [], [-1], [[1, 2]], [""], [None], {}, {"a": 1},
    {"type": "json_object"}, "<|im_start|>",
]  # fmt: skip
BASES = {
    "/v1/completions": (CompletionRequest, {"model": "tiny", "prompt": "Hi", "max_tokens": 2}),
    "/v1/chat/completions": (
        ChatCompletionRequest,
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ),
}


def field_names(model: type[BaseModel]) -> list[str]:
    """The names a client writes: each field's alias where it has one."""
    return sorted(field.alias or name for name, field in model.model_fields.items())


def bodies(model: type[BaseModel], base: dict[str, Any]) -> list[str]:
    """`base` with each field set to each hostile value, as JSON text (NaN and infinities
    written as Python's JSON writes them, which the server's reader takes)."""
    return [json.dumps({**base, name: value}) for name in field_names(model) for value in HOSTILE]


@pytest.mark.parametrize("path", sorted(BASES))
async def test_each_field_set_to_each_hostile_value_is_answered_in_openais_shape(path: str):
    model, base = BASES[path]
    async with app_client() as (client, engine):
        for body in bodies(model, base):
            response = await client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code < 500, (body[:300], response.text[:300])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["message"], body[:300]
                assert isinstance(error["type"], str), body[:300]
        await wait_until_idle(engine, timeout=30)
        assert (await client.get("/health")).status_code == 200
