"""Structural tags: each shape and format kind accepts the texts xgrammar's definition accepts
and refuses the others (checked by feeding a text's tokens to the compiled matcher); through
the engine a random model's output follows a tag it is made to open; a malformed tag is
refused naming the part at fault."""

from __future__ import annotations

import json
import re

import pytest

from engine.core.errors import InvalidRequestError
from engine.core.request import FinishReason
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.structured.compiler import GrammarCompiler
from tests.helpers import (
    format_allows,
    grammar_compiler,
    run_all,
    text_of,
    tiny_core,
    tiny_llama,
)

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"],
    "additionalProperties": False,
}
NUMBER = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return grammar_compiler()


def accepts(compiler: GrammarCompiler, tag: dict, text: str) -> bool:
    """Whether `text`, ended there, is an output the tag allows."""
    return format_allows(compiler, StructuredOutputs("structural_tag", json.dumps(tag)), text)


def fmt(format_: dict) -> dict:
    return {"format": format_}


def tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def schema(value: dict) -> dict:
    return {"type": "json_schema", "json_schema": value}


FUNCTIONS = [
    tag("<function=weather>", schema(CITY), "</function>"),
    tag("<function=count>", schema(NUMBER), "</function>"),
]
LEGACY = {
    "structures": [
        {"begin": "<function=weather>", "schema": CITY, "end": "</function>"},
        {"begin": "<function=count>", "schema": NUMBER, "end": "</function>"},
    ],
    "triggers": ["<function="],
}
TRIGGERED = fmt({"type": "triggered_tags", "triggers": ["<function="], "tags": FUNCTIONS})


@pytest.mark.parametrize("shape", [LEGACY, TRIGGERED], ids=["structures", "format"])
@pytest.mark.parametrize(
    ("text", "allowed"),
    [
        ("any text at all", True),
        ("", True),
        ('<function=weather>{"city": "Paris"}</function>', True),
        ('Let me check. <function=count>{"n": 7}</function> and then some text', True),
        ('<function=count>{"n": 7}</function><function=weather>{"city": "Oslo"}</function>', True),
        ('<function=weather>{"n": 7}</function>', False),  # the wrong schema
        ('<function=unknown>{"n": 7}</function>', False),  # no such tag
        ('<function=count>{"n": 7}', False),  # not closed
        ('<function=count>{"n": 7}</func', False),
    ],
)
def test_triggered_tags(compiler, shape: dict, text: str, allowed: bool) -> None:
    assert accepts(compiler, shape, text) == allowed


CALL = '<function=count>{"n": 1}</function>'


@pytest.mark.parametrize(
    ("flags", "text", "allowed"),
    [
        ({"at_least_one": True}, "plain text", False),
        ({"at_least_one": True}, 'text first <function=count>{"n": 1}</function>', False),
        ({"at_least_one": True}, '<function=count>{"n": 1}</function> then text', True),
        ({"stop_after_first": True}, 'a <function=count>{"n": 1}</function>', True),
        ({"stop_after_first": True}, 'a <function=count>{"n": 1}</function> more', False),
        ({"stop_after_first": True}, "no tag at all", True),
        ({"at_least_one": True, "stop_after_first": True}, CALL, True),
        ({"at_least_one": True, "stop_after_first": True}, "", False),
    ],
)
def test_triggered_tag_flags(compiler, flags: dict, text: str, allowed: bool) -> None:
    shape = fmt({"type": "triggered_tags", "triggers": ["<function="], "tags": FUNCTIONS, **flags})
    assert accepts(compiler, shape, text) == allowed


def test_legacy_at_least_one(compiler) -> None:
    shape = {**LEGACY, "at_least_one": True}
    assert not accepts(compiler, shape, "just text")
    assert accepts(compiler, shape, '<function=count>{"n": 3}</function>')


THINK_THEN_CALL = fmt(
    {
        "type": "sequence",
        "elements": [
            tag("<think>", {"type": "any_text"}, "</think>"),
            {"type": "triggered_tags", "triggers": ["<function="], "tags": FUNCTIONS},
        ],
    }
)


@pytest.mark.parametrize(
    ("text", "allowed"),
    [
        ("<think>hmm, the weather</think>It is sunny.", True),
        ('<think>a call</think><function=count>{"n": 12}</function>', True),
        ("<think></think>", True),
        ("It is sunny.", False),  # the thinking must come first
        ("<think>never closed", False),
        ('<think>x</think><function=count>{"n": "twelve"}</function>', False),
    ],
)
def test_a_sequence_of_thinking_then_calls(compiler, text: str, allowed: bool) -> None:
    assert accepts(compiler, THINK_THEN_CALL, text) == allowed


@pytest.mark.parametrize(
    ("format_", "text", "allowed"),
    [
        ({"type": "const_string", "value": "Answer: "}, "Answer: ", True),
        ({"type": "const_string", "value": "Answer: "}, "Answer:", False),
        ({"type": "regex", "pattern": "[0-9]{2}/[0-9]{2}"}, "12/31", True),
        ({"type": "regex", "pattern": "[0-9]{2}/[0-9]{2}"}, "12-31", False),
        ({"type": "grammar", "grammar": 'root ::= "a" [0-9]+'}, "a42", True),
        ({"type": "grammar", "grammar": 'start: "a" /[0-9]+/'}, "a", False),
        (
            {"type": "or", "elements": [schema(NUMBER), {"type": "const_string", "value": "none"}]},
            "none",
            True,
        ),
        (
            {"type": "or", "elements": [schema(NUMBER), {"type": "const_string", "value": "none"}]},
            '{"n": 5}',
            True,
        ),
        (
            {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": "n="},
                    {"type": "regex", "pattern": "[0-9]+"},
                    {"type": "grammar", "grammar": 'start: ";"'},
                ],
            },
            "n=42;",
            True,
        ),
        (tag("[", {"type": "any_text", "excluded_str": ["bad"]}, "]"), "[all good]", True),
        (tag("[", {"type": "any_text", "excluded_str": ["bad"]}, "]"), "[not bad]", False),
        (tag("[", {"type": "any_text"}, "]"), "[a]b]", False),  # text ends at the first end
        ({"type": "any_text"}, "anything\nat all", True),
        # A line break or tab in a regex, raw or escaped (as `re.escape` writes one).
        ({"type": "regex", "pattern": "a\nb\tc"}, "a\nb\tc", True),
        ({"type": "regex", "pattern": re.escape("a\nb\tc")}, "a\nb\tc", True),
        ({"type": "regex", "pattern": re.escape("a\nb")}, "a\\nb", False),
        ({"type": "regex", "pattern": "[^\n]+\n"}, "line\n", True),
        (
            {"type": "regex", "pattern": "x\\\\\n"},
            "x\\\n",
            True,
        ),  # an escaped backslash, then a break
    ],
)
def test_leaf_and_combined_formats(compiler, format_: dict, text: str, allowed: bool) -> None:
    assert accepts(compiler, fmt(format_), text) == allowed


SEPARATED = {
    "type": "tags_with_separator",
    "separator": ", ",
    "tags": [
        tag('{"name": "weather", "arguments": ', schema(CITY), "}"),
        tag('{"name": "count", "arguments": ', schema(NUMBER), "}"),
    ],
}


@pytest.mark.parametrize(
    ("flags", "text", "allowed"),
    [
        ({}, "", True),
        ({}, '{"name": "count", "arguments": {"n": 1}}', True),
        (
            {},
            '{"name": "count", "arguments": {"n": 1}}, '
            '{"name": "weather", "arguments": {"city": "Rome"}}',
            True,
        ),
        ({}, 'free text {"name": "count", "arguments": {"n": 1}}', False),
        ({"at_least_one": True}, "", False),
        (
            {"stop_after_first": True},
            '{"name": "count", "arguments": {"n": 1}}, {"name": "count", "arguments": {"n": 2}}',
            False,
        ),
    ],
)
def test_tags_with_separator(compiler, flags: dict, text: str, allowed: bool) -> None:
    wrapped = tag("[", {**SEPARATED, **flags}, "]")
    assert accepts(compiler, fmt(wrapped), "[" + text + "]") == allowed


def test_a_special_token_in_a_literal_is_that_token(compiler) -> None:
    """`<eos>` is the tiny tokenizer's special token: the tag's end is the token, and the
    same characters written as text do not close it."""
    shape = fmt(tag("A:", {"type": "any_text"}, "<eos>"))
    tokenizer = compiler._hf_tokenizer
    matcher = compiler.matcher(StructuredOutputs("structural_tag", json.dumps(shape)))
    assert matcher.consume_tokens(tokenizer.encode("A:xyz", add_special_tokens=False))
    spelled = matcher.deep_copy()
    assert matcher.consume_token(tokenizer.eos_token_id)
    assert spelled.consume_tokens([tokenizer.convert_tokens_to_ids(c) for c in "<eos"])
    assert not spelled.is_accepting()


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([1, 2], "structural_tag must be an object"),
        ({"triggers": ["<f"]}, "needs a format, or structures and triggers"),
        (fmt({"type": "xml"}), r"format.type must be one of .*not \"xml\""),
        (fmt({"type": "sequence", "elements": []}), "format.elements must be a non-empty list"),
        (
            fmt({"type": "sequence", "elements": [{"type": "any_text"}, schema(CITY)]}),
            r"format.elements\[0\] \(any_text\) free text must end",
        ),
        (
            fmt({"type": "triggered_tags", "triggers": ["<g"], "tags": FUNCTIONS}),
            r"format.tags\[0\].begin must start with exactly one trigger",
        ),
        (
            {"structures": [{"begin": "<f>", "schema": CITY, "end": "</f>"}], "triggers": [""]},
            r"format.triggers must be non-empty strings",
        ),
        (fmt({"type": "regex", "pattern": "(open"}), "Invalid response_format"),
        (fmt({"type": "json_schema", "json_schema": {"type": "nope"}}), "Invalid response_format"),
        (fmt({"type": "grammar", "grammar": "start: nowhere"}), "Invalid response_format"),
    ],
)
def test_a_malformed_tag_is_refused_naming_the_part(compiler, shape, message: str) -> None:
    spec = StructuredOutputs("structural_tag", json.dumps(shape), "response_format")
    with pytest.raises(InvalidRequestError, match=message) as raised:
        compiler.compile(spec)
    assert raised.value.param == "response_format"


def test_a_random_model_follows_the_tag_it_must_open() -> None:
    """`at_least_one`: the output starts with one of the tags; its JSON follows that tag's
    schema, whatever the weights."""
    shape = fmt(
        {
            "type": "triggered_tags",
            "triggers": ["<function="],
            "tags": FUNCTIONS,
            "at_least_one": True,
            "stop_after_first": True,
        }
    )
    sampling = SamplingParams(
        max_tokens=80,
        temperature=1.0,
        seed=5,
        structured=StructuredOutputs("structural_tag", json.dumps(shape)),
    )
    core, _ = tiny_core(tiny_llama())
    outputs = run_all(core, [[5, 9, 33, 2], list(range(40, 70))], sampling)
    for request_outputs in outputs.values():
        text = text_of(request_outputs)
        assert request_outputs[-1].finish_reason == FinishReason.STOP, text
        found = re.fullmatch(r"<function=(weather|count)>(.*)</function>", text, re.S)
        assert found, text
        document = json.loads(found.group(2))
        assert set(document) == ({"city"} if found.group(1) == "weather" else {"n"})


def test_a_special_token_trigger(compiler) -> None:
    """A trigger that is a special token (`<bos>` here, as Llama's `<|python_tag|>`): text
    runs free until the token, then the structure follows it."""
    shape = {
        "structures": [{"begin": "<bos>[", "schema": {"type": "integer"}, "end": "]"}],
        "triggers": ["<bos>"],
    }
    tokenizer = compiler._hf_tokenizer
    spec = StructuredOutputs("structural_tag", json.dumps(shape))
    for after, allowed in (("[12] done", True), ("[x]", False)):
        matcher = compiler.matcher(spec)
        ids = [
            *tokenizer.encode("hi ", add_special_tokens=False),
            tokenizer.bos_token_id,
            *tokenizer.encode(after, add_special_tokens=False),
        ]
        assert bool(matcher.consume_tokens(ids) and matcher.is_accepting()) == allowed


CONST_BANG = {"type": "const_string", "value": "!"}


@pytest.mark.parametrize(
    ("stop_after_first", "text", "allowed"),
    [
        (False, '<calls>hi <function=count>{"n": 1}</function> bye</calls>!', True),
        (False, "<calls>hi</calls>!", True),
        (False, "<calls>x</calls>extra", False),
        (False, '<calls>a <function=count>{"n": "x"}</function></calls>!', False),
        (True, '<calls>hi <function=count>{"n": 1}</function></calls>!', True),
        (True, '<calls>hi <function=count>{"n": 1}</function> more</calls>!', False),
    ],
)
def test_triggered_tags_inside_a_tag_end_at_its_end(compiler, stop_after_first, text, allowed):
    """The text around triggered tags inside a tag runs to that tag's end, and what follows
    the tag follows it."""
    calls = {
        "type": "triggered_tags",
        "triggers": ["<function="],
        "tags": FUNCTIONS,
        "stop_after_first": stop_after_first,
    }
    shape = {"type": "sequence", "elements": [tag("<calls>", calls, "</calls>"), CONST_BANG]}
    assert accepts(compiler, fmt(shape), text) == allowed
