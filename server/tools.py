"""Tool calling: the tools a chat request offers, the calls a `tool_choice` forces (enforced as a
structured output), and those calls read back from the output as OpenAI's `tool_calls`.

A named `tool_choice` constrains the output to the function's `parameters` schema: the output
is the call's arguments. `"required"` constrains it to an array of `{"name", "parameters"}`
objects, each naming a listed function with arguments that fit its schema (exactly one with
`parallel_tool_calls: false`), as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import StructuredOutputs
from server.call_array import CallArrayReader, assemble, new_call_id
from server.protocol import AllowedToolsChoice, ChatCompletionRequest, NamedToolChoice, Tool

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ForcedCalls:
    """The calls a request's `tool_choice` forces: one call to `names[0]` (`named`), or one or
    more calls to the listed functions (`required`)."""

    kind: Literal["named", "required"]
    names: tuple[str, ...]
    format: StructuredOutputs

    def calls(self, text: str) -> list[dict[str, Any]]:
        """The output as `tool_calls`; an output cut short (out of tokens) keeps what it has,
        as the stream did: the partial arguments of its last call."""
        if self.kind == "named":
            return [tool_call(self.names[0], text)]
        return assemble(CallArrayReader().feed(text))


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def check_tools(body: ChatCompletionRequest) -> None:
    """400 for a `tool_choice` the tools cannot satisfy, tools named twice, parameters that
    are not a JSON Schema, or a tool message that says nothing of which call it answers."""
    names = [tool.function.name for tool in body.tools or []]
    if len(set(names)) != len(names):
        raise InvalidRequestError("Each tool must have a name of its own.", param="tools")
    choice = body.tool_choice
    if choice == "required" and not names:
        raise InvalidRequestError(
            'tool_choice "required" needs at least one tool in tools.', param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {choice.function.name!r}, which is not in tools.",
            param="tool_choice",
        )
    if isinstance(choice, AllowedToolsChoice):
        for i, allowed in enumerate(choice.allowed_tools.tools):
            if allowed.function.name not in names:
                raise InvalidRequestError(
                    f"allowed_tools names the function {allowed.function.name!r}, which is not "
                    "in tools.",
                    param=f"tool_choice.allowed_tools.tools[{i}]",
                )
    for i, tool in enumerate(body.tools or []):
        _check_parameters(tool, f"tools[{i}].function.parameters")
    for i, message in enumerate(body.messages):
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidRequestError(
                "A tool message needs the tool_call_id of the call it answers.",
                param=f"messages[{i}].tool_call_id",
            )


def _check_parameters(tool: Tool, param: str) -> None:
    """400 for parameters that are not a JSON Schema, whatever the tool_choice (as OpenAI)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(parameters(tool))
    except SchemaError as exc:
        raise InvalidRequestError(
            f"The parameters of {tool.function.name!r} are not a valid JSON Schema: {exc.message}",
            param=param,
        ) from exc
    except RecursionError:
        raise InvalidRequestError(
            f"The parameters of {tool.function.name!r} nest too deeply.", param=param
        ) from None


def callable_tools(body: ChatCompletionRequest) -> list[Tool]:
    """The tools the reply may call: those `allowed_tools` names, else all."""
    choice = body.tool_choice
    if not isinstance(choice, AllowedToolsChoice):
        return list(body.tools or [])
    allowed = {tool.function.name for tool in choice.allowed_tools.tools}
    return [tool for tool in body.tools or [] if tool.function.name in allowed]


def forced_calls(body: ChatCompletionRequest) -> ForcedCalls | None:
    """The calls `tool_choice` forces, with the output format that enforces them."""
    tools = {tool.function.name: tool for tool in callable_tools(body)}
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        schema = parameters(tools[name])
        return ForcedCalls("named", (name,), StructuredOutputs("json", _json(schema), "tools"))
    if isinstance(choice, AllowedToolsChoice) and choice.allowed_tools.mode == "required":
        choice = "required"
    if choice == "required":
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(tool) for tool in tools.values()]},
        }
        if not body.parallel_tool_calls:
            calls["maxItems"] = 1
        return ForcedCalls(
            "required", tuple(tools), StructuredOutputs("json", _json(calls), "tools")
        )
    return None


def template_tools(
    body: ChatCompletionRequest, exclude_when_none: bool = False
) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (`tools=`): under `tool_choice` "none" too, as
    vLLM and OpenAI keep them in the prompt (the reply is then read as text alone), unless
    `exclude_when_none` (vLLM's `--exclude-tools-when-tool-choice-none`)."""
    if not body.tools or (exclude_when_none and body.tool_choice == "none"):
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def parameters(tool: Tool) -> dict[str, Any]:
    """The function's `parameters` schema (any object where it gives none)."""
    return tool.function.parameters or ANY_OBJECT


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": parameters(tool),
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def _json(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"))


def tool_schemas(body: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """Each tool's parameters schema by its name (what types a parser reads values as)."""
    return {tool.function.name: tool.function.parameters or {} for tool in body.tools or ()}
