"""A request whose own rules leave no token to come next (a format and `allowed_token_ids`
outside it, `min_tokens` where only EOS is allowed, a bad word that bans the one allowed token)
fails alone with an error naming those rules, never writing a token they forbid; the other
requests of its steps take their tokens as ever, and every block comes back."""

from __future__ import annotations

import json

import pytest

from engine.core.errors import InvalidRequestError
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.core.speculation import SpeculativeConfig
from tests.helpers import (
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tiny_tokenizer,
    tokens_of,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [5, 6, 7, 8]
OTHER = [9, 10, 11]


def _token(text: str) -> int:
    (token,) = tiny_tokenizer().encode(text, add_special_tokens=False)
    return token


def _error(outputs: list[RequestOutput]) -> InvalidRequestError:
    last = outputs[-1]
    assert last.finished and last.finish_reason == "error"
    assert isinstance(last.error, InvalidRequestError)
    return last.error


def _run_beside_a_plain_request(params: SamplingParams, prompt: list[int] = PROMPT, **options):
    """`params` on `prompt` beside a plain greedy request: the failed request's outputs; the
    plain one's tokens are transformers' and every block is free after."""
    core, _ = tiny_core(tiny_llama(), **options)
    outputs = run_all(core, [prompt, OTHER], [params, GREEDY])
    assert tokens_of(outputs["req-1"]) == reference_greedy(tiny_llama(), OTHER, 12)
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    return outputs["req-0"], core


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_format_and_allowed_tokens_outside_it_fail_the_request_not_its_step(temperature):
    params = SamplingParams(
        temperature=temperature,
        seed=3,
        max_tokens=8,
        structured=StructuredOutputs("choice", json.dumps(["yes", "no"])),
        allowed_token_ids=[_token("Z")],
    )
    outputs, _ = _run_beside_a_plain_request(params)
    assert tokens_of(outputs) == []
    error = _error(outputs)
    assert error.message == (
        "No token may come next after 0 generated tokens: the output format and "
        "allowed_token_ids rule out every token of the vocabulary."
    )
    assert error.param == "allowed_token_ids"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-turn", "overlapped"])
def test_min_tokens_where_only_eos_is_allowed_fails_the_request(async_scheduling):
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=3, allowed_token_ids=[0])
    outputs, _ = _run_beside_a_plain_request(params, async_scheduling=async_scheduling)
    assert tokens_of(outputs) == []
    assert "allowed_token_ids and min_tokens rule out" in _error(outputs).message


@pytest.mark.parametrize("word", ["xx", "xxx", "xxxx"])
def test_a_draft_row_left_no_token_fails_the_request_after_the_tokens_one_a_step_writes(word):
    """The one allowed token may not repeat `len(word)` times (a bad word): verifying the
    drafts finds no token for a row. The request first writes the drafts it kept before that
    row, as a request without drafts writes them one a step, then fails."""
    x = _token("x")
    assert tiny_tokenizer().encode(word, add_special_tokens=False) == [x] * len(word)
    params = SamplingParams(
        temperature=0, max_tokens=8, allowed_token_ids=[x], bad_words=[word], ignore_eos=True
    )
    speculative = SpeculativeConfig(3, 1, 1, disable_by_batch_size=8)
    outputs, core = _run_beside_a_plain_request(params, [x] * 4, speculative=speculative)
    alone, _ = _run_beside_a_plain_request(params, [x] * 4)
    assert tokens_of(outputs) == tokens_of(alone) == [x] * (len(word) - 1)
    assert _error(outputs).message == _error(alone).message
    assert "allowed_token_ids and bad_words" in _error(outputs).message
    kept = core.take_stats().drafts.num_accepted_tokens
    assert kept > 0 if len(word) > 2 else kept == 0  # a row after kept drafts had no token
    assert core.drafter._lengths == {}  # nothing kept of a request that ended
