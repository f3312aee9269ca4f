"""Structured outputs through the engine on a random-weight model: whatever the weights, the text
follows the format asked for (a JSON Schema, any JSON object, a regex, a choice, a grammar),
and a request without a format beside them is unchanged."""

from __future__ import annotations

import ctypes
import json
import re
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest
import torch

from engine.core.errors import InvalidRequestError
from engine.core.request import FinishReason
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.worker.sampler import _apply_grammars
from tests.helpers import (
    reference_greedy,
    run_all,
    text_of,
    tiny_core,
    tiny_llama,
    tiny_tokenizer,
    tokens_of,
)

PROMPTS = [[5, 9, 33, 2], list(range(40, 70)), [7] * 13]

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 5}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "ok": {"type": "boolean"},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["alpha", "beta", 3, None]},
    # As pydantic writes a discriminated union: `oneOf` of `$ref`s told apart by a constant.
    "union": {
        "$defs": {
            "Cat": {
                "type": "object",
                "properties": {
                    "kind": {"const": "cat"},
                    "lives": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["kind", "lives"],
                "additionalProperties": False,
            },
            "Dog": {
                "type": "object",
                "properties": {
                    "kind": {"const": "dog"},
                    "name": {"type": "string", "maxLength": 5},
                },
                "required": ["kind", "name"],
                "additionalProperties": False,
            },
        },
        "type": "object",
        "properties": {
            "pet": {
                "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                "discriminator": {"propertyName": "kind"},
            }
        },
        "required": ["pet"],
        "additionalProperties": False,
    },
}
# Free strings and numbers have no bound on their length: sampled at temperature 1, a random
# model closes a number soon enough; a string needs a bias toward its closing quote (the grammar
# still decides where a quote may go).
SAMPLED_SCHEMAS = {
    "number": {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["x"],
        "additionalProperties": False,
    },
    "string": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "id": {"type": "integer", "maximum": 99}},
        "required": ["name", "id"],
        "additionalProperties": False,
    },
}


def closing_bias(*chars: str) -> dict[int, float]:
    tokenizer = tiny_tokenizer()
    return {tokenizer.convert_tokens_to_ids(c): 4.0 for c in chars}


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def params(kind: str, spec: str = "", **extra: object) -> SamplingParams:
    defaults: dict = {"max_tokens": 120, "temperature": 1.0, "seed": 7}
    return SamplingParams(structured=StructuredOutputs(kind, spec), **(defaults | extra))


def run(model, sampling: SamplingParams | list[SamplingParams], **core_options: object):
    core, _ = tiny_core(model, **core_options)
    outputs = run_all(core, PROMPTS, sampling)
    return [outputs[f"req-{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(model, name: str, temperature: float) -> None:
    schema = SCHEMAS[name]
    for outputs in run(model, params("json", json.dumps(schema), temperature=temperature)):
        assert outputs[-1].finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(text_of(outputs)), schema)


def test_a_one_of_whose_branches_overlap_is_enforced_as_any_of(model) -> None:
    """As vLLM's default backend does: each document is one of the branches (a `45` is both;
    `oneOf` would refuse it, so its outputs are checked against `anyOf`)."""
    branches = [
        {"type": "integer", "minimum": 0, "maximum": 50},
        {"type": "integer", "minimum": 40, "maximum": 99},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    ]
    spec = json.dumps({"oneOf": branches})
    for temperature in (0.0, 1.0):
        for outputs in run(model, params("json", spec, temperature=temperature)):
            assert outputs[-1].finish_reason == FinishReason.STOP
            jsonschema.validate(json.loads(text_of(outputs)), {"anyOf": branches})


@pytest.mark.parametrize("name", sorted(SAMPLED_SCHEMAS))
def test_unbounded_values_validate(model, name: str) -> None:
    schema = SAMPLED_SCHEMAS[name]
    sampling = params("json", json.dumps(schema), max_tokens=300, logit_bias=closing_bias('"'))
    for outputs in run(model, sampling):
        assert outputs[-1].finish_reason == FinishReason.STOP, text_of(outputs)
        jsonschema.validate(json.loads(text_of(outputs)), schema)


def test_json_object_outputs_an_object(model) -> None:
    """Any object: keys and values of any length. A bias toward the characters that close
    strings and objects keeps them short; the grammar still decides where they may go."""
    bias = closing_bias('"', "}")
    for outputs in run(model, params("json_object", logit_bias=bias, max_tokens=200)):
        assert outputs[-1].finish_reason == FinishReason.STOP, text_of(outputs)
        assert isinstance(json.loads(text_of(outputs)), dict)


def test_regex_outputs_match(model) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for outputs in run(model, params("regex", pattern, max_tokens=40)):
        assert re.fullmatch(pattern, text_of(outputs)), text_of(outputs)


def test_choice_outputs_one_of_the_choices(model) -> None:
    choices = ["yes", "no", "maybe so", 'say "hi"']
    for outputs in run(model, params("choice", json.dumps(choices))):
        assert text_of(outputs) in choices
        assert outputs[-1].finish_reason == FinishReason.STOP


@pytest.mark.parametrize(
    "grammar",
    [
        'start: "(" num (op num)* ")"\nnum: /[0-9]{1,2}/\nop: "+" | "*"',
        'root ::= "(" num (op num)* ")"\nnum ::= [0-9] [0-9]?\nop ::= "+" | "*"',
    ],
    ids=["lark", "gbnf"],
)
def test_grammar_outputs_parse(model, grammar: str) -> None:
    for outputs in run(model, params("grammar", grammar, max_tokens=60)):
        text = text_of(outputs)
        if outputs[-1].finish_reason == FinishReason.STOP:
            assert re.fullmatch(r"\(\d{1,2}([+*]\d{1,2})*\)", text), text
        else:  # out of tokens inside an open expression: a prefix of one
            assert re.fullmatch(r"\((\d{1,2}[+*])*\d{0,2}[+*]?", text), text


def test_a_stop_string_cuts_the_formatted_text(model) -> None:
    """Stop strings still apply: the text ends before the first one, with `stop`."""
    sampling = params("regex", "[a-c]{12}", stop=("b",), max_tokens=40)
    for outputs in run(model, sampling):
        text = text_of(outputs)
        assert re.fullmatch("[ac]{0,12}", text), text  # up to the first b, or all 12
        assert outputs[-1].finish_reason == FinishReason.STOP


def test_running_out_of_tokens_says_length(model) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    for outputs in run(model, params("json", json.dumps(schema), max_tokens=3)):
        assert outputs[-1].finish_reason == FinishReason.LENGTH
        assert len(tokens_of(outputs)) == 3


def test_a_free_request_beside_constrained_ones_is_unchanged(model) -> None:
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    constrained = params("json", json.dumps(SCHEMAS["nested"]))
    outputs = run(model, [free, constrained, constrained])
    assert tokens_of(outputs[0]) == reference_greedy(model, PROMPTS[0], 12)
    for constrained_outputs in outputs[1:]:
        jsonschema.validate(json.loads(text_of(constrained_outputs)), SCHEMAS["nested"])


def test_preempted_requests_keep_their_format(model) -> None:
    """A cache too small for all three: requests are preempted and recomputed mid-document
    (each document at least 40 characters long, however the draws fall)."""
    schema = {
        "type": "object",
        "properties": {
            "note": {"type": "string", "minLength": 40, "maxLength": 48},
            "tags": SCHEMAS["array"]["properties"]["tags"],
        },
        "required": ["note", "tags"],
        "additionalProperties": False,
    }
    core, _ = tiny_core(model, num_blocks=40, block_size=4)
    sampling = params("json", json.dumps(schema), max_tokens=120)
    outputs = run_all(core, [list(range(40, 52))] * 3, sampling)
    assert core.scheduler.num_preemptions > 0
    for request_outputs in outputs.values():
        assert request_outputs[-1].finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(text_of(request_outputs)), schema)


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json", '{"type": "no such type"}', "Invalid"),
        ("json", "[1, 2", "not JSON"),
        ("json", '{"not": {"type": "string"}}', "Unimplemented"),
        ("json", '{"type": "string", "format": "idn-hostname"}', "Unknown format"),
        ("json", '{"type": "string", "pattern": "(?<=a)b"}', "look-around"),
        ("regex", "(unclosed", "Invalid"),
        ("grammar", "start: undefined_rule", "Invalid"),
        ("choice", "[]", "must not be empty"),
        ("choice", '["a", 3]', "list of strings"),
    ],
)
def test_a_format_that_does_not_compile_is_refused(model, kind: str, spec: str, message: str):
    core, _ = tiny_core(model)
    with pytest.raises(InvalidRequestError, match=message) as raised:
        core.add_request("bad", [1, 2, 3], params(kind, spec))
    assert raised.value.param == "structured_outputs"
    assert not core.has_unfinished()


def test_equal_formats_compile_once(model) -> None:
    core, _ = tiny_core(model)
    grammars = core.grammars
    assert grammars is not None
    spec = StructuredOutputs("json", json.dumps(SCHEMAS["nested"]))
    first = grammars.compile(spec)
    assert grammars.compile(StructuredOutputs("json", json.dumps(SCHEMAS["nested"]))) is first
    from_guided_json = StructuredOutputs("json", json.dumps(SCHEMAS["nested"]), "guided_json")
    assert grammars.compile(from_guided_json) is first and len(grammars) == 1
    assert grammars.matcher(spec) is not first


class FixedMask:
    """A matcher that always allows the same tokens."""

    def __init__(self, words: np.ndarray) -> None:
        self.words = words

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        assert size == self.words.nbytes
        ctypes.memmove(pointer, self.words.ctypes.data, size)


def test_the_cpu_kernel_and_torch_apply_the_same_mask() -> None:
    """fp32 logits on the CPU take the C++ pass; others (a GPU's) the torch ops."""
    rng = np.random.default_rng(0)
    vocab = 100
    requests = [
        SimpleNamespace(grammar=None),
        SimpleNamespace(grammar=FixedMask(rng.integers(-(2**31), 2**31 - 1, 4, dtype=np.int32))),
        SimpleNamespace(grammar=FixedMask(np.full(4, -1, dtype=np.int32))),
        SimpleNamespace(grammar=FixedMask(rng.integers(-(2**31), 2**31 - 1, 4, dtype=np.int32))),
    ]
    logits = torch.randn(4, vocab)
    by_kernel, by_torch = logits.clone(), logits.double()
    _apply_grammars(by_kernel, requests)  # type: ignore[arg-type]
    _apply_grammars(by_torch, requests)  # type: ignore[arg-type]
    assert torch.equal(by_kernel, by_torch.float())
    assert torch.equal(by_kernel[[0, 2]], logits[[0, 2]])
    assert torch.isinf(by_kernel[1]).any() and torch.isinf(by_kernel[3]).any()


def test_paused_requests_of_the_priority_policy_keep_their_format(model) -> None:
    """Under the priority policy an urgent request pauses a running one, which resumes later
    where its document stopped."""
    schema = SCHEMAS["array"]
    core, _ = tiny_core(model, max_num_seqs=2, scheduling_policy="priority")
    sampling = params("json", json.dumps(schema), max_tokens=120)
    for i in range(2):
        core.add_request(f"low-{i}", list(range(40, 52)), sampling, priority=5)
    outputs: dict[str, list] = {}

    def step() -> None:
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)

    for _ in range(4):
        step()
    core.add_request("urgent", list(range(60, 70)), sampling, priority=0)
    step()
    paused = [r for r in core.scheduler.waiting if r.request_id.startswith("low")]
    assert paused and paused[0].num_output_tokens > 0  # paused mid-document
    while core.has_unfinished():
        step()
    assert set(outputs) == {"low-0", "low-1", "urgent"}
    for request_outputs in outputs.values():
        assert request_outputs[-1].finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(text_of(request_outputs)), schema)
