"""vLLM's `prompt_embeds` (`--enable-prompt-embeds`): a completion's prompt sent as embedding
rows gives transformers' greedy tokens for the same `inputs_embeds`, alone or beside other
requests, cached by the rows' digest; what cannot run on rows gets a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
import torch

from server.settings import ServerSettings
from tests.helpers import transformers_attention
from tests.server_utils import app_client, blocks_in_use, shared_tiny_model, wait_until_idle

ENABLED = ServerSettings(served_model_name="tiny", enable_prompt_embeds=True)
BODY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def rows_of(tokens: list[int], seed: int) -> torch.Tensor:
    """The tokens' embeddings, moved off them: rows no token gives."""
    model = shared_tiny_model()
    with torch.no_grad():
        rows = model.get_input_embeddings()(torch.tensor(tokens)).float()
    noise = torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed))
    return rows + 0.3 * noise


def encoded(rows: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(rows, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def reference(rows: torch.Tensor, count: int = 6) -> list[int]:
    """transformers' greedy tokens after the same `inputs_embeds`."""
    model = shared_tiny_model()
    with transformers_attention(model), torch.no_grad():
        out = model.generate(
            inputs_embeds=rows[None].to(model.dtype),
            attention_mask=torch.ones(1, rows.shape[0], dtype=torch.long),
            do_sample=False,
            max_new_tokens=count,
            min_new_tokens=count,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, -count:].tolist()


async def test_embedded_prompts_give_transformers_tokens_beside_text_prompts():
    first, second = rows_of([5, 9, 33, 2, 40, 41, 42], 1), rows_of(list(range(60, 81)), 2)
    async with app_client(ENABLED, max_num_batched_tokens=8) as (client, engine):
        embedded = client.post(
            "/v1/completions",
            json={**BODY, "prompt_embeds": [encoded(first), encoded(second)]},
        )
        text = client.post("/v1/completions", json={**BODY, "prompt": [7, 8, 9, 10]})
        answers = await asyncio.gather(embedded, text)
        again = await client.post(
            "/v1/completions", json={**BODY, "prompt_embeds": encoded(second)}
        )
        await wait_until_idle(engine)
        assert blocks_in_use(engine) == 0
    for answer in (*answers, again):
        assert answer.status_code == 200, answer.text
    choices = answers[0].json()["choices"]
    assert [c["token_ids"] for c in choices] == [reference(first), reference(second)]
    assert answers[0].json()["usage"]["prompt_tokens"] == 7 + 21
    # The same rows again read their full blocks from the prefix cache, and decode the same.
    assert again.json()["choices"][0]["token_ids"] == reference(second)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 20


async def test_other_rows_behind_the_same_placeholders_miss_the_cache():
    async with app_client(ENABLED) as (client, _):
        rows = rows_of(list(range(60, 81)), 3)
        await client.post("/v1/completions", json={**BODY, "prompt_embeds": encoded(rows)})
        other = await client.post(
            "/v1/completions", json={**BODY, "prompt_embeds": encoded(rows + 0.5)}
        )
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other.json()["choices"][0]["token_ids"] == reference(rows + 0.5)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64 of a tensor"),
        ({"prompt_embeds": base64.b64encode(b"junk").decode()}, "prompt_embeds", "torch.save"),
        ({"prompt_embeds": "EMBEDS", "echo": True}, "echo", "reads the prompt's tokens"),
        ({"prompt_embeds": "EMBEDS", "repetition_penalty": 1.2}, "repetition_penalty", "tokens"),
        ({"prompt_embeds": "EMBEDS", "prompt": "hi"}, "prompt_embeds", "not both"),
        ({"prompt_embeds": "WIDE"}, "prompt_embeds", "this model's width"),
        ({"prompt_embeds": "NAN"}, "prompt_embeds", "must be finite"),
        ({"prompt_embeds": []}, "prompt_embeds", "must not be empty"),
    ],
)
async def test_what_cannot_run_on_rows_is_refused(fields: dict, param: str, message: str):
    rows = rows_of([5, 6, 7], 4)
    stand_ins = {
        "EMBEDS": encoded(rows),
        "WIDE": encoded(torch.zeros(3, rows.shape[1] + 1)),
        "NAN": encoded(torch.full_like(rows, float("nan"))),
    }
    body = {**BODY, **fields}
    if isinstance(body["prompt_embeds"], str):
        body["prompt_embeds"] = stand_ins.get(body["prompt_embeds"], body["prompt_embeds"])
    async with app_client(ENABLED) as (client, engine):
        response = await client.post("/v1/completions", json=body)
        healthy = await client.get("/health")
        assert blocks_in_use(engine) == 0
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert healthy.status_code == 200


async def test_prompt_embeds_need_the_flag():
    async with app_client() as (client, _):
        body = {**BODY, "prompt_embeds": encoded(rows_of([5, 6, 7], 5))}
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert "--enable-prompt-embeds" in response.json()["error"]["message"]


async def test_an_invocation_with_prompt_embeds_is_a_completion():
    rows = rows_of([5, 9, 33, 2], 6)
    async with app_client(ENABLED) as (client, _):
        answer = await client.post("/invocations", json={**BODY, "prompt_embeds": encoded(rows)})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == reference(rows)
