"""Objects that list their properties are enforced closed (`engine/structured/schema_objects.py`),
as vLLM's default backend, SGLang and llama.cpp's server enforce them: the rule on schemas,
then on compiled formats (a plain JSON format, a structural tag's schema, a pydantic model's)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from engine.core.sampling_params import StructuredOutputs
from engine.structured.compiler import GrammarCompiler
from engine.structured.schema_objects import closed_objects, with_objects
from tests.helpers import format_allows, grammar_compiler

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return grammar_compiler()


def json_format(schema: dict) -> StructuredOutputs:
    return StructuredOutputs("json", json.dumps(schema), "structured_outputs.json")


def test_objects_that_list_properties_are_closed_where_the_schema_says_nothing():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "string"},
            "type": {"type": "object", "properties": {}},
            "free": {"type": "object"},
            "list": {"type": "array", "items": POINT},
            "pair": {"type": "array", "items": [POINT, {"type": "integer"}]},
            "open": {**POINT, "additionalProperties": True},
            "typed": {**POINT, "additionalProperties": {"type": "string"}},
        },
        "$defs": {"d": {"anyOf": [POINT, {"type": "null"}]}},
        "patternProperties": {"^p": {"type": ["object", "null"], "patternProperties": {"q": {}}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["properties"] == {"type": "string"}  # a property's name, not a keyword
    assert props["type"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # any object, as xgrammar's
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["pair"]["items"][0]["additionalProperties"] is False
    assert props["pair"]["items"][1] == {"type": "integer"}
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "string"}
    assert closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["$defs"]["d"]["anyOf"][1]
    assert closed["patternProperties"]["^p"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the original is left alone
    assert "additionalProperties" not in schema["properties"]["type"]


def test_objects_whose_keys_may_come_from_other_schemas_are_left_as_they_are():
    branches = [{"properties": {"a": {}}}, {"properties": {"b": {}}}]
    with_own = closed_objects({"type": "object", "properties": {"k": {}}, "anyOf": branches})
    assert "additionalProperties" not in with_own
    assert all("additionalProperties" not in b for b in with_own["anyOf"])
    union = closed_objects({"anyOf": branches})  # each branch alone is the whole object
    assert all(b["additionalProperties"] is False for b in union["anyOf"])
    merged = closed_objects({"allOf": branches})
    assert all("additionalProperties" not in b for b in merged["allOf"])
    conditional = closed_objects({"properties": {"k": {}}, "if": branches[0], "then": branches[1]})
    assert "additionalProperties" not in conditional
    assert "additionalProperties" not in conditional["if"]
    assert "additionalProperties" not in conditional["then"]
    referenced = closed_objects({"properties": {"k": {}}, "$ref": "#/$defs/x"})
    assert "additionalProperties" not in referenced
    deeper = closed_objects({"allOf": [{"properties": {"inner": POINT}}]})
    assert deeper["allOf"][0]["properties"]["inner"]["additionalProperties"] is False
    uneval = closed_objects({**POINT, "unevaluatedProperties": {"type": "string"}})
    assert "additionalProperties" not in uneval
    expecting_more = [
        {**POINT, "required": ["x", "y"]},
        {"patternProperties": {"^x": {}}, "required": ["xa"]},
        {**POINT, "minProperties": 2},
        {**POINT, "dependentRequired": {"x": ["y"]}},
        {**POINT, "dependencies": {"x": {"properties": {"y": {}}}}},
    ]
    for schema in expecting_more:
        assert "additionalProperties" not in closed_objects(schema)
    many_by_pattern = closed_objects({"patternProperties": {"^x": {}}, "minProperties": 3})
    assert many_by_pattern["additionalProperties"] is False


def test_opened_objects_are_written_open_where_closing_would_close_them():
    opened = with_objects({"type": "object", "properties": {"in": POINT, "free": {}}}, True)
    assert opened["additionalProperties"] is True
    assert opened["properties"]["in"]["additionalProperties"] is True
    assert closed_objects(opened) == opened  # nothing left for the engine to close


def test_a_json_format_holds_the_listed_properties_alone(compiler):
    nested = {**POINT, "properties": {"x": {"type": "integer"}, "in": POINT, "any": {}}}
    spec = json_format(nested)
    assert format_allows(compiler, spec, '{"x": 1, "in": {"x": 2}, "any": {"k": [1]}}')
    assert format_allows(compiler, spec, '{"x": 1}')
    assert not format_allows(compiler, spec, '{"x": 1, "y": 2}')
    assert not format_allows(compiler, spec, '{"x": 1, "in": {"x": 2, "y": 3}}')
    assert format_allows(compiler, json_format({"type": "object"}), '{"k": {"j": 1}}')
    unlisted = json_format({**POINT, "required": ["x", "y"]})  # y: any value, as JSON Schema says
    assert format_allows(compiler, unlisted, '{"x": 1, "y": [2]}')
    anything = StructuredOutputs("json_object", "", "response_format")
    assert format_allows(compiler, anything, '{"k": {"j": 1}}')


def test_a_combined_object_still_takes_the_keys_of_each_part(compiler):
    merged = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    assert format_allows(compiler, json_format(merged), '{"a": 1, "b": 2}')


def test_a_pydantic_models_schema_is_held_to_its_fields(compiler):
    class Address(BaseModel):
        city: str

    class Person(BaseModel):
        name: str
        address: Address | None = None

    spec = json_format(Person.model_json_schema())
    assert format_allows(compiler, spec, '{"name": "Ada", "address": {"city": "Paris"}}')
    assert format_allows(compiler, spec, '{"name": "Ada", "address": null}')
    assert not format_allows(compiler, spec, '{"name": "Ada", "age": 36}')
    assert not format_allows(compiler, spec, '{"name": "Ada", "address": {"city": "P", "n": 1}}')


def test_a_structural_tags_schema_holds_the_listed_properties_alone(compiler):
    tag = {
        "structures": [{"begin": "<p>", "schema": POINT, "end": "</p>"}],
        "triggers": ["<p>"],
        "at_least_one": True,
    }
    spec = StructuredOutputs("structural_tag", json.dumps(tag), "structured_outputs")
    assert format_allows(compiler, spec, '<p>{"x": 1}</p>')
    assert not format_allows(compiler, spec, '<p>{"x": 1, "y": 2}</p>')


PAIR = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}


def test_arrays_that_list_their_first_items_end_after_them():
    assert closed_objects(PAIR)["items"] is False
    older = closed_objects({"type": "array", "items": [{"type": "integer"}]})
    assert older["additionalItems"] is False
    for said in ({"items": {"type": "integer"}}, {"unevaluatedItems": True}):
        assert closed_objects({**PAIR, **said}) == {**PAIR, **said}
    # Asking for more than the list holds, or for an item none of them may be, stays open.
    for more in ({"minItems": 3}, {"contains": {"type": "boolean"}}):
        assert "items" not in closed_objects({**PAIR, **more})
    assert closed_objects({**PAIR, "minItems": 2})["items"] is False
    # Combined with another schema, neither the array nor the other's tuple is closed.
    combined = closed_objects({**PAIR, "anyOf": [PAIR, {"maxItems": 1}]})
    assert "items" not in combined and "items" not in combined["anyOf"][0]
    assert "items" not in closed_objects({"allOf": [PAIR]})["allOf"][0]
    opened = with_objects({"type": "object", "properties": {"p": PAIR}}, True)
    assert opened["properties"]["p"]["items"] is True
    assert closed_objects(opened) == opened


def test_a_json_format_holds_a_tuple_to_its_items(compiler):
    spec = json_format(PAIR)
    assert format_allows(compiler, spec, '[1, "a"]')
    assert format_allows(compiler, spec, "[1]")
    assert not format_allows(compiler, spec, '[1, "a", 3]')
    longer = json_format({**PAIR, "minItems": 3})
    assert format_allows(compiler, longer, '[1, "a", true]')
    older = json_format({"type": "array", "items": [{"type": "integer"}]})
    assert format_allows(compiler, older, "[1]")
    assert not format_allows(compiler, older, "[1, 2]")
    opened = json_format(with_objects(PAIR, True))
    assert format_allows(compiler, opened, '[1, "a", 3]')
