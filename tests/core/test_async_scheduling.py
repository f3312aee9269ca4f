"""Overlapped (async) scheduling: each step is scheduled and launched before the previous one's
tokens reach the host, its last input taken on the device from that step's output. Every request
must get exactly the tokens, text and ends it gets when steps run in turn."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import replace

import pytest

from engine.core.errors import RequestFailedError
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from tests.conftest import CUDA
from tests.core.test_engine_greedy import check_greedy
from tests.core.test_step_isolation import POISON, poison_steps, run_to_end
from tests.helpers import reference_greedy, tiny_core, tiny_llama, tokens_of
from tests.server_utils import app_client

OVERLAP = {"async_scheduling": True}


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 320) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def spy_on_overlap(core) -> list[tuple[str, int]]:
    """Record ("launch", step) and ("result", step) in the order they happen."""
    events: list[tuple[str, int]] = []
    launch = core.runner.launch

    def spy(scheduled):
        step = sum(kind == "launch" for kind, _ in events)
        launched = launch(scheduled)
        events.append(("launch", step))
        result = launched.result

        def traced():
            events.append(("result", step))
            return result()

        launched.result = traced
        return launched

    core.runner.launch = spy
    return events


def placeholders_of(core) -> list[list[str]]:
    """Per step, the requests whose input was taken on the device from the previous step."""
    steps: list[list[str]] = []
    device_ids = core.runner._device_input_ids

    def spy(batch, *rest):
        steps.append(list(batch.placeholder_ids))
        return device_ids(batch, *rest)

    core.runner._device_input_ids = spy
    return steps


def run(core, requests: list[tuple[str, list[int], SamplingParams, str | None]]) -> dict:
    """Add (id, prompt, params, fork_of) and step to the end; each id's outputs."""
    for request_id, prompt, params, fork_of in requests:
        core.add_request(request_id, prompt, params, fork_of=fork_of)
    outputs: dict[str, list] = {request_id: [] for request_id, *_ in requests}
    steps = 0
    while core.has_unfinished():
        for output in core.step():
            outputs[output.request_id].append(output)
        core.scheduler.check_invariants()
        steps += 1
        assert steps < 5_000, "no progress"
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "a block leaked"
    return outputs


def summary(outputs: list) -> tuple:
    """What a client sees of one sequence: tokens, text, end, and logprobs to 4 places."""
    logprobs = [
        (lp.token_id, round(lp.logprob, 4), lp.rank, tuple(t for t, _ in lp.top))
        for o in outputs
        for lp in o.logprobs or []
    ]
    last = outputs[-1]
    return (
        tokens_of(outputs),
        "".join(o.text for o in outputs),
        last.finish_reason,
        last.stop_reason,
        logprobs,
    )


def overlapped_like_in_turn(requests, **core_options) -> tuple[set[str], dict, object]:
    """Run `requests` in turn and overlapped, and require the same outputs. Returns the
    requests whose input was ever taken from the previous step on the device, the outputs
    overlapped, and that core."""
    model = tiny_llama()
    in_turn, _ = tiny_core(model, async_scheduling=False, **core_options)
    overlapped, _ = tiny_core(model, async_scheduling=True, **core_options)
    steps = placeholders_of(overlapped)
    expected, got = run(in_turn, requests), run(overlapped, requests)
    for request_id in expected:
        assert summary(got[request_id]) == summary(expected[request_id]), request_id
    return {request_id for ids in steps for request_id in ids}, got, overlapped


def mixed_requests() -> list[tuple[str, list[int], SamplingParams, str | None]]:
    """Greedy and seeded sampling with the options that end or shape a sequence early."""
    p = prompts(12, seed=3)
    seeded = {"temperature": 0.9, "seed": 11}
    return [
        ("greedy", p[0], SamplingParams(temperature=0, max_tokens=20), None),
        ("seeded", p[1], SamplingParams(max_tokens=24, **seeded), None),
        ("top", p[2], SamplingParams(max_tokens=16, top_k=20, top_p=0.8, **seeded), None),
        ("eos", p[3], SamplingParams(temperature=0, max_tokens=64, min_tokens=5), None),
        ("one", p[4], SamplingParams(temperature=0, max_tokens=1), None),
        ("stop", p[5], SamplingParams(temperature=0, max_tokens=40, stop=("e", "a")), None),
        ("stop-id", p[6], SamplingParams(max_tokens=40, stop_token_ids=(3, 7, 9), **seeded), None),
        ("logprobs", p[7], SamplingParams(temperature=0, max_tokens=8, logprobs=3), None),
        ("prompt-lp", p[8], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2), None),
        ("fork-0", p[9], SamplingParams(max_tokens=12, **seeded), None),
        ("fork-1", p[9], SamplingParams(max_tokens=12, temperature=0.9, seed=12), "fork-0"),
        ("bias", p[10], SamplingParams(temperature=0, max_tokens=10, logit_bias={5: 3.0}), None),
        ("min-p", p[11], SamplingParams(max_tokens=10, min_p=0.2, **seeded), None),
    ]


def test_overlapped_steps_launch_before_the_previous_results_are_read():
    core, _ = tiny_core(tiny_llama(), async_scheduling=True)
    events = spy_on_overlap(core)
    steps = placeholders_of(core)
    run(
        core,
        [
            (f"r{i}", p, SamplingParams(temperature=0, max_tokens=6), None)
            for i, p in enumerate(prompts(4))
        ],
    )
    launches = [step for kind, step in events if kind == "launch"]
    for step in launches[1:]:
        # Step N's results are read only after step N + 1 was launched.
        assert events.index(("launch", step)) < events.index(("result", step - 1))
    assert not steps[0] and all(steps[1:5])


def test_steps_run_in_turn_without_async_scheduling():
    core, info = tiny_core(tiny_llama(), async_scheduling=False)
    events = spy_on_overlap(core)
    placeholders = placeholders_of(core)
    run(core, [("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=5), None)])
    assert events == [(kind, step) for step in range(5) for kind in ("launch", "result")]
    assert not any(placeholders) and not info.async_scheduling


def test_overlapped_greedy_matches_generate():
    core, _ = check_greedy("cpu", **OVERLAP)
    assert core.scheduler.num_preemptions == 0


def test_overlapped_greedy_matches_generate_under_preemption_and_chunking():
    core, chunked = check_greedy(
        "cpu", num_blocks=20, max_model_len=64, max_num_batched_tokens=10, **OVERLAP
    )
    assert core.scheduler.num_preemptions > 0 and any(chunked)


def test_overlapped_outputs_equal_outputs_in_turn():
    taken, got, _ = overlapped_like_in_turn(mixed_requests())
    assert taken
    ends = {summary(outputs)[2] for outputs in got.values()}
    assert ends == {"stop", "length"}  # the stops fired, mid-flight


def test_overlapped_outputs_equal_outputs_in_turn_under_preemption():
    seeded = SamplingParams(max_tokens=30, temperature=0.8, stop_token_ids=(9,))
    requests = [(f"r{i}", p, replace(seeded, seed=i), None) for i, p in enumerate(prompts(10, 5))]
    taken, _, core = overlapped_like_in_turn(requests, num_blocks=24, max_model_len=64)
    assert taken and core.scheduler.num_preemptions > 0


def test_penalties_count_the_token_still_in_flight():
    """Repetition, presence and frequency penalties count each row's pending token on the
    device, so penalised requests overlap and get the tokens they get in turn."""
    seeded = {"temperature": 0.9, "seed": 3, "max_tokens": 24, "ignore_eos": True}
    p = prompts(3, seed=9)
    requests = [
        ("repeat", p[0], SamplingParams(repetition_penalty=1.5, **seeded), None),
        ("presence", p[1], SamplingParams(presence_penalty=1.5, **seeded), None),
        ("frequency", p[2], SamplingParams(frequency_penalty=1.0, min_tokens=4, **seeded), None),
    ]
    taken, _, _ = overlapped_like_in_turn(requests)
    assert taken == {"repeat", "presence", "frequency"}


def test_a_step_sampling_a_grammar_row_is_waited_for():
    """A grammar advances on each token on the host before it allows the next ones: a step
    that samples a constrained row is read before the next is scheduled."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    seeded = {"temperature": 0.9, "seed": 3}
    p = prompts(2, seed=9)
    json_format = StructuredOutputs("json", schema)
    requests = [
        ("json", p[0], SamplingParams(structured=json_format, max_tokens=30, **seeded), None),
        ("free", p[1], SamplingParams(max_tokens=60, ignore_eos=True, **seeded), None),
    ]
    taken, _, _ = overlapped_like_in_turn(requests)
    assert taken == {"free"}  # overlapped once it ran alone


def test_a_prefix_cached_prompt_gives_the_same_tokens_overlapped():
    model = tiny_llama()
    core, _ = tiny_core(model, async_scheduling=True, enable_prefix_caching=True)
    prompt = prompts(1, seed=2)[0] * 3
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = run(core, [("a", prompt, greedy, None)])
    second = run(core, [("b", prompt, greedy, None)])
    assert second["b"][-1].num_cached_tokens > 0
    expected = reference_greedy(model, prompt, 10)
    assert tokens_of(first["a"]) == tokens_of(second["b"]) == expected


def test_an_abort_while_a_step_is_in_flight_leaks_nothing():
    model = tiny_llama()
    core, _ = tiny_core(model, async_scheduling=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    p = prompts(3, seed=4)
    for i, prompt in enumerate(p):
        core.add_request(f"r{i}", prompt, greedy)
    first = core.step() + core.step()
    assert core._in_flight is not None and core._in_flight.scheduled.scheduled
    aborted = core.abort_requests(["r1"])
    assert [o.finish_reason for o in aborted] == ["abort"]
    outputs = run_to_end(core)
    assert "r1" not in outputs
    for i in (0, 2):
        got = tokens_of([o for o in first if o.request_id == f"r{i}"] + outputs[f"r{i}"])
        assert got == reference_greedy(model, p[i], 12)
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert not core.has_unfinished()


def test_a_failing_launch_fails_only_its_culprit(monkeypatch, caplog):
    model = tiny_llama()
    core, _ = tiny_core(model, async_scheduling=True)
    poison_steps(core, monkeypatch)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    p = [[t for t in prompt if t != POISON] or [2] for prompt in prompts(4, seed=6)]
    for i, prompt in enumerate(p):
        core.add_request(f"r{i}", prompt, greedy)
    first = core.step()  # the clean requests are in flight when the poisoned one arrives
    core.add_request("bad", [*p[0], POISON], greedy)
    with caplog.at_level(logging.WARNING, logger="engine.core.engine_core"):
        outputs = run_to_end(core)
    assert outputs["bad"][-1].finish_reason == "error"
    assert isinstance(outputs["bad"][-1].error, RequestFailedError)
    assert "running it again without overlap" in caplog.text
    for i, prompt in enumerate(p):
        got = tokens_of([o for o in first if o.request_id == f"r{i}"] + outputs[f"r{i}"])
        assert got == reference_greedy(model, prompt, 8)
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_results_that_cannot_be_read_fail_their_step_only(monkeypatch, caplog):
    core, _ = tiny_core(tiny_llama(), async_scheduling=True)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    launch, calls = core.runner.launch, []

    def unreadable_second(scheduled):
        launched = launch(scheduled)
        calls.append(1)
        if len(calls) == 2:

            def broken():
                raise RuntimeError("lost the tokens")

            launched.result = broken
        return launched

    monkeypatch.setattr(core.runner, "launch", unreadable_second)
    core.add_request("a", [5, 6, 7], greedy)
    with caplog.at_level(logging.ERROR, logger="engine.core.engine_core"):
        outputs = run_to_end(core)
    assert outputs["a"][-1].finish_reason == "error" and "lost the tokens" in str(
        outputs["a"][-1].error
    )
    assert len(tokens_of(outputs["a"])) == 1  # the first step's token came through
    core.add_request("b", [5, 6, 7], greedy)
    assert len(tokens_of(run_to_end(core)["b"])) == 6  # the engine goes on
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_async_scheduling_is_on_by_default_on_cuda_only():
    from engine.core.config import EngineConfig

    assert EngineConfig().overlaps("cuda") and not EngineConfig().overlaps("cpu")
    assert EngineConfig(tensor_parallel_size=2).overlaps("cuda")
    assert EngineConfig(async_scheduling=True).overlaps("cpu")
    assert not EngineConfig(async_scheduling=False).overlaps("cuda")


async def test_served_completions_are_the_same_with_async_scheduling():
    bodies = [
        {"prompt": f"Hello {i}", "max_tokens": 12, "temperature": 0.7, "seed": i, "n": 2}
        for i in range(6)
    ]
    texts = {}
    for flag in (False, True):
        async with app_client(async_scheduling=flag) as (client, _):
            info = (await client.get("/get_server_info")).json()
            assert info["async_scheduling"] is flag
            replies = await asyncio.gather(
                *[client.post("/v1/completions", json=body) for body in bodies],
                client.post("/v1/completions", json={**bodies[0], "stream": True}),
            )
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            *plain, streamed = replies
            texts[flag] = [
                [(c["text"], c["finish_reason"]) for c in r.json()["choices"]] for r in plain
            ]
            events = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
            assert events and streamed.text.rstrip().endswith("data: [DONE]")
    assert texts[True] == texts[False]


@pytest.mark.parametrize("device", [CUDA])
def test_an_overlapped_launch_never_waits_for_the_device(device):
    """Under torch's sync debug mode any transfer or read that drains the stream inside a
    launch raises: decode steps, greedy and seeded, with logprobs and a stop token, queue
    their work and return."""
    import torch

    core, _ = tiny_core(tiny_llama().to(device), device=device, async_scheduling=True)
    launch = core.runner.launch
    checked = []

    def strict(scheduled):
        if all(item.num_tokens == 1 for item in scheduled.scheduled):
            torch.cuda.set_sync_debug_mode("error")
            checked.append(len(scheduled.scheduled))
        try:
            return launch(scheduled)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    core.runner.launch = strict
    seeded = SamplingParams(temperature=0.8, seed=1, max_tokens=10, logprobs=2)
    requests = [
        ("greedy", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10), None),
        ("seeded", [8, 9], seeded, None),
        ("stop", [10, 11], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(4,)), None),
    ]
    run(core, requests)
    assert checked
