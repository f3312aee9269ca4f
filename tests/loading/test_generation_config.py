"""Sampling defaults from the model's generation_config.json, as vLLM applies them: a request
that leaves a field out takes the model's value, one that sets it keeps its own, `vllm` keeps
OpenAI's defaults, and overrides go on top."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from engine.loading.generation_config import sampling_defaults
from server.cli import build_parser, engine_config
from tests.helpers import tiny_llama
from tests.server_utils import app_client

RECOMMENDED = GenerationConfig(
    do_sample=True,
    temperature=0.7,
    top_p=0.8,
    top_k=20,
    repetition_penalty=1.05,
    max_new_tokens=12,
    eos_token_id=0,
)
FROM_FILE = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_tokens": 12,
}


def recommending():
    model = tiny_llama()
    model.generation_config = RECOMMENDED
    return model


def test_the_models_recommended_fields_become_request_defaults(tmp_path):
    assert sampling_defaults("auto", recommending()) == FROM_FILE
    assert sampling_defaults("auto", tiny_llama()) == {}  # a config that recommends nothing
    assert sampling_defaults("vllm", recommending()) == {}
    RECOMMENDED.save_pretrained(tmp_path)
    assert sampling_defaults(str(tmp_path), tiny_llama()) == FROM_FILE
    overridden = sampling_defaults("auto", recommending(), {"temperature": 0.2, "min_p": 0.1})
    assert overridden == {**FROM_FILE, "temperature": 0.2, "min_p": 0.1}
    assert sampling_defaults("vllm", recommending(), {"max_new_tokens": 5}) == {"max_tokens": 5}


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        ({"temperture": 0.5}, "sets temperture"),
        ({"top_p": 0}, "top_p of 0 is out of range"),
        ({"top_k": 2.5}, "top_k is not a number"),
        ({"max_new_tokens": 0}, "max_tokens of 0 is out of range"),
        ({"temperature": "hot"}, "temperature is not a number"),
    ],
)
def test_defaults_that_no_request_could_send_are_refused_at_start_up(overrides, refusal):
    with pytest.raises(ValueError, match=refusal):
        sampling_defaults("vllm", None, overrides)
    with pytest.raises(ValueError, match="no_such_folder"):
        sampling_defaults("/no_such_folder", None)


async def rendered(client, **fields) -> dict:
    body = {"prompt": [5, 9, 33], **fields}
    response = await client.post("/v1/completions/render", json=body)
    assert response.status_code == 200, response.text
    return response.json()[0]["sampling_params"]


async def test_a_request_takes_the_models_defaults_where_it_leaves_fields_out():
    async with app_client(model=recommending()) as (client, _):
        # A completion's max_tokens defaults to 16 (OpenAI's); null leaves it to the model.
        left_out = await rendered(client, max_tokens=None)
        assert {key: left_out[key] for key in FROM_FILE} == FROM_FILE
        assert (await rendered(client))["max_tokens"] == 16
        own = await rendered(client, temperature=0, top_k=-1, max_tokens=3)
        assert (own["temperature"], own["top_k"], own["max_tokens"]) == (0, -1, 3)
        assert own["top_p"] == 0.8
        chat = await client.post(
            "/v1/chat/completions/render",
            json={"messages": [{"role": "user", "content": "hi"}]},
        )
        chat_params = chat.json()["sampling_params"]
        assert {key: chat_params[key] for key in FROM_FILE} == FROM_FILE
    async with app_client(model=recommending(), generation_config="vllm") as (client, _):
        plain = await rendered(client, max_tokens=None)
        assert (plain["temperature"], plain["top_p"], plain["top_k"]) == (1.0, 1.0, 0)
        assert plain["max_tokens"] is None


def test_the_command_line_takes_vllms_flags():
    args = build_parser().parse_args(
        ["serve", "--generation-config", "vllm", "--override-generation-config", '{"top_k": 5}']
    )
    config = engine_config(args)
    assert (config.generation_config, config.override_generation_config) == ("vllm", {"top_k": 5})
    assert engine_config(build_parser().parse_args(["serve"])).generation_config == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--override-generation-config", "[1]"])
