"""`--logits-processors`: a deployment's own processors see every sampled row's logits with the
request's `vllm_xargs` (`engine/worker/logits_processors.py`), before Conveyor's rules; rows
that pass no arguments sample as without them, and greedy rows stop being chosen inside the
model unless every processor keeps the argmax."""

from __future__ import annotations

import pytest

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from tests.helpers import run_all, tiny_core, tokens_of
from tests.server_utils import app_client, shared_tiny_model

EXAMPLES = "tests.worker.processors_example"
PROMPTS = [[5, 9, 13, 17, 21], [30, 31, 32]]


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **fields)


def tokens(core, params: list[SamplingParams]) -> list[list[int]]:
    outputs = run_all(core, PROMPTS, params)
    return [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))]


def test_a_processor_changes_only_the_rows_that_ask_and_runs_before_the_models_choice():
    model = shared_tiny_model()
    plain, _ = tiny_core(model)
    expected = tokens(plain, [greedy(), greedy()])
    core, _ = tiny_core(model, logits_processors=(f"{EXAMPLES}.BanToken",))
    [processor] = core.runner.sampler.processors
    banned = expected[0][0]
    got = tokens(core, [greedy(extra_args={"ban": banned}), greedy()])
    assert banned not in got[0] and got[0] != expected[0]
    assert got[1] == expected[1]  # no arguments: as without the processor
    assert processor.calls > 0
    assert not core.runner.sampler.keeps_argmax


def test_a_processor_may_return_new_logits_and_reads_the_tokens_so_far():
    core, _ = tiny_core(shared_tiny_model(), logits_processors=(f"{EXAMPLES}:EchoLast",))
    got = tokens(core, [greedy(extra_args={"echo": True}), greedy(extra_args={"echo": False})])
    assert got[0] == [PROMPTS[0][-1]] * 6  # each step repeats the last token
    assert got[1] != [PROMPTS[1][-1]] * 6


def test_an_argmax_keeping_processor_leaves_greedy_tokens_as_they_were():
    model = shared_tiny_model()
    plain, _ = tiny_core(model)
    expected = tokens(plain, [greedy(), greedy()])
    core, _ = tiny_core(model, logits_processors=(f"{EXAMPLES}.Scale",))
    assert core.runner.sampler.keeps_argmax
    assert tokens(core, [greedy(), greedy()]) == expected


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("Scale", "give it as package.module.Class"),
        (f"{EXAMPLES}.Missing", "has no attribute 'Missing'"),
        ("tests.worker.no_such_module.Thing", "No module named"),
        (f"{EXAMPLES}.NOT_A_CLASS", "not a class with an apply method"),
    ],
)
def test_a_path_that_names_no_processor_stops_the_start(path, reason):
    with pytest.raises(ValueError, match=reason):
        tiny_core(shared_tiny_model(), logits_processors=(path,))


def test_processors_and_async_scheduling_do_not_run_together():
    with pytest.raises(ValueError, match="drop --async-scheduling"):
        EngineConfig(logits_processors=(f"{EXAMPLES}.Scale",), async_scheduling=True)
    config = EngineConfig(logits_processors=(f"{EXAMPLES}.Scale",))
    assert not config.overlaps("cuda")


async def test_a_requests_vllm_xargs_reach_the_processors():
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    async with app_client() as (client, _):
        plain = await client.post("/v1/completions", json={**body, "return_token_ids": True})
    first = plain.json()["choices"][0]["token_ids"][0]
    async with app_client(logits_processors=(f"{EXAMPLES}.BanToken",)) as (client, _):
        banned = await client.post(
            "/v1/completions",
            json={**body, "return_token_ids": True, "vllm_xargs": {"ban": first}},
        )
        assert banned.status_code == 200, banned.text
        assert first not in banned.json()["choices"][0]["token_ids"]
        nested = await client.post("/v1/completions", json={**body, "vllm_xargs": {"a": {}}})
        assert nested.status_code == 400 and "vllm_xargs" in nested.text
