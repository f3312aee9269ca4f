"""Strict functions under `tool_choice: "auto"`: the reply runs free, but a call it opens in the
tool-call parser's format must name one of the request's functions (one of those
`allowed_tools` names, where the choice names some), and a function marked `strict` gets
arguments that fit its `parameters` schema (others get any JSON object). With
`parallel_tool_calls: false` the reply ends after its first call.

Enforced as a structural tag (`engine.structured.structural_tag`) for the parsers whose calls
are JSON in a fixed frame (`hermes`, `llama3_json`, `granite`, `phi4_mini_json`, `mistral`,
`kimi_k2`, `deepseek_v3`, `deepseek_v31`, `longcat`, `internlm`, `apertus`, `hunyuan_a13b`,
`jamba` and `minimax`'s `<tool_calls>` blocks, gpt-oss's Harmony messages to functions), and
for those that write each parameter as text (`qwen3_coder`, `seed_oss`, `glm45`, `glm47`,
`minimax_m2`, `deepseek_v32`, `deepseek_v4`, `step3`: each value its schema's JSON, or raw
text for a string, in the schema's order). For the others the calls are read as written. A
reply that may open its own reasoning may do so first (its tags are tokens of their own that
free text does not hold)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from engine.core.sampling_params import StructuredOutputs
from server import call_formats
from server.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE
from server.harmony import PARSER as HARMONY
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
    calls = _call_objects(tools)
    lists = [
        _list_tag("<tool_call>[", calls, ", ", "]</tool_call>", single),
        _list_tag("<tool_call>[\n", calls, ",\n", "\n]</tool_call>", single),
    ]
    frames = [("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>")]
    blocks = _blocks(frames, ("arguments",), tools)
    return _triggered(["<tool_call>"], blocks + lists, single)


def _json_blocks(
    open_: str, close: str, keys: tuple[str, ...]
) -> Callable[[list[Tool], bool], dict[str, Any]]:
    """One call a block, a line break after the opening tag or before the closing one or
    not: LongCat's (`arguments`) and InternLM's (`parameters` or `arguments`)."""
    frames = [(open_ + a, "}" + b + close) for a in ("", "\n") for b in ("", "\n")]

    def format_(tools: list[Tool], single: bool) -> dict[str, Any]:
        return _triggered([open_], _blocks(frames, keys, tools), single)

    return format_


def _blocks(
    frames: list[tuple[str, str]], keys: tuple[str, ...], tools: list[Tool]
) -> list[dict[str, Any]]:
    """`OPENING{"name": ..., KEY: ...}CLOSING` for each tool, key and frame."""
    return [
        _tag(opening + _opening(tool, key), tool, closing)
        for tool in tools
        for key in keys
        for opening, closing in frames
    ]


def _apertus(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`<|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>`, each call keyed by its name,
    as Apertus writes them."""
    calls = [_tag(f"{{{json.dumps(tool.function.name)}: ", tool, "}") for tool in tools]
    begin, end = "<|tools_prefix|>", "<|tools_suffix|>"
    return _triggered([begin], [_list_tag(begin + "[", calls, ", ", "]" + end, single)], single)


def _tool_calls_block(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`<tool_calls>` around a JSON list of calls (Hunyuan-A13B's, Jamba's) or one call object
    a line (MiniMax-M1's)."""
    calls = _call_objects(tools)
    blocks = [
        _list_tag("<tool_calls>[", calls, ", ", "]</tool_calls>", single),
        _list_tag("<tool_calls>\n[", calls, ", ", "]\n</tool_calls>", single),
        _list_tag("<tool_calls>\n", calls, "\n", "\n</tool_calls>", single),
    ]
    return _triggered(["<tool_calls>"], blocks, single)


def _llama3_json(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`{"name": ..., "parameters": ...}`, after `<|python_tag|>` or not, as Llama 3.1 writes
    them."""
    tags = [
        _tag(prefix + _opening(tool, "parameters"), tool, "}")
        for tool in tools
        for prefix in ("", call_formats.PYTHON_TAG)
    ]
    return _triggered(['{"name": ', call_formats.PYTHON_TAG], tags, single)


def _function_elements(tag: str, value_break: str) -> Callable[[list[Tool], bool], dict[str, Any]]:
    """`<TAG>\n<function=NAME>\n<parameter=KEY>VALUE</parameter>\n...</function>\n</TAG>`,
    each VALUE between `value_break`s: Qwen3-Coder's (`<tool_call>`, its values on lines of
    their own) and Seed-OSS's (`<seed:tool_call>`, its values inline)."""
    return _text_format(
        f"<{tag}>",
        lambda name: f"<{tag}>\n<function={name}>\n",
        lambda key, _schema: f"<parameter={key}>{value_break}",
        f"{value_break}</parameter>\n",
        f"</function>\n</{tag}>",
    )


def _glm(separator: str) -> Callable[[list[Tool], bool], dict[str, Any]]:
    """`<tool_call>NAME` and `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs, each
    piece followed by `separator` (GLM-4.5 writes a line break, GLM-4.7 nothing)."""
    return _text_format(
        "<tool_call>",
        lambda name: f"<tool_call>{name}{separator}",
        lambda key, _schema: f"<arg_key>{key}</arg_key>{separator}<arg_value>",
        f"</arg_value>{separator}",
        "</tool_call>",
    )


def _text_format(
    trigger: str,
    head: Callable[[str], str],
    parameter: Callable[[str, Any], str],
    parameter_end: str,
    tail: str,
) -> Callable[[list[Tool], bool], dict[str, Any]]:
    """Calls whose parameters are written as text (`_text_calls`), each opened by `trigger`."""

    def format_(tools: list[Tool], single: bool) -> dict[str, Any]:
        tags = _text_calls(tools, head, parameter, parameter_end, tail)
        return _triggered([trigger], tags, single)

    return format_


def _minimax_m2(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`<minimax:tool_call>\n` around `<invoke name="NAME">\n` elements of `<parameter
    name="KEY">VALUE</parameter>\n` elements, as MiniMax-M2 writes them."""
    invokes = _text_calls(
        tools,
        lambda name: f'<invoke name="{name}">\n',
        lambda key, _schema: f'<parameter name="{key}">',
        "</parameter>\n",
        "</invoke>\n",
    )
    return _section("<minimax:tool_call>\n", invokes, "", "</minimax:tool_call>", single)


def _step3(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`<｜tool_calls_begin｜>` around calls, each `<｜tool_call_begin｜>function<｜tool_sep｜>`,
    a `<steptml:invoke name="NAME">` element of `<steptml:parameter name="KEY">VALUE
    </steptml:parameter>` elements, then `<｜tool_call_end｜>`, as Step3 writes them."""
    head = f"{call_formats.STEP3_CALL}function{call_formats.STEP3_SEP}"
    invokes = _text_calls(
        tools,
        lambda name: f'{head}<steptml:invoke name="{name}">',
        lambda key, _schema: f'<steptml:parameter name="{key}">',
        "</steptml:parameter>",
        f"</steptml:invoke>{call_formats.STEP3_CALL_END}",
    )
    return _section("<｜tool_calls_begin｜>", invokes, "", "<｜tool_calls_end｜>", single)


def _dsml(block: str) -> Callable[[list[Tool], bool], dict[str, Any]]:
    """`<｜DSML｜BLOCK>\n` around `<｜DSML｜invoke name="NAME">\n` elements of `<｜DSML｜parameter
    name="KEY" string="true|false">VALUE</｜DSML｜parameter>\n` elements (`string="true"` for a
    string's raw text, else JSON), as DeepSeek-V3.2 (`function_calls`) and V4 (`tool_calls`)
    write them."""
    dsml = call_formats.DSML

    def parameter(key: str, schema: Any) -> str:
        raw = _xml_value(schema)["type"] != "json_schema"  # a string, or one of its `enum`
        return f'<{dsml}parameter name="{key}" string="{"true" if raw else "false"}">'

    def format_(tools: list[Tool], single: bool) -> dict[str, Any]:
        invokes = _text_calls(
            tools,
            lambda name: f'<{dsml}invoke name="{name}">\n',
            parameter,
            f"</{dsml}parameter>\n",
            f"</{dsml}invoke>\n",
        )
        return _section(f"<{dsml}{block}>\n", invokes, "", f"</{dsml}{block}>", single)

    return format_


def _mistral(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`[TOOL_CALLS]` and then the calls to the end of the reply: `NAME[ARGS]{...}` each after
    its own `[TOOL_CALLS]` (Mistral's v11 tokenizers and later), or a JSON list of
    `{"name", "arguments"}` objects (earlier ones)."""
    named = [_tag(f"{tool.function.name}{call_formats.ARGS}", tool, "") for tool in tools]
    calls = _call_objects(tools)
    forms = [
        _list_tag(call_formats.TOOL_CALLS, named, call_formats.TOOL_CALLS, "", single),
        *(
            _list_tag(f"{call_formats.TOOL_CALLS}{space}[", calls, ", ", "]", single)
            for space in ("", " ")
        ),
    ]
    return _triggered([call_formats.TOOL_CALLS], forms, single=True)  # the calls end the reply


# How gpt-oss's header goes on after a message's recipient: its channel where the recipient
# came first, and the body's format.
HARMONY_HEADERS = tuple(
    channel + constraint + MESSAGE
    for channel in ("", f"{CHANNEL}commentary")
    for constraint in (f" {CONSTRAIN}json", " json", "")
)


def _harmony(tools: list[Tool], single: bool) -> dict[str, Any]:
    """gpt-oss's messages to `functions.NAME` (`to=functions.NAME` in a Harmony header, before
    its channel or after it), the body the arguments, then `<|call|>`."""
    header = {"type": "or", "elements": [_literal(rest) for rest in HARMONY_HEADERS]}
    calls = [
        _element(f"to=functions.{tool.function.name}", _sequence(header, _arguments(tool)), CALL)
        for tool in tools
    ]
    return _triggered(["to=functions."], calls, single)


def _kimi_k2(tools: list[Tool], single: bool) -> dict[str, Any]:
    """`<|tool_calls_section_begin|>` around `<|tool_call_begin|>functions.NAME:N
    <|tool_call_argument_begin|>{...}<|tool_call_end|>` calls, as Kimi K2 writes them."""
    index = {"type": "regex", "pattern": "[0-9]+"}
    calls = [
        _element(
            f"{call_formats.KIMI_CALL}functions.{tool.function.name}:",
            _sequence(index, _literal(call_formats.KIMI_ARGUMENTS), _arguments(tool)),
            call_formats.KIMI_CALL_END,
        )
        for tool in tools
    ]
    begin, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    return _section(begin, calls, "", end, single)


def _deepseek(version: str) -> Callable[[list[Tool], bool], dict[str, Any]]:
    """`<｜tool▁calls▁begin｜>` around DeepSeek-V3's calls (`function<｜tool▁sep｜>NAME` and the
    arguments in a fenced JSON block, a line break between calls) or V3.1's
    (`NAME<｜tool▁sep｜>{...}`, nothing between)."""

    def format_(tools: list[Tool], single: bool) -> dict[str, Any]:
        if version == "v3":
            frames = [
                (f"function{call_formats.DEEPSEEK_SEP}{tool.function.name}\n```json\n", "\n```")
                for tool in tools
            ]
        else:
            frames = [(f"{tool.function.name}{call_formats.DEEPSEEK_SEP}", "") for tool in tools]
        calls = [
            _tag(call_formats.DEEPSEEK_CALL + head, tool, tail + call_formats.DEEPSEEK_CALL_END)
            for tool, (head, tail) in zip(tools, frames, strict=True)
        ]
        begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
        return _section(begin, calls, "\n" if version == "v3" else "", end, single)

    return format_


def _text_calls(
    tools: list[Tool],
    head: Callable[[str], str],
    parameter: Callable[[str, Any], str],
    parameter_end: str,
    tail: str,
) -> list[dict[str, Any]]:
    """Each tool's call whose parameters are written as text: `head(NAME)`, each parameter
    between `parameter(KEY, its schema)` and `parameter_end`, then `tail`."""
    return [
        _element(head(tool.function.name), _text_parameters(tool, parameter, parameter_end), tail)
        for tool in tools
    ]


def _text_parameters(tool: Tool, begin: Callable[[str, Any], str], end: str) -> dict[str, Any]:
    """A strict function's parameters written as text between `begin(KEY)` and `end`, in its
    schema's order, each required one once and each other at most once; any text for a
    function that is not strict."""
    if not tool.function.strict:
        return {"type": "any_text"}
    schema = parameters(tool)
    required = set(schema.get("required", []))
    elements = []
    for key, value in (schema.get("properties") or {}).items():
        parameter = _element(begin(key, value), _xml_value(value), end)
        elements.append(parameter if key in required else optional(parameter))
    return _sequence(*elements) if elements else NOTHING


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
        calls = _call_objects(tools)
        lists = [_list_tag(trigger + "[", calls, ", ", "]", single) for trigger in triggers]
        return _triggered(list(triggers), lists, single=True)  # the list ends the reply

    return format_


FORMATS: dict[str, Callable[[list[Tool], bool], dict[str, Any]]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "granite": _json_list(call_formats.GRANITE_TOOL_CALL, call_formats.OPEN),
    "phi4_mini_json": _json_list(call_formats.FUNCTOOLS),
    "qwen3_coder": _function_elements("tool_call", "\n"),
    "seed_oss": _function_elements("seed:tool_call", ""),
    "glm45": _glm("\n"),
    "glm47": _glm(""),
    "minimax_m2": _minimax_m2,
    "kimi_k2": _kimi_k2,
    "deepseek_v3": _deepseek("v3"),
    "deepseek_v31": _deepseek("v31"),
    "deepseek_v32": _dsml("function_calls"),
    "deepseek_v4": _dsml("tool_calls"),
    "step3": _step3,
    "mistral": _mistral,
    "apertus": _apertus,
    HARMONY: _harmony,
    "longcat": _json_blocks("<longcat_tool_call>", "</longcat_tool_call>", ("arguments",)),
    "internlm": _json_blocks(
        "<|action_start|><|plugin|>", "<|action_end|>", ("parameters", "arguments")
    ),
    "hunyuan_a13b": _tool_calls_block,
    "jamba": _tool_calls_block,
    "minimax": _tool_calls_block,
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


def _section(
    begin: str, calls: list[dict[str, Any]], separator: str, end: str, single: bool
) -> dict[str, Any]:
    """A reply that runs free until `begin` (blanks after it aside), then holds its calls in
    one `_list_tag` section, which ends the reply."""
    return _triggered([begin.strip()], [_list_tag(begin, calls, separator, end, single)], True)


def _call_objects(tools: list[Tool]) -> list[dict[str, Any]]:
    """Each tool's `{"name": ..., "arguments": ...}` object, the arguments its schema's."""
    return [_tag(_opening(tool, "arguments"), tool, "}") for tool in tools]


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
    return _element(begin, _arguments(tool), end)


def _element(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _arguments(tool: Tool) -> dict[str, Any]:
    """A call's arguments as JSON: a strict function's fit its schema, another's are any
    object."""
    schema = parameters(tool) if tool.function.strict else ANY_OBJECT
    return {"type": "json_schema", "json_schema": schema}
