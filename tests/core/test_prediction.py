"""Predicted Outputs: a request's `prediction` drafts its next tokens where the reply follows
it, finds its place again after an edit, and never changes a token (transformers' `generate`
stays the oracle); each request counts the prediction's drafts it kept and refused."""

from __future__ import annotations

import random

import pytest

from engine.core.prediction import Prediction
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import PREDICTION_DRAFTS, SpeculativeConfig
from tests.conftest import CUDA
from tests.helpers import reference_greedy, run_all, tiny_core, tiny_llama, tokens_of

LENGTH = 40


def test_a_reply_that_follows_its_prediction_drafts_what_comes_next():
    prediction = Prediction((5, 6, 7, 8, 9, 10, 11))
    assert prediction.draft([5], 3) == [6, 7, 8]
    assert prediction.draft([5, 6, 7, 8], 2) == [9, 10]
    assert prediction.draft([5, 6, 7, 8, 9, 10, 11], 4) == []  # its end
    assert Prediction((5, 6)).draft([4], 2) == []  # a reply that starts elsewhere: lost


def test_after_an_edit_the_reply_finds_its_place_again_later_on():
    prediction = Prediction((1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9, 9))
    assert prediction.draft([1, 2, 3, 4, 5, 6], 2) == [1, 2]
    assert prediction.draft([1, 2, 3, 4, 5, 6, 8, 8], 2) == []  # an insertion: lost
    # "1 2 3" ends at 3 and at 9: the first place after where the reply was.
    reply = [1, 2, 3, 4, 5, 6, 8, 8, 1, 2, 3]
    assert prediction.draft(reply, 3) == [9, 9, 9]
    # "3 4" ends only before where it was: there, then.
    assert prediction.draft([*reply, 9, 3, 4], 2) == [5, 6]


def test_drafts_always_follow_a_place_where_the_prediction_holds_the_reply_s_last_tokens():
    """Random predictions and replies that follow, edit and leave them, token by token: every
    draft is the prediction's tokens just after a place where it holds the reply's last 2 or
    more tokens (or, while the reply has followed it from the start, all of the reply)."""
    rng = random.Random(7)
    for _ in range(300):
        predicted = tuple(rng.randrange(6) for _ in range(rng.randrange(1, 60)))
        prediction, reply, followed = Prediction(predicted), [], True
        for _ in range(rng.randrange(1, 80)):
            step = rng.random()
            if step < 0.6 and len(reply) < len(predicted):
                reply.append(predicted[len(reply)] if followed else rng.randrange(6))
            else:
                reply.append(rng.randrange(6))
            followed = followed and tuple(reply) == predicted[: len(reply)]
            drafts = prediction.draft(reply, 4)
            if not drafts:
                continue
            end = _start_of(predicted, drafts, reply, followed)
            assert end is not None, (predicted, reply, drafts)


def _start_of(
    predicted: tuple[int, ...], drafts: list[int], reply: list[int], followed: bool
) -> int | None:
    """A place the drafts may follow: the end of the reply's prefix of the prediction, or the
    end of a run of 2+ of the reply's last tokens after which the prediction holds the drafts."""
    if followed and tuple(drafts) == predicted[len(reply) : len(reply) + len(drafts)]:
        return len(reply)
    for end in range(2, len(predicted) + 1):
        if tuple(drafts) != predicted[end : end + len(drafts)]:
            continue
        if predicted[end - 2 : end] == tuple(reply[-2:]):
            return end
    return None


def _prompts(count: int = 4) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(2, 320) for _ in range(rng.randrange(3, 20))] for _ in range(count)]


def _edited(truth: list[int], rng: random.Random) -> list[int]:
    """The true reply with a few tokens changed, some dropped and some inserted."""
    edited = list(truth)
    edited[10:13] = [(t + 1) % 320 for t in edited[10:13]]
    del edited[20:23]
    edited[28:28] = [rng.randrange(2, 320) for _ in range(4)]
    return edited


@pytest.mark.parametrize("kind", ["exact", "edited", "unrelated"])
@pytest.mark.parametrize(
    "options",
    [{}, {"num_blocks": 40, "max_model_len": 80}, {"async_scheduling": True}],
    ids=["plain", "preempted", "async"],
)
def test_greedy_replies_are_generate_s_whatever_the_prediction(kind: str, options: dict):
    model = tiny_llama()
    rng = random.Random(0)
    prompts = _prompts()
    truths = [reference_greedy(model, p, LENGTH) for p in prompts]
    predictions = {
        "exact": truths,
        "edited": [_edited(t, rng) for t in truths],
        "unrelated": [[rng.randrange(2, 320) for _ in range(LENGTH)] for _ in truths],
    }[kind]
    params = [
        SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True, prediction=tuple(p))
        for p in predictions
    ]
    core, _ = tiny_core(tiny_llama(), **options)
    outputs = run_all(core, prompts, params)
    for i, truth in enumerate(truths):
        parts = outputs[f"req-{i}"]
        assert tokens_of(parts) == truth
        kept, refused = parts[-1].num_prediction_kept, parts[-1].num_prediction_refused
        if kind == "exact" and not options:
            assert (kept, refused) == (LENGTH - 1 - _bonus_tokens(LENGTH), 0)
        elif kind == "exact":  # steps short of blocks draft less
            assert kept > LENGTH // 2 and refused == 0
        elif kind == "edited":
            assert kept > LENGTH // 2 and refused > 0
        else:
            assert kept < 4
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


@pytest.mark.parametrize("device", [CUDA])
def test_on_a_gpu_predictions_draft_under_async_scheduling_and_graphs(device: str):
    """On a GPU steps overlap by default: a step that samples a request with a prediction is
    taken before the next is scheduled, so its drafts follow its newest tokens."""
    model = tiny_llama()
    prompts = _prompts()
    truths = [reference_greedy(model, p, LENGTH) for p in prompts]
    params = [
        SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True, prediction=tuple(t))
        for t in truths
    ]
    core, _ = tiny_core(tiny_llama(), device=device)
    assert core.overlap and core.runner.graphs is not None
    outputs = run_all(core, prompts, params)
    for i, truth in enumerate(truths):
        assert tokens_of(outputs[f"req-{i}"]) == truth
        assert outputs[f"req-{i}"][-1].num_prediction_kept > LENGTH // 2


def _bonus_tokens(length: int) -> int:
    """The steps after the first of a reply whose every draft is kept: each writes its drafts
    and one token of its own."""
    return -(-(length - 1) // (PREDICTION_DRAFTS + 1))


def test_an_exact_prediction_writes_the_reply_in_fewer_steps_and_others_are_unchanged():
    model = tiny_llama()
    prompts = _prompts(2)
    truth = reference_greedy(model, prompts[0], LENGTH)
    predicted = SamplingParams(
        temperature=0, max_tokens=LENGTH, ignore_eos=True, prediction=tuple(truth)
    )
    plain = SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True)
    core, _ = tiny_core(tiny_llama())
    core.add_request("predicted", prompts[0], predicted)
    core.add_request("plain", prompts[1], plain)
    finished_at = {}
    steps = 0
    while core.has_unfinished():
        steps += 1
        for output in core.step():
            if output.finished:
                finished_at[output.request_id] = steps
    assert finished_at["predicted"] == 1 + _bonus_tokens(LENGTH)
    assert finished_at["plain"] == LENGTH


def test_seeded_replies_are_those_without_a_prediction_beside_n_gram_speculation():
    """(The tiny model's distributions are flat: at a low temperature the replies stay near
    the greedy ones predicted.)"""
    model = tiny_llama()
    prompts = _prompts()
    truths = [reference_greedy(model, p, LENGTH) for p in prompts]
    unpredicted = [
        SamplingParams(temperature=0.1, seed=5, max_tokens=LENGTH, ignore_eos=True)
    ] * len(prompts)
    plain = run_all(tiny_core(tiny_llama())[0], prompts, unpredicted)
    runs = [{key: tokens_of(parts) for key, parts in plain.items()}]
    for _ in range(2):
        core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(3, 1, 2))
        params = [
            SamplingParams(
                temperature=0.1, seed=5, max_tokens=LENGTH, ignore_eos=True, prediction=tuple(t)
            )
            for t in truths[:2]
        ] + [SamplingParams(temperature=0.1, seed=5, max_tokens=LENGTH, ignore_eos=True)] * 2
        outputs = run_all(core, prompts, params)
        runs.append({key: tokens_of(parts) for key, parts in outputs.items()})
        assert outputs["req-0"][-1].num_prediction_kept > 0
        assert outputs["req-2"][-1].num_prediction_kept == 0
    assert runs[0] == runs[1] == runs[2]  # the same tokens as without predictions
