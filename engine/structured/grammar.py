"""A request's output format as the grammar llguidance compiles: JSON Schemas through its JSON
compiler, regular expressions and choices as regexes and Lark, GBNF grammars converted to Lark.
Nothing here checks that the grammar compiles; `compiler.GrammarCompiler` does, with the
tokenizer."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import StructuredOutputs
from engine.structured.schema_objects import closed_objects

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON as a model writes it: `{"a": 1, "b": [2, 3]}`. Separators are fixed and no other
# whitespace is allowed, so a weak model cannot pad a document with blanks until it runs out
# of tokens. A `oneOf` whose branches may overlap (`integer` and `number`) is enforced as
# `anyOf`, as vLLM's default backend enforces it (disjoint branches, such as a discriminated
# union's, are exact either way).
JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
    "coerce_one_of": True,
}


def grammar_of(spec: StructuredOutputs, special: dict[str, int] | None = None) -> str:
    """llguidance's grammar for `spec`; raises `InvalidRequestError` naming `spec.param` for a
    format that cannot be read (not JSON, not a list of strings, empty). `special` maps the
    tokenizer's special tokens to their ids, for a structural tag's literals."""
    from llguidance import LLMatcher

    if spec.kind == "structural_tag":
        from engine.structured.structural_tag import FormatError, structural_tag_grammar

        try:
            return structural_tag_grammar(spec.spec, special or {})
        except FormatError as error:
            raise InvalidRequestError(f"Invalid {spec.param}: {error}.", param=spec.param) from None

    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "json":
        return LLMatcher.grammar_from_json_schema(_schema(spec), defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        _require(bool(spec.spec), spec, "the regular expression is empty")
        return LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        return LLMatcher.grammar_from_lark(_choice_lark(spec))
    _require(bool(spec.spec.strip()), spec, "the grammar is empty")
    return LLMatcher.grammar_from_lark(lark_of(spec.spec))


def _schema(spec: StructuredOutputs) -> dict[str, Any]:
    """The request's schema, its objects that list their properties closed
    (`engine/structured/schema_objects.py`)."""
    try:
        schema = json.loads(spec.spec)
    except (ValueError, RecursionError) as error:
        raise InvalidRequestError(
            f"Invalid {spec.param}: the JSON Schema is not JSON ({error}).", param=spec.param
        ) from None
    _require(isinstance(schema, dict), spec, "a JSON Schema must be an object")
    try:
        return closed_objects(schema)
    except RecursionError:
        raise InvalidRequestError(
            f"Invalid {spec.param}: the JSON Schema is nested too deeply.", param=spec.param
        ) from None


def _choice_lark(spec: StructuredOutputs) -> str:
    """`start: "a" | "b"`: each choice a literal, JSON's string escapes being Lark's."""
    try:
        choices = json.loads(spec.spec)
    except ValueError:
        choices = None
    _require(
        isinstance(choices, list) and all(isinstance(c, str) for c in choices),
        spec,
        "choice must be a list of strings",
    )
    _require(bool(choices), spec, "choice must not be empty")
    _require(all(choices), spec, "a choice must not be the empty string")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def lark_of(text: str) -> str:
    """Lark as written; GBNF (`root ::= ...`, as llama.cpp and vLLM take it) converted."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import any_to_lark

    return any_to_lark(text)


def _require(ok: bool, spec: StructuredOutputs, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"Invalid {spec.param}: {message}.", param=spec.param)
