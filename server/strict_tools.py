"""Strict functions under `tool_choice: "auto"`: the reply runs free, but a call it opens in the
tool-call parser's format must name one of the request's functions (one of those
`allowed_tools` names, where the choice names some), and a function marked `strict` gets
arguments that fit its `parameters` schema (others get any JSON object). With
`parallel_tool_calls: false` the reply ends after its first call.

Enforced as a structural tag (`engine.structured.structural_tag`) for the parsers whose calls
are JSON in a fixed frame (`hermes`, `llama3_json`, `granite`, `phi4_mini_json`), and for
`qwen3_coder`'s XML parameters (each one's value its schema's JSON, or raw text for a string,
in the schema's order). For the others the calls are read as written. A reply that may open
its own reasoning may do so first (its tags are tokens of their own that free text does not
hold)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from engine.core.sampling_params import StructuredOutputs
from server.call_formats import FUNCTOOLS, GRANITE_TOOL_CALL, OPEN, PYTHON_TAG
from server.protocol import AllowedToolsChoice, ChatCompletionRequest, Tool
from server.reasoning import ThoughtTags
from server.structured import NOTHING, after_optional_thought, optional
from server.tools import ANY_OBJECT, callable_tools, parameters


def strict_calls_format(
    body: ChatCompletionRequest, parser: str | None, thought: ThoughtTags | None = None
) -> StructuredOutputs | None:
    """The structural tag that enforces the request's calls in `parser`'s format, after an
    optional `thought` where the reply may open one; None where no function is strict and no
    `allowed_tools` narrow the calls, or the format is not one a tag can hold."""
    tools = callable_tools(body)
    restricted = isinstance(body.tool_choice, AllowedToolsChoice)
    if parser not in FORMATS or not (restricted or any(tool.function.strict for tool in tools)):
        return None
    single = not body.parallel_tool_calls
    tag = FORMATS[parser](tools, single)
    if thought is not None:
        tag = after_optional_thought(tag, thought)
    return StructuredOutputs("structural_tag", json.dumps({"format": tag}), "tools")


def _hermes(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the tags on lines of their
    own or not, as Qwen writes them; or a JSON list of such calls in one block, as the tools
    Conveyor writes for a template without a tool section teach (`server/tool_prompt.py`)."""
    frames = [("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>")]
    tags = [
        _tag(opening + _opening(tool, "arguments"), tool, closing)
        for tool in tools
        for opening, closing in frames
    ]
    calls = [_tag(_opening(tool, "arguments"), tool, "}") for tool in tools]
    lists = [
        _list_tag("<tool_call>[", calls, ", ", "]</tool_call>", single),
        _list_tag("<tool_call>[\n", calls, ",\n", "\n]</tool_call>", single),
    ]
    return _triggered(["<tool_call>"], tags + lists, single)


def _llama3_json(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`{"name": ..., "parameters": ...}`, after `<|python_tag|>` or not, as Llama 3.1 writes
    them."""
    tags = [
        _tag(prefix + _opening(tool, "parameters"), tool, "}")
        for tool in tools
        for prefix in ("", PYTHON_TAG)
    ]
    return _triggered(['{"name": ', PYTHON_TAG], tags, single)


def _qwen3_coder(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>
    \n</tool_call>`, as Qwen3-Coder writes them."""
    tags = [
        {
            "type": "tag",
            "begin": f"<tool_call>\n<function={tool.function.name}>\n",
            "content": _xml_parameters(tool),
            "end": "</function>\n</tool_call>",
        }
        for tool in tools
    ]
    return _triggered(["<tool_call>"], tags, single)


def _xml_parameters(tool: Tool) -> dict[str, Any]:
    """A strict function's parameters in its schema's order, each required one once and each
    other at most once; any text for a function that is not strict."""
    if not tool.function.strict:
        return {"type": "any_text"}
    schema = parameters(tool)
    required = set(schema.get("required", []))
    elements = []
    for key, value in (schema.get("properties") or {}).items():
        parameter = {
            "type": "tag",
            "begin": f"<parameter={key}>\n",
            "content": _xml_value(value),
            "end": "\n</parameter>\n",
        }
        elements.append(parameter if key in required else optional(parameter))
    return {"type": "sequence", "elements": elements} if elements else NOTHING


def _xml_value(schema: Any) -> dict[str, Any]:
    """A parameter's value: raw text for a string (one of its `enum` where it has one), the
    schema's JSON otherwise."""
    if not isinstance(schema, dict):
        return {"type": "json_schema", "json_schema": True}
    choices = schema.get("enum")
    if schema.get("type") == "string" and choices is None:
        return {"type": "any_text"}
    if choices and all(isinstance(choice, str) and choice for choice in choices):
        return {"type": "or", "elements": [_literal(choice) for choice in choices]}
    return {"type": "json_schema", "json_schema": schema}


def _literal(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _json_list(*triggers: str) -> Callable[[list[Tool], bool], dict[str, Any]]:
    """`TRIGGER[{"name": ..., "arguments": ...}, ...]`: one list of calls (one call in it with
    `single`), after any of the triggers."""

    def format_(tools: list[Tool], single: bool) -> dict[str, Any]:
        calls = [_tag(_opening(tool, "arguments"), tool, "}") for tool in tools]
        lists = [_list_tag(trigger + "[", calls, ", ", "]", single) for trigger in triggers]
        return _triggered(list(triggers), lists, single=True)  # the list ends the reply

    return format_


FORMATS: dict[str, Callable[[list[Tool], bool], dict[str, Any]]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "granite": _json_list(GRANITE_TOOL_CALL, OPEN),
    "phi4_mini_json": _json_list(FUNCTOOLS),
    "qwen3_coder": _qwen3_coder,
}


def _list_tag(
    begin: str, calls: list[dict[str, Any]], separator: str, end: str, single: bool
) -> dict[str, Any]:
    """`BEGIN call SEPARATOR call ... END`: at least one call (only one with `single`)."""
    content = {
        "type": "tags_with_separator",
        "tags": calls,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": single,
    }
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _triggered(triggers: list[str], tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
    return {
        "type": "triggered_tags",
        "triggers": triggers,
        "tags": tags,
        "stop_after_first": single,
    }


def _opening(tool: Tool, key: str) -> str:
    return f'{{"name": {json.dumps(tool.function.name)}, "{key}": '


def _tag(begin: str, tool: Tool, end: str) -> dict[str, Any]:
    schema = parameters(tool) if tool.function.strict else ANY_OBJECT
    content = {"type": "json_schema", "json_schema": schema}
    return {"type": "tag", "begin": begin, "content": content, "end": end}
