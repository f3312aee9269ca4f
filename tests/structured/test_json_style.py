"""vLLM's JSON options (`server/json_style.py`): `disable_any_whitespace`,
`disable_additional_properties` and `whitespace_pattern`, per request or for the whole server
(`--structured-outputs-config`), checked on the compiled matcher: which texts the format then
allows."""

from __future__ import annotations

import json

import pytest

from engine.core.sampling_params import StructuredOutputs
from engine.structured.compiler import GrammarCompiler
from server.cli import build_parser, server_settings
from server.json_style import PLAIN, JsonStyle, closed_objects
from server.protocol import ChatCompletionRequest
from server.structured import structured_outputs
from tests.helpers import format_allows, grammar_compiler

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return grammar_compiler()


def spec_of(fields: dict, style: JsonStyle = PLAIN) -> StructuredOutputs:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )
    spec = structured_outputs(body, style)
    assert spec is not None
    return spec


def test_by_default_json_is_written_with_single_spaces_and_open_objects(compiler):
    spec = spec_of({"structured_outputs": {"json": POINT}})
    assert format_allows(compiler, spec, '{"x": 1}')
    assert format_allows(compiler, spec, '{"x": 1, "y": 2}')
    assert not format_allows(compiler, spec, '{"x":1}')


def test_disable_any_whitespace_writes_json_without_blanks(compiler):
    spec = spec_of({"structured_outputs": {"json": POINT, "disable_any_whitespace": True}})
    assert format_allows(compiler, spec, '{"x":1,"y":[1,2]}')
    assert not format_allows(compiler, spec, '{"x": 1}')
    plain = spec_of({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    assert plain.kind == "json"
    assert format_allows(compiler, plain, '{"a":[1,2]}')
    assert not format_allows(compiler, plain, '{"a": [1, 2]}')


def test_disable_additional_properties_closes_objects_the_schema_leaves_open(compiler):
    nested = {
        "type": "object",
        "properties": {"inner": POINT, "any": {"type": "object", "additionalProperties": True}},
        "required": ["inner", "any"],
    }
    spec = spec_of({"structured_outputs": {"json": nested, "disable_additional_properties": True}})
    assert format_allows(compiler, spec, '{"inner": {"x": 1}, "any": {"k": 2}}')
    assert not format_allows(compiler, spec, '{"inner": {"x": 1, "y": 2}, "any": {}}')
    assert not format_allows(compiler, spec, '{"inner": {"x": 1}, "any": {}, "extra": 3}')


def test_a_whitespace_pattern_allows_the_whitespace_it_matches(compiler):
    fields = {"json": POINT, "whitespace_pattern": "[ ]{0,2}"}
    spec = spec_of({"structured_outputs": fields})
    assert format_allows(compiler, spec, '{"x":1}')
    assert format_allows(compiler, spec, '{  "x" :  1}')
    assert not format_allows(compiler, spec, '{\n"x": 1}')


def test_the_servers_style_holds_for_every_field_and_the_request_adds_to_it(compiler):
    argv = ["serve", "--structured-outputs-config", '{"disable_any_whitespace": true}']
    style = server_settings(build_parser().parse_args(argv)).json_style
    assert style == JsonStyle(compact=True)
    schema_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}
    for fields in ({"response_format": schema_format}, {"guided_json": POINT}):
        spec = spec_of(fields, style)
        assert format_allows(compiler, spec, '{"x":1,"y":2}')
        assert not format_allows(compiler, spec, '{"x": 1}')
    closed = spec_of(
        {"structured_outputs": {"json": POINT, "disable_additional_properties": True}}, style
    )
    assert format_allows(compiler, closed, '{"x":1}')
    assert not format_allows(compiler, closed, '{"x":1,"y":2}')


def test_other_formats_are_left_as_they_are():
    regex = spec_of({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}})
    assert regex == StructuredOutputs("regex", "a+", "structured_outputs.regex")


def test_closing_objects_reads_schema_keywords_not_property_names():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "string"},
            "type": {"type": "object", "properties": {}},
            "list": {"type": "array", "items": {"type": "object"}},
        },
        "$defs": {"d": {"anyOf": [{"type": "object"}, {"type": "null"}]}},
        "patternProperties": {"^p": {"type": ["object", "null"]}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"] == {"type": "string"}
    assert closed["properties"]["type"]["additionalProperties"] is False
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["$defs"]["d"]["anyOf"][1]
    assert closed["patternProperties"]["^p"]["additionalProperties"] is False
    assert json.dumps(schema) == json.dumps(schema)  # the original is left alone
    assert "additionalProperties" not in schema


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ('{"disable_any_whitespace": "yes"}', "wrong type"),
        ('{"whitespace": true}', "unknown structured outputs options: whitespace"),
        ('{"enable_in_reasoning": true}', "once the reasoning has ended"),
    ],
)
def test_a_server_config_that_cannot_be_served_is_refused(capsys, config, reason):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--structured-outputs-config", config])
    assert reason in capsys.readouterr().err
