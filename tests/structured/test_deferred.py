"""A format that holds only after a marker in the output (a thinking model's `</think>`): the
reasoning before it runs free, the answer after it follows the format."""

from __future__ import annotations

import copy
import re
from dataclasses import replace

from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.structured.deferred import DeferredGrammar
from tests.helpers import run_all, text_of, tiny_core, tiny_llama, tiny_tokenizer, tokens_of

PROMPTS = [[5, 9, 33, 2], list(range(40, 70))]
DIGITS = StructuredOutputs("regex", "[0-9]{3}", after="</think>")


def thinking_setup(**core_options):
    """The tiny tokenizer with `</think>` as one (non-special) token, and a model that has it."""
    tokenizer = copy.deepcopy(tiny_tokenizer())  # the shared one stays as it is
    tokenizer.add_tokens(["</think>"])
    marker = tokenizer.convert_tokens_to_ids("</think>")
    model = tiny_llama(vocab_size=len(tokenizer))
    core, _ = tiny_core(model, tokenizer=tokenizer, **core_options)
    return core, marker


def test_the_format_holds_from_the_marker_on():
    core, marker = thinking_setup()
    # A bias makes the marker the first token; the format then decides every later one.
    params = SamplingParams(
        structured=DIGITS, logit_bias={marker: 100.0}, temperature=1.0, seed=3, max_tokens=30
    )
    for outputs in run_all(core, PROMPTS, params).values():
        text = text_of(outputs)
        assert text.startswith("</think>") and re.fullmatch("[0-9]{3}", text[len("</think>") :])
        assert outputs[-1].finish_reason == "stop"


def test_before_the_marker_the_output_runs_free():
    core, marker = thinking_setup()
    free = SamplingParams(
        temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, logit_bias={marker: -100.0}
    )
    waiting = replace(free, structured=DIGITS)
    expected = run_all(core, PROMPTS, free)
    got = run_all(core, PROMPTS, waiting)
    for request_id, outputs in got.items():
        assert tokens_of(outputs) == tokens_of(expected[request_id])
        assert not re.fullmatch("[0-9]*", text_of(outputs))


def test_overlapped_steps_wait_for_the_marker_s_row():
    """The step that samples the marker is read before the next is scheduled, so the token
    after it already follows the format."""
    in_turn, marker = thinking_setup(async_scheduling=False)
    overlapped, _ = thinking_setup(async_scheduling=True)
    params = SamplingParams(
        structured=DIGITS, logit_bias={marker: 100.0}, temperature=1.0, seed=9, max_tokens=30
    )
    expected = run_all(in_turn, PROMPTS, params)
    got = run_all(overlapped, PROMPTS, params)
    for request_id, outputs in got.items():
        assert text_of(outputs) == text_of(expected[request_id])
        assert re.fullmatch("</think>[0-9]{3}", text_of(outputs))


def test_the_marker_is_found_inside_a_token_that_carries_more():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(["</think>\n"])
    merged = tokenizer.convert_tokens_to_ids("</think>\n")
    deferred = DeferredGrammar(None, "</think>", tokenizer.decode)
    thought = tokenizer("so it goes", add_special_tokens=False)["input_ids"]
    assert not deferred.opens(thought)
    assert deferred.opens([*thought, merged])
