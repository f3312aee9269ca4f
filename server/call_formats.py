"""How each model family writes its tool calls, read from the text of one block of them (or of
a whole reply): each reader returns the calls, or None where the text is not calls in its
format (the text then stays content). `server/tool_parsers.py` finds the blocks in a reply.

Values written as text (Qwen3-Coder's, Seed-OSS's, GLM's, MiniMax-M2's and DeepSeek-V3.2's
unmarked parameters) are read by the type the tool's schema gives them: a string stays text,
anything else is read as JSON (and stays text where it is not JSON)."""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Callable
from functools import cache
from typing import Any, Protocol

from server import json_text
from server.tools import tool_call

Calls = list[dict[str, Any]]
# The JSON schemas of the request's tools' parameters, by tool name.
Schemas = dict[str, dict[str, Any]]


class BlockReader(Protocol):
    """A format's reading of one block (or one whole reply) of calls."""

    def __call__(self, text: str, /, schemas: Schemas | None = None) -> Calls | None: ...


OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
FUNCTION, PARAMETER = "<function=", "<parameter="
GRANITE_TOOL_CALL = "<|tool_call|>"
FUNCTOOLS, PHI4_TOOLS = "functools", "<|tool|>"
ARG_KEY, ARG_VALUE = "<arg_key>", "<arg_value>"
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)

STEP3_CALL, STEP3_SEP, STEP3_CALL_END = (
    "<｜tool_call_begin｜>",
    "<｜tool_sep｜>",
    "<｜tool_call_end｜>",
)
STEPTML = "steptml:"
# DeepSeek-V3.2's prefix of its call tags (`<｜DSML｜invoke ...>`).
DSML = "｜DSML｜"
_FENCED_JSON = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)
_KIMI_ID = re.compile(r"\A(?:functions\.)?([^:\s]+):\d+\Z")
JSON_NAMES = {"true": True, "false": False, "null": None}
# How Python's parser and `ast.literal_eval` refuse text nested past what they can hold (the
# parser's own stack overflows as a MemoryError): a model led to write thousands of brackets or
# signs gets no call from them, not an error.
PYTHON_TOO_DEEP = (RecursionError, MemoryError)


def json_block(body: str, schemas: Schemas | None = None) -> Calls | None:
    """One `{"name", "arguments"}` object (or `"parameters"`), or a list of them (the form
    SmolLM2 and Conveyor's written tools use)."""
    return _json_calls(body, read_call)


def keyed_list(body: str, schemas: Schemas | None = None) -> Calls | None:
    """A JSON list of `{"NAME": {...arguments}}` objects, each call keyed by its name
    (Apertus')."""
    return _json_calls(body, _keyed_call)


def _json_calls(body: str, read: Callable[[Any], dict[str, Any] | None]) -> Calls | None:
    """A JSON call object, or a list of them, each read by `read`; None where any is not one."""
    try:
        parsed = json_text.loads(body)
    except ValueError:
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    return _all_calls([read(item) for item in items])


def _keyed_call(item: Any) -> dict[str, Any] | None:
    """`{"NAME": {...arguments}}` as a call; None for anything else."""
    if not isinstance(item, dict) or len(item) != 1:
        return None
    [(name, arguments)] = item.items()
    return tool_call(name, json.dumps(arguments)) if isinstance(arguments, dict) else None


def json_lines(body: str, schemas: Schemas | None = None) -> Calls | None:
    """A JSON list of calls (Hunyuan-A13B, Jamba), or one call object per line (MiniMax-M1)."""
    text = body.strip()
    if text.startswith("["):
        return json_block(text)
    lines = [line for line in text.splitlines() if line.strip()]
    calls = [_one_call(line) for line in lines]
    return _all_calls(calls) if calls else None


def llama3(text: str, schemas: Schemas | None = None) -> Calls | None:
    """One or more `{"name", "parameters"}` objects after an optional `<|python_tag|>`,
    separated by `;` or blanks."""
    body = text.removeprefix(PYTHON_TAG).strip()
    calls = [_one_call(part) for part in _json_objects(body)]
    return _all_calls(calls) if body else None


def pythonic(text: str, schemas: Schemas | None = None) -> Calls | None:
    """`[name(key=value, ...), ...]`, each value a Python literal (inside an optional
    `<|python_start|>` ... `<|python_end|>`)."""
    tree = python_expression(text.removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip())
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    return _all_calls([_python_call(node) for node in tree.elts])


def pythonic_lines(body: str, schemas: Schemas | None = None) -> Calls | None:
    """One `name(key=value, ...)` call per line (OLMo 3); JSON's `true`, `false` and `null`
    read as Python's literals."""
    calls = []
    for line in (line.strip() for line in body.splitlines()):
        if not line:
            continue
        node = python_expression(line)
        if node is None:
            return None
        calls.append(_python_call(node, json_names=True))
    return _all_calls(calls) if calls else None


def granite(text: str, schemas: Schemas | None = None) -> Calls | None:
    """`<|tool_call|>[...]` or `<tool_call>[...]` (or the bare list): a JSON list of calls."""
    return _listed(text.removeprefix(GRANITE_TOOL_CALL).removeprefix(OPEN).strip())


def functools(text: str, schemas: Schemas | None = None) -> Calls | None:
    """`functools[...]`: a JSON list of calls (Phi-4-mini)."""
    return _listed(text.removeprefix(FUNCTOOLS).strip())


def xlam(text: str, schemas: Schemas | None = None) -> Calls | None:
    """A JSON list of calls, bare or in a fenced code block (xLAM)."""
    fenced = _FENCED_JSON.match(text.strip())
    return _listed(fenced.group(1) if fenced else text.strip())


def mistral(body: str, schemas: Schemas | None = None) -> Calls | None:
    """What follows `[TOOL_CALLS]`: a JSON list (or objects) of calls, or `NAME[ARGS]{...}` /
    `NAME{...}` calls each after its own `[TOOL_CALLS]`."""
    if body.startswith(("[", "{")):
        try:
            parsed = json_text.loads(body)
        except ValueError:
            return llama3(body)
        items = parsed if isinstance(parsed, list) else [parsed]
        return _all_calls([read_call(item) for item in items])
    named = []
    for part in body.split(TOOL_CALLS):
        brace = part.find("{")
        name = part[:brace].removesuffix(ARGS).strip() if brace > 0 else ""
        arguments = _json_object(part[brace:]) if name else None
        if arguments is None:
            return None
        named.append(tool_call(name, json.dumps(arguments)))
    return named


def function_elements(body: str, schemas: Schemas | None = None) -> Calls | None:
    """`<function=NAME>` elements of `<parameter=KEY>VALUE</parameter>` elements (Qwen3-Coder's
    and Seed-OSS's calls)."""
    rest, calls = body.strip(), []
    while rest:
        if not rest.startswith(FUNCTION):
            return None
        element, closed, rest = rest[len(FUNCTION) :].partition("</function>")
        name, _, parameters = element.partition(">")
        arguments = _xml_parameters(parameters, properties_of(schemas, name.strip()))
        if not (closed and name.strip()) or arguments is None:
            return None
        calls.append(tool_call(name.strip(), json.dumps(arguments)))
        rest = rest.strip()
    return calls or None


def glm(body: str, schemas: Schemas | None = None) -> Calls | None:
    """`NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs, blanks between
    them or not (GLM-4.5 to 4.7's call)."""
    head, _, rest = body.partition(ARG_KEY)
    name = glm_name(head)
    if name is None:
        return None
    properties = properties_of(schemas, name)
    arguments: dict[str, Any] = {}
    rest = ARG_KEY + rest if rest else ""
    while rest.strip():
        rest = rest.strip()
        if not rest.startswith(ARG_KEY):
            return None
        key, found_key, rest = rest[len(ARG_KEY) :].partition("</arg_key>")
        rest = rest.lstrip()
        if not (found_key and rest.startswith(ARG_VALUE)):
            return None
        value, found_value, rest = rest[len(ARG_VALUE) :].partition("</arg_value>")
        if not found_value:
            return None
        arguments[key.strip()] = typed(value, properties.get(key.strip()))
    return [tool_call(name, json.dumps(arguments))]


def glm_name(head: str) -> str | None:
    """The name a GLM call's head spells (None where it cannot be one)."""
    name = head.strip()
    return None if not name or any(character in name for character in "<>{}\n") else name


def invokes(body: str, schemas: Schemas | None = None) -> Calls | None:
    """`<invoke name="NAME">` elements of `<parameter name="KEY">VALUE</parameter>` elements
    (MiniMax-M2's calls)."""
    return _invokes(body, schemas, "")


def dsml(body: str, schemas: Schemas | None = None) -> Calls | None:
    """The same elements with `｜DSML｜` after each `<` (DeepSeek-V3.2's calls), a parameter
    marked `string="true"` (text) or `string="false"` (JSON), or an invoke whose body is the
    arguments' JSON object."""
    return _invokes(body, schemas, DSML)


@cache
def _invoke_patterns(prefix: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    tag = re.escape(prefix)
    return (
        re.compile(rf'<{tag}invoke name="([^"]+)">(.*?)</{tag}invoke>', re.DOTALL),
        re.compile(
            rf'<{tag}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{tag}parameter>',
            re.DOTALL,
        ),
    )


def _invokes(body: str, schemas: Schemas | None, prefix: str) -> Calls | None:
    invoke, parameter = _invoke_patterns(prefix)
    if invoke.sub("", body).strip():
        return None
    calls = []
    for name, inner in invoke.findall(body):
        properties = properties_of(schemas, name)
        if inner.strip().startswith("{"):
            arguments = _json_object(inner)
        else:
            arguments = _named_parameters(inner, parameter, properties)
        if arguments is None:
            return None
        calls.append(tool_call(name, json.dumps(arguments)))
    return calls or None


def _named_parameters(
    inner: str, parameter: re.Pattern[str], properties: dict[str, Any]
) -> dict[str, Any] | None:
    """`<parameter name="KEY">` elements: a value marked `string="true"` stays text, one marked
    `string="false"` is read as JSON, an unmarked one as its schema types it."""
    if parameter.sub("", inner).strip():
        return None
    arguments: dict[str, Any] = {}
    for key, string, value in parameter.findall(inner):
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[key] = typed(value, marked_schema(string, properties.get(key)))
    return arguments


def marked_schema(string: str, schema: Any) -> Any:
    """The schema of a parameter marked `string="true"` (text) or `string="false"` (JSON), or
    unmarked (`""`: the tool's schema for it)."""
    return {"type": "string"} if string == "true" else None if string else schema


def step3(body: str, schemas: Schemas | None = None) -> Calls | None:
    """`<｜tool_call_begin｜>function<｜tool_sep｜>` before each `<steptml:invoke name="NAME">`
    element of `<steptml:parameter name="KEY">` elements, `<｜tool_call_end｜>` after it (Step3's
    calls)."""
    invokes = []
    for kind, invoke in _delimited(body, STEP3_CALL, STEP3_SEP, STEP3_CALL_END) or []:
        if kind != "function":
            return None
        invokes.append(invoke)
    return _invokes("\n".join(invokes), schemas, STEPTML) if invokes else None


def kimi(body: str, schemas: Schemas | None = None) -> Calls | None:
    """`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}
    <|tool_call_end|>` calls (Kimi K2's); the call keeps `functions.NAME:INDEX` as its id, which
    Kimi's template writes back."""
    calls = []
    for head, arguments in _delimited(body, KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END) or []:
        named = kimi_head(head)
        parsed = _json_object(arguments)
        if named is None or parsed is None:
            return None
        call = tool_call(named[0], json.dumps(parsed))
        call["id"] = named[1]
        calls.append(call)
    return calls or None


def kimi_head(head: str) -> tuple[str, str | None] | None:
    """The name and id (the head itself) of a Kimi call's `functions.NAME:INDEX`."""
    named = _KIMI_ID.match(head)
    return None if named is None else (named.group(1), head)


def plain_head(head: str) -> tuple[str, str | None] | None:
    """A head that is the call's name (DeepSeek-V3.1's), with no id of its own."""
    return (head, None) if head else None


def deepseek_v3(body: str, schemas: Schemas | None = None) -> Calls | None:
    """`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a fenced JSON block,
    then `<｜tool▁call▁end｜>` (DeepSeek-V3's and R1's calls)."""
    calls = []
    for kind, rest in _delimited(body, DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END) or []:
        name, _, fenced = rest.partition("\n")
        block = _FENCED_JSON.match(fenced.strip())
        parsed = _json_object(block.group(1)) if block else None
        if kind != "function" or not name.strip() or parsed is None:
            return None
        calls.append(tool_call(name.strip(), json.dumps(parsed)))
    return calls or None


def deepseek_v31(body: str, schemas: Schemas | None = None) -> Calls | None:
    """`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (DeepSeek-V3.1's calls)."""
    calls = []
    for name, arguments in _delimited(body, DEEPSEEK_CALL, DEEPSEEK_SEP, DEEPSEEK_CALL_END) or []:
        parsed = _json_object(arguments)
        if plain_head(name) is None or parsed is None:
            return None
        calls.append(tool_call(name, json.dumps(parsed)))
    return calls or None


def typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: text where the schema says string (or says
    nothing and the text is not JSON), else the JSON it spells."""
    if is_text(schema):
        return value
    try:
        return json_text.loads(value)
    except ValueError:
        return value


def is_text(schema: Any) -> bool:
    """Whether a parameter's schema types it as text (a string, or a list of types holding
    one)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def read_call(parsed: Any) -> dict[str, Any] | None:
    """A `{"name", "arguments"}` (or `"parameters"`) object as a call; None for anything else."""
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return tool_call(parsed["name"], text)


def _all_calls(calls: list[dict[str, Any] | None]) -> Calls | None:
    """The calls where every part read as one; None where any did not."""
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _one_call(body: str) -> dict[str, Any] | None:
    try:
        return read_call(json_text.loads(body))
    except ValueError:
        return None


def _listed(body: str) -> Calls | None:
    """A JSON list of calls; None where `body` is not one."""
    return json_block(body) if body.startswith("[") else None


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        parsed = json_text.loads(text.strip())
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _json_objects(body: str) -> list[str]:
    """`body` cut into the JSON objects it holds one after another (`;` or blanks between)."""
    try:
        json_text.check_depth(body)
    except ValueError:
        return [body]  # read as one, which will fail
    decoder = json.JSONDecoder()
    parts, index = [], 0
    while index < len(body):
        try:
            _, end = decoder.raw_decode(body, index)
        except ValueError:
            return [body]  # not a sequence of objects: read as one, which will fail
        parts.append(body[index:end])
        index = end
        while index < len(body) and body[index] in "; \n\t":
            index += 1
    return parts


def _python_call(node: ast.expr, json_names: bool = False) -> dict[str, Any] | None:
    """`name(key=literal, ...)` as a call; None for any other expression."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        return None
    values = [python_json(keyword.value, json_names) for keyword in node.keywords]
    if any(value is None for value in values):
        return None
    pairs = [f"{json.dumps(k.arg)}: {v}" for k, v in zip(node.keywords, values, strict=True)]
    return tool_call(node.func.id, "{" + ", ".join(pairs) + "}")


def python_json(node: ast.expr, json_names: bool = False) -> str | None:
    """A call's argument written as a Python literal, as JSON text; None where it is no literal
    or one JSON cannot hold (a set, bytes, a complex number)."""
    try:
        return json.dumps(_literal(node, json_names))
    except (*PYTHON_TOO_DEEP, ValueError, TypeError, SyntaxError):
        return None


def python_expression(text: str) -> ast.expr | None:
    """`text` parsed as one Python expression; None where it is not one. (Python's warnings
    about the text, `1f` being an odd number say, are the model's, not the server's: none is
    printed.)"""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.parse(text, mode="eval").body
    except (*PYTHON_TOO_DEEP, SyntaxError, ValueError):
        return None


def _literal(node: ast.expr, json_names: bool) -> Any:
    if json_names and isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    return ast.literal_eval(node)


def _xml_parameters(text: str, properties: dict[str, Any]) -> dict[str, Any] | None:
    """`<parameter=KEY>VALUE</parameter>` elements, each value typed by its schema."""
    arguments: dict[str, Any] = {}
    rest = text
    while rest.strip():
        rest = rest.strip()
        if not rest.startswith(PARAMETER):
            return None
        key, found, rest = rest[len(PARAMETER) :].partition(">")
        value, closed, rest = rest.partition("</parameter>")
        if not (found and closed):
            return None
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[key.strip()] = typed(value, properties.get(key.strip()))
    return arguments


def properties_of(schemas: Schemas | None, name: str) -> dict[str, Any]:
    properties = ((schemas or {}).get(name) or {}).get("properties")
    return properties if isinstance(properties, dict) else {}


def _delimited(body: str, begin: str, sep: str, end: str) -> list[tuple[str, str]] | None:
    """The `(head, rest)` of each `BEGIN head SEP rest END` in `body`, blanks between them;
    None where `body` holds anything else."""
    parts, rest = [], body.strip()
    while rest:
        if not rest.startswith(begin):
            return None
        element, closed, rest = rest[len(begin) :].partition(end)
        head, found, tail = element.partition(sep)
        if not (closed and found):
            return None
        parts.append((head.strip(), tail.strip()))
        rest = rest.strip()
    return parts
