"""LoRA adapters over HTTP as vLLM serves them: a request names one as its `model`, the models
list shows each with the base model as its parent, adapters load and unload while serving where
that is allowed, and the adapter gauge says which run and wait."""

from __future__ import annotations

import argparse
import json

import pytest
from prometheus_client import CollectorRegistry

from engine.core.config import EngineConfig, ServingInfo
from engine.core.stats import StepStats
from server.app import build_app
from server.cli import build_parser, engine_config, parse_lora_module, server_settings
from server.metrics import EngineMetrics
from server.settings import ServerSettings
from tests.helpers import reference_greedy, tiny_llama
from tests.lora.adapters import ATTENTION, MLP, merged, save_adapter
from tests.server_utils import app_client, tiny_engine

PROMPT = [5, 9, 33, 2, 17, 40, 41]
MAX_TOKENS = 8
RUNTIME = ServerSettings(served_model_name="tiny", runtime_lora_updating=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": save_adapter(root / "attn", ATTENTION, seed=1),
        "mlp": save_adapter(root / "mlp", MLP, seed=2, rank=8),
    }


async def completion_tokens(client, model: str) -> tuple[int, dict]:
    """The greedy completion's token ids of PROMPT under `model`, and the reply."""
    response = await client.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    body = response.json()
    if response.status_code != 200:
        return response.status_code, body
    tokens = [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]
    return 200, {"tokens": tokens, "model": body["model"]}


def oracle(path: str | None) -> list[int]:
    return reference_greedy(merged(path) if path else tiny_llama(), PROMPT, MAX_TOKENS)


async def test_a_request_names_its_adapter_as_its_model(adapters):
    modules = tuple(adapters.items())
    async with app_client(enable_lora=True, max_loras=2, lora_modules=modules) as (client, _):
        listed = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [
            ("tiny", None),
            ("attn", "tiny"),
            ("mlp", "tiny"),
        ]
        assert listed[1]["root"] == adapters["attn"]
        for name, path in [("tiny", None), *adapters.items()]:
            status, reply = await completion_tokens(client, name)
            assert status == 200 and reply["model"] == name
            assert reply["tokens"] == oracle(path), name
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "mlp", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert chat.status_code == 200 and chat.json()["model"] == "mlp"
        response = await client.post(
            "/v1/responses", json={"model": "attn", "input": "hi", "max_output_tokens": 3}
        )
        assert response.status_code == 200 and response.json()["model"] == "attn"
        render = await client.post("/v1/completions/render", json={"model": "mlp", "prompt": "a"})
        assert render.json()[0]["model"] == "mlp"
        status, error = await completion_tokens(client, "nope")
        assert status == 404 and error["error"]["code"] == "model_not_found"


async def test_adapters_load_and_unload_while_serving(adapters):
    async with app_client(RUNTIME, enable_lora=True) as (client, engine):
        load = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": adapters["attn"]}
        )
        assert load.status_code == 200
        assert load.text == "Success: LoRA adapter 'attn' added successfully."
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == [
            "tiny",
            "attn",
        ]
        status, reply = await completion_tokens(client, "attn")
        assert status == 200 and reply["tokens"] == oracle(adapters["attn"])
        again = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": adapters["mlp"]}
        )
        assert (
            again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        )
        nowhere = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"}
        )
        assert nowhere.status_code == 400 and nowhere.json()["error"]["param"] == "lora_path"
        base = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": adapters["mlp"]}
        )
        assert base.status_code == 400
        unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
        assert unload.status_code == 200
        assert (await completion_tokens(client, "attn"))[0] == 404
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
        assert gone.status_code == 404
        status, reply = await completion_tokens(client, "tiny")
        assert status == 200 and reply["tokens"] == oracle(None)
        assert engine.core.runner.lora.adapters == {}  # none runs it: its weights are freed


async def test_loading_needs_the_routes_allowed_and_adapters_served(adapters):
    body = {"lora_name": "attn", "lora_path": adapters["attn"]}
    async with app_client(enable_lora=True) as (client, _):
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 404
    async with app_client(RUNTIME) as (client, _):
        refused = await client.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == 400 and "--enable-lora" in refused.json()["error"]["message"]


def test_the_adapter_gauge_holds_one_series_naming_running_and_waiting_adapters():
    registry = CollectorRegistry()
    info = ServingInfo("tiny", 128, "float32", "cpu", 16, 4, max_loras=2)
    metrics = EngineMetrics(registry, "tiny", info)

    def labels() -> list[dict[str, str]]:
        family = next(f for f in registry.collect() if f.name == "vllm:lora_requests_info")
        return [sample.labels for sample in family.samples]

    assert labels() == [{"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}]
    metrics.record(StepStats(2, 1, 0.1, running_loras=("a", "b"), waiting_loras=("c",)))
    assert labels() == [
        {"max_lora": "2", "waiting_lora_adapters": "c", "running_lora_adapters": "a,b"}
    ]
    metrics.record(StepStats(0, 0, 0.0, running_loras=(), waiting_loras=()))
    assert labels() == [{"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}]


def test_the_command_line_takes_vllms_lora_flags(tmp_path):
    assert parse_lora_module("sql=/adapters/sql") == ("sql", "/adapters/sql")
    spec = {"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}
    assert parse_lora_module(json.dumps(spec)) == ("sql", "/adapters/sql")
    for bad in ["sql", "=path", "sql=", '{"name": "sql"}', "{not json"]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
    args = build_parser().parse_args(
        [
            "serve",
            "--enable-lora",
            "--lora-modules",
            "a=/x",
            "b=/y",
            "--max-loras",
            "3",
            "--max-lora-rank",
            "32",
            "--allow-runtime-lora-updating",
        ]
    )
    config = engine_config(args)
    assert config.enable_lora and config.lora_modules == (("a", "/x"), ("b", "/y"))
    assert (config.max_loras, config.max_lora_rank) == (3, 32)
    assert server_settings(args).runtime_lora_updating


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"lora_modules": (("a", "/x"),)}, "needs --enable-lora"),
        ({"enable_lora": True, "tensor_parallel_size": 2}, "one device"),
        ({"enable_lora": True, "runner": "pooling"}, "generating runner"),
        ({"enable_lora": True, "model_impl": "transformers"}, "Conveyor's model"),
        ({"enable_lora": True, "lora_modules": (("a", "/x"), ("a", "/y"))}, "each adapter once"),
        ({"enable_lora": True, "max_loras": 0}, "at least 1"),
    ],
)
def test_what_adapters_cannot_run_with_is_refused_before_loading(options, refusal):
    with pytest.raises(ValueError, match=refusal):
        EngineConfig(**options)


def test_an_adapter_may_not_take_the_served_models_name(adapters):
    engine = tiny_engine(enable_lora=True, lora_modules=(("tiny", adapters["attn"]),))
    with pytest.raises(ValueError, match="'tiny' has the served model's name"):
        build_app(engine, ServerSettings(served_model_name="tiny"))
