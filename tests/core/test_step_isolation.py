"""A step that raises fails only the requests that make it fail: the rest of the batch goes on
with exactly the tokens it would have had (where the model keeps recurrent states, which a failed
run may have advanced, by recomputing those that ran on from theirs)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.core.errors import RequestFailedError
from engine.core.sampling_params import SamplingParams
from tests.helpers import reference_greedy, tiny_core, tiny_llama, tokens_of
from tests.models import test_lfm2, test_nemotron_h
from tests.server_utils import app_client

POISON = 13  # a prompt holding this token makes any step that runs it raise
PROMPTS = [[5, 9, 33, 2], [40, 41, 42, 43, 44, 45], [7] * 9, [60, 61, 62], [80, 81]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def poison_steps(core, monkeypatch) -> list[int]:
    """Wrap the runner: a step that runs a poisoned prompt raises. Returns each call's size."""
    launch, sizes = core.runner.launch, []

    def guarded(scheduled):
        sizes.append(len(scheduled.scheduled))
        if any(POISON in item.request.prompt_token_ids for item in scheduled.scheduled):
            raise RuntimeError("Overflow when unpacking long long")
        return launch(scheduled)

    monkeypatch.setattr(core.runner, "launch", guarded)
    return sizes


def run_to_end(core) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while core.has_unfinished():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        core.scheduler.check_invariants()
    return outputs


@pytest.mark.parametrize("poisoned", [[0], [3], [1, 4]])
def test_only_the_culprits_fail_and_the_rest_keep_their_tokens(monkeypatch, caplog, poisoned):
    model = tiny_llama()
    core, _ = tiny_core(model)
    sizes = poison_steps(core, monkeypatch)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", [*prompt, POISON] if i in poisoned else prompt, GREEDY)
    with caplog.at_level(logging.WARNING, logger="engine.core.engine_core"):
        outputs = run_to_end(core)
    for i, prompt in enumerate(PROMPTS):
        last = outputs[f"r{i}"][-1]
        if i in poisoned:
            assert last.finish_reason == "error" and isinstance(last.error, RequestFailedError)
            assert "Overflow when unpacking long long" in str(last.error)
        else:
            assert last.error is None and last.finish_reason == "length"
            assert tokens_of(outputs[f"r{i}"]) == reference_greedy(model, prompt, 8)
    assert sizes[0] == len(PROMPTS)  # one step ran them all, then the halves
    assert "running it again in halves" in caplog.text
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_a_step_no_single_request_explains_still_fails_everything(monkeypatch, caplog):
    core, _ = tiny_core(tiny_llama())

    def broken(scheduled):
        raise RuntimeError("device lost")

    monkeypatch.setattr(core.runner, "launch", broken)
    for i, prompt in enumerate(PROMPTS[:3]):
        core.add_request(f"r{i}", prompt, GREEDY)
    with caplog.at_level(logging.ERROR, logger="engine.core.engine_core"):
        outputs = core.step()
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    assert all(o.finish_reason == "error" and "device lost" in str(o.error) for o in outputs)
    assert caplog.text.count("the model step failed for request") == 3
    assert not core.has_unfinished()


def fail_after_the_forward(core, monkeypatch, request_id: str, after: int) -> None:
    """Wrap the runner: a step that runs `request_id` from its token `after` on raises once the
    model has run (as a step failing in its sampling would)."""
    launch = core.runner.launch

    def failing(scheduled):
        launched = launch(scheduled)
        if any(
            i.request.request_id == request_id and i.start >= after for i in scheduled.scheduled
        ):
            launched.result()
            raise RuntimeError("failed after the forward")
        return launched

    monkeypatch.setattr(core.runner, "launch", failing)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
@pytest.mark.parametrize("family", [test_lfm2, test_nemotron_h], ids=["lfm2", "nemotron_h"])
def test_a_recurrent_models_others_are_recomputed_after_a_failed_decode(
    monkeypatch, caplog, family, overlap
):
    """A decode step that fails after the forward has advanced every request's state: running
    the others again from those states would give wrong tokens, so those that ran on from their
    state are recomputed from their tokens, and every request but the culprit ends with exactly
    transformers' tokens."""
    model = family.build()
    core, _ = tiny_core(model, async_scheduling=overlap)
    fail_after_the_forward(core, monkeypatch, "r1", len(PROMPTS[1]) + 2)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(f"r{i}", prompt, GREEDY)
    with caplog.at_level(logging.WARNING, logger="engine.core.engine_core"):
        outputs = run_to_end(core)
    assert outputs["r1"][-1].finish_reason == "error"
    for i, prompt in enumerate(PROMPTS):
        if i != 1:
            assert outputs[f"r{i}"][-1].finish_reason == "length"
            assert tokens_of(outputs[f"r{i}"]) == reference_greedy(model, prompt, 8)
    assert "are recomputed: their recurrent states may have advanced" in caplog.text
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert manager.state_slots is not None and manager.state_slots.num_free == 64


async def test_a_hostile_top_k_is_served_and_hurts_no_other_stream():
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    async with app_client() as (client, _):
        alone = [
            (await client.post("/v1/completions", json={"prompt": f"Hello {i}", **body})).json()[
                "choices"
            ][0]["text"]
            for i in range(4)
        ]
        victims = [
            client.post("/v1/completions", json={"prompt": f"Hello {i}", **body}) for i in range(4)
        ]
        hostile = client.post(
            "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 4, "top_k": 2**63, "temperature": 1},
        )
        *replies, attacker = await asyncio.gather(*victims, hostile)
        assert attacker.status_code == 200, attacker.text
        assert [r.json()["choices"][0]["text"] for r in replies] == alone
