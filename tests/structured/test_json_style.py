"""vLLM's JSON options (`server/json_style.py`): `disable_any_whitespace`,
`whitespace_pattern`, and the guidance backend's open objects with
`disable_additional_properties`, per request or for the whole server
(`--structured-outputs-config`), checked on the compiled matcher: which texts the format then
allows."""

from __future__ import annotations

import json

import pytest

from engine.core.sampling_params import StructuredOutputs
from engine.structured.compiler import GrammarCompiler
from server.cli import build_parser, server_settings
from server.json_style import PLAIN, JsonStyle
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


def test_by_default_json_is_written_with_single_spaces_and_listed_properties_alone(compiler):
    spec = spec_of({"structured_outputs": {"json": POINT}})
    assert format_allows(compiler, spec, '{"x": 1}')
    assert not format_allows(compiler, spec, '{"x": 1, "y": 2}')
    assert not format_allows(compiler, spec, '{"x":1}')


def test_disable_any_whitespace_writes_json_without_blanks(compiler):
    spec = spec_of({"structured_outputs": {"json": POINT, "disable_any_whitespace": True}})
    assert format_allows(compiler, spec, '{"x":1}')
    assert not format_allows(compiler, spec, '{"x": 1}')
    plain = spec_of({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    assert plain.kind == "json"
    assert format_allows(compiler, plain, '{"a":[1,2]}')
    assert not format_allows(compiler, plain, '{"a": [1, 2]}')


def server_style(*argv: str) -> JsonStyle:
    return server_settings(build_parser().parse_args(["serve", *argv])).json_style


NESTED = {
    "type": "object",
    "properties": {"inner": POINT, "any": {"type": "object"}},
    "required": ["inner", "any"],
}


def test_the_guidance_backend_leaves_objects_open_until_a_request_closes_them(compiler):
    for argv in (
        ["--structured-outputs-config", '{"backend": "guidance"}'],
        ["--guided-decoding-backend", "guidance"],
    ):
        style = server_style(*argv)
        assert style.open_objects
        spec = spec_of({"structured_outputs": {"json": NESTED}}, style)
        assert format_allows(compiler, spec, '{"inner": {"x": 1, "y": 2}, "any": {}, "z": 3}')
        closing = {"json": NESTED, "disable_additional_properties": True}
        spec = spec_of({"structured_outputs": closing}, style)
        assert format_allows(compiler, spec, '{"inner": {"x": 1}, "any": {"k": 2}}')
        assert not format_allows(compiler, spec, '{"inner": {"x": 1, "y": 2}, "any": {}}')
        assert not format_allows(compiler, spec, '{"inner": {"x": 1}, "any": {}, "extra": 3}')
    for backend in ("auto", "xgrammar", "outlines"):
        style = server_style("--structured-outputs-config", json.dumps({"backend": backend}))
        spec = spec_of({"structured_outputs": {"json": NESTED}}, style)
        assert not format_allows(compiler, spec, '{"inner": {"x": 1}, "any": {}, "z": 3}')
        assert format_allows(compiler, spec, '{"inner": {"x": 1}, "any": {"k": [1]}}')


def test_forced_tool_calls_are_written_in_the_servers_style(compiler):
    from server.tools import forced_calls

    tool = {"type": "function", "function": {"name": "where", "parameters": POINT}}
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool],
            "tool_choice": "required",
        }
    )
    forced = forced_calls(body)
    assert forced is not None
    call = '[{"name": "where", "parameters": {"x": 1}}]'
    assert format_allows(compiler, forced.format, call)
    assert not format_allows(compiler, forced.format, call.replace("1}", '1, "y": 2}'))
    compact = server_style("--structured-outputs-config", '{"disable_any_whitespace": true}')
    written = compact.applied(forced.format)
    assert format_allows(compiler, written, call.replace(": ", ":").replace(", ", ","))
    assert not format_allows(compiler, written, call)


def test_a_whitespace_pattern_allows_the_whitespace_it_matches(compiler):
    fields = {"json": POINT, "whitespace_pattern": "[ ]{0,2}"}
    spec = spec_of({"structured_outputs": fields})
    assert format_allows(compiler, spec, '{"x":1}')
    assert format_allows(compiler, spec, '{  "x" :  1}')
    assert not format_allows(compiler, spec, '{\n"x": 1}')


def test_the_servers_style_holds_for_every_field_and_the_request_adds_to_it(compiler):
    style = server_style("--structured-outputs-config", '{"disable_any_whitespace": true}')
    assert style == JsonStyle(compact=True)
    schema_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}
    for fields in ({"response_format": schema_format}, {"guided_json": POINT}):
        spec = spec_of(fields, style)
        assert format_allows(compiler, spec, '{"x":1}')
        assert not format_allows(compiler, spec, '{"x": 1}')
        assert not format_allows(compiler, spec, '{"x":1,"y":2}')
    guidance = server_style("--structured-outputs-config", '{"backend": "guidance"}')
    asked = {"json": POINT, "disable_any_whitespace": True}
    spec = spec_of({"structured_outputs": asked}, guidance)
    assert format_allows(compiler, spec, '{"x":1,"y":2}')
    assert not format_allows(compiler, spec, '{"x": 1}')


def test_other_formats_are_left_as_they_are():
    regex = spec_of({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}})
    assert regex == StructuredOutputs("regex", "a+", "structured_outputs.regex")


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
