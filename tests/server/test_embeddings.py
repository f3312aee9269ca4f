"""/v1/embeddings under the pooling runner: each input's last hidden state as transformers'
model computes it, L2-normalized, as floats or as the base64 the OpenAI SDK asks for; the
generation routes refused there, and embeddings refused by a generating server."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from openai import AsyncOpenAI

from server.settings import ServerSettings
from tests.core.test_pooling import last_hidden
from tests.helpers import tiny_tokenizer
from tests.server_utils import app_client, blocks_in_use, shared_tiny_model

TEXTS = ["The quick brown fox", "Paged attention stores keys", "The quick brown fox"]


def expected(text: str, add_special_tokens: bool = True) -> torch.Tensor:
    ids = tiny_tokenizer().encode(text, add_special_tokens=add_special_tokens)
    return torch.nn.functional.normalize(last_hidden(shared_tiny_model(), ids), dim=0)


async def test_each_input_is_its_normalized_last_hidden_state():
    async with app_client(runner="pooling") as (client, engine):
        response = await client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and body["model"] == "tiny"
        assert [item["index"] for item in body["data"]] == [0, 1, 2]
        for item, text in zip(body["data"], TEXTS, strict=True):
            assert item["object"] == "embedding"
            vector = torch.tensor(item["embedding"])
            torch.testing.assert_close(vector, expected(text), atol=1e-4, rtol=1e-4)
        prompt_tokens = sum(len(tiny_tokenizer().encode(t)) for t in TEXTS)
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
        assert blocks_in_use(engine) == 0


async def test_the_openai_sdk_reads_base64_embeddings():
    async with app_client(runner="pooling") as (client, _):
        api = AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=client)
        result = await api.embeddings.create(model="tiny", input=TEXTS[:2])
        for item, text in zip(result.data, TEXTS[:2], strict=True):
            torch.testing.assert_close(
                torch.tensor(item.embedding), expected(text), atol=1e-4, rtol=1e-4
            )
        raw = await client.post("/v1/embeddings", json={"input": "hi", "encoding_format": "base64"})
        decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
        torch.testing.assert_close(torch.from_numpy(decoded.copy()), expected("hi"))


async def test_dimensions_token_ids_and_raw_states():
    async with app_client(runner="pooling") as (client, _):
        ids = tiny_tokenizer().encode("The quick brown fox")
        short = await client.post("/v1/embeddings", json={"input": ids, "dimensions": 16})
        vector = torch.tensor(short.json()["data"][0]["embedding"])
        full = last_hidden(shared_tiny_model(), ids)
        torch.testing.assert_close(
            vector, torch.nn.functional.normalize(full[:16], dim=0), atol=1e-4, rtol=1e-4
        )
        raw = await client.post("/v1/embeddings", json={"input": [ids], "normalize": False})
        torch.testing.assert_close(
            torch.tensor(raw.json()["data"][0]["embedding"]), full, atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "dimensions": 65}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x " * 600}, "input"),
    ],
)
async def test_bad_inputs_are_refused_by_name(body, param):
    async with app_client(runner="pooling") as (client, engine):
        response = await client.post("/v1/embeddings", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert blocks_in_use(engine) == 0


async def test_each_runner_refuses_the_others_routes():
    async with app_client(runner="pooling") as (client, _):
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        refused = await client.post("/v1/chat/completions", json=chat)
        assert refused.status_code == 400 and "/v1/embeddings" in refused.json()["error"]["message"]
        for route, body in (
            ("/v1/completions", {"prompt": "Hi"}),
            ("/v1/responses", {"input": "Hi"}),
        ):
            assert (await client.post(route, json=body)).status_code == 400
    async with app_client(ServerSettings(served_model_name="tiny")) as (client, _):
        refused = await client.post("/v1/embeddings", json={"input": "Hi"})
        assert (
            refused.status_code == 400 and "--runner pooling" in refused.json()["error"]["message"]
        )


def test_the_flag_reaches_the_engine():
    from server.cli import build_parser, engine_config

    assert (
        engine_config(build_parser().parse_args(["serve", "--runner", "pooling"])).runner
        == "pooling"
    )
    assert engine_config(build_parser().parse_args(["serve"])).runner == "generate"
