"""Reading tool calls out of a model's free text (`tool_choice: "auto"`), in the format its chat
template teaches:

- `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5
  and Qwen3 write them (a block may also hold a list of such objects, as SmolLM2 writes them).
  The streaming reader holds back text that may be the start of a tag until it is known not to
  be, and hands out each call whole once its closing tag arrives; text outside the calls is
  content.
- `qwen3_coder`: the same tags around `<function=NAME>` with one `<parameter=KEY>` element per
  argument, as Qwen3-Coder writes them; each value is read by the type the tool's schema gives
  it (a string stays text, a number, boolean, array or object is read as JSON).
- `llama3_json`: the whole reply is one or more `{"name": ..., "parameters": {...}}` objects
  (after an optional `<|python_tag|>`, separated by `;`), as Llama 3.1-3.3 write them. A reply
  that opens with `{` is held until it ends, then read; any other reply is content.
- `pythonic`: the whole reply is a Python list of calls, `[get_weather(city="Oslo"), ...]`
  (inside an optional `<|python_start|>` ... `<|python_end|>`), as Llama 3.2 and Llama 4 write
  them; held and read as `llama3_json`'s.
- `mistral`: text, then `[TOOL_CALLS]` and the calls to the end of the reply: a JSON list of
  `{"name", "arguments"}` objects (Mistral's v3 tokenizers) or `NAME[ARGS]{...}` per call
  (later ones). The tag is a special token, so such requests keep special tokens in their
  text.
- `granite`: the whole reply is a JSON list of `{"name", "arguments"}` objects after
  `<|tool_call|>` (Granite 3.0's special token) or `<tool_call>` (Granite 3.1's text), as IBM's
  Granite 3 models write them; held and read as `llama3_json`'s.
- `phi4_mini_json`: the whole reply is `functools[...]`, the same JSON list, as Phi-4-mini
  writes it; held and read alike.

(vLLM's parsers of the same names read the same formats.)
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from server import json_text
from server.tools import tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
FUNCTION, PARAMETER = "<function=", "<parameter="
GRANITE_TOOL_CALL = "<|tool_call|>"
FUNCTOOLS, PHI4_TOOLS = "functools", "<|tool|>"
# `openai` reads gpt-oss's Harmony messages to functions (`server/harmony.py`).
# vLLM's other names for formats read here.
ALIASES = {"llama4_json": "llama3_json", "llama4_pythonic": "pythonic", "qwen3_xml": "qwen3_coder"}
PARSERS = (
    "granite",
    "hermes",
    "llama3_json",
    "mistral",
    "openai",
    "phi4_mini_json",
    "pythonic",
    "qwen3_coder",
    *ALIASES,
)
# Parsers whose tags are special tokens, which a reply's text must keep to be read.
KEEPS_SPECIAL_TOKENS = frozenset({"mistral", "openai"})

# The JSON schemas of the request's tools' parameters, by tool name.
Schemas = dict[str, dict[str, Any]]


class CallReader(Protocol):
    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]: ...

    def finish(self) -> tuple[str, list[dict[str, Any]]]: ...


def parser_for(name: str | None, chat_template: str | None) -> str | None:
    """The parser `--tool-call-parser` names, else the one the chat template's own tags show,
    else None (calls are not read from free text)."""
    if name is not None:
        return ALIASES.get(name, name)
    template = chat_template or ""
    if GRANITE_TOOL_CALL in template:
        return "granite"
    if FUNCTOOLS in template or PHI4_TOOLS in template:
        return "phi4_mini_json"
    if OPEN in template and FUNCTION in template and PARAMETER in template:
        return "qwen3_coder"
    if OPEN in template:
        return "hermes"
    if TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template:
        return "llama3_json"
    return None


def reader_for(parser: str, schemas: Schemas | None = None) -> CallReader:
    """A streaming reader of `parser`'s calls; `schemas` type `qwen3_coder`'s values."""
    if parser == "qwen3_coder":
        return HermesReader(lambda body: _xml_calls(body, schemas or {}))
    if parser == "llama3_json":
        return WholeReplyReader((PYTHON_TAG, "{"), _llama3_calls)
    if parser == "pythonic":
        return WholeReplyReader((PYTHON_START, "["), _pythonic_calls)
    if parser == "mistral":
        return MistralReader()
    if parser == "granite":
        return WholeReplyReader((GRANITE_TOOL_CALL, OPEN, "["), _granite_calls)
    if parser == "phi4_mini_json":
        return WholeReplyReader((FUNCTOOLS + "[",), _functools_calls)
    return HermesReader()


def parse_calls(
    parser: str, text: str, schemas: Schemas | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """The text outside the calls (None if only blanks) and the calls, from a whole output."""
    reader = reader_for(parser, schemas)
    content, calls = reader.feed(text)
    rest, more = reader.finish()
    content += rest
    calls += more
    return (content if content.strip() else None), calls


def _hermes_block(body: str) -> list[dict[str, Any]] | None:
    return _block_calls(body)


@dataclass(slots=True)
class HermesReader:
    """Reads calls between `<tool_call>` tags out of text arriving in pieces cut anywhere;
    `read_block` reads one block's calls (None: not calls)."""

    read_block: Callable[[str], list[dict[str, Any]] | None] = _hermes_block
    _buffer: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content that can be shown now, and the calls completed by `text`."""
        self._buffer += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._in_call = False
                block = self.read_block(body)
                if block is None:  # not a call after all: keep the text as it was written
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.extend(block)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = partial_tag(self._buffer, OPEN)
            content.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the output ends: an unclosed call, or a partial tag, as text."""
        rest = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return rest, []


@dataclass(slots=True)
class WholeReplyReader:
    """Holds a reply that opens with one of `openers` until it ends, then reads it whole
    (`read`: the calls, or None where it is not calls, and the reply is content); streams any
    other reply."""

    openers: tuple[str, ...]
    read: Callable[[str], list[dict[str, Any]] | None]
    _buffer: str = ""
    _holding: bool | None = None  # None until the reply's first non-blank character

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._holding is False:
            return text, []
        self._buffer += text
        start = self._buffer.lstrip()
        if not start:
            return "", []
        if self._holding is None:
            self._holding = start.startswith(self.openers) or any(
                opener.startswith(start) for opener in self.openers
            )
        if self._holding:
            return "", []
        released, self._buffer = self._buffer, ""
        return released, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self._buffer = self._buffer, ""
        if not self._holding:
            return text, []
        calls = self.read(text.strip())
        return ("", calls) if calls else (text, [])


def _llama3_calls(text: str) -> list[dict[str, Any]] | None:
    body = text.removeprefix(PYTHON_TAG).strip()
    calls = [_call(part) for part in _json_objects(body)]
    if not body or not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _pythonic_calls(text: str) -> list[dict[str, Any]] | None:
    """`[name(key=value, ...), ...]`, each value a Python literal."""
    body = text.removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                return None
            if node.args or any(keyword.arg is None for keyword in node.keywords):
                return None
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append(tool_call(node.func.id, json.dumps(arguments)))
    except (SyntaxError, ValueError, TypeError):
        return None
    return calls


def _granite_calls(text: str) -> list[dict[str, Any]] | None:
    """`<|tool_call|>[...]` or `<tool_call>[...]` (or the bare list): a JSON list of calls."""
    body = text.removeprefix(GRANITE_TOOL_CALL).removeprefix(OPEN).strip()
    return _listed_calls(body)


def _functools_calls(text: str) -> list[dict[str, Any]] | None:
    """`functools[...]`: a JSON list of calls."""
    return _listed_calls(text.removeprefix(FUNCTOOLS).strip())


def _listed_calls(body: str) -> list[dict[str, Any]] | None:
    """A JSON list of `{"name", "arguments"}` objects; None where `body` is not one."""
    return _block_calls(body) if body.startswith("[") else None


@dataclass(slots=True)
class MistralReader:
    """Streams text until `[TOOL_CALLS]` (a partial tag held back), then holds the rest of the
    reply and reads it whole as calls."""

    _buffer: str = ""
    _calls: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buffer += text
        if self._calls:
            return "", []
        start = self._buffer.find(TOOL_CALLS)
        if start >= 0:
            content = self._buffer[:start]
            self._buffer = self._buffer[start + len(TOOL_CALLS) :]
            self._calls = True
            return content, []
        keep = partial_tag(self._buffer, TOOL_CALLS)
        content = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return content, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self._buffer = self._buffer, ""
        if not self._calls:
            return text, []
        calls = _mistral_calls(text.strip())
        return ("", calls) if calls else (TOOL_CALLS + text, [])


def _mistral_calls(body: str) -> list[dict[str, Any]] | None:
    """A JSON list (or objects) of calls, or `NAME[ARGS]{...}` / `NAME{...}` calls each after
    its own `[TOOL_CALLS]`."""
    if body.startswith(("[", "{")):
        try:
            parsed = json_text.loads(body)
        except ValueError:
            return _llama3_calls(body)
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [_read_call(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]
    named = []
    for part in body.split(TOOL_CALLS):
        brace = part.find("{")
        name = part[:brace].removesuffix(ARGS).strip() if brace > 0 else ""
        try:
            arguments = json_text.loads(part[brace:])
        except ValueError:
            return None
        if not name or not isinstance(arguments, dict):
            return None
        named.append(tool_call(name, json.dumps(arguments)))
    return named


def _xml_calls(body: str, schemas: Schemas) -> list[dict[str, Any]] | None:
    """One `<function=NAME>` element of `<parameter=KEY>VALUE</parameter>` elements (Qwen3-Coder's
    call), each value read by the type its tool's schema gives it; None if it is not one."""
    text = body.strip()
    if not (text.startswith(FUNCTION) and text.endswith("</function>")):
        return None
    name, _, rest = text[len(FUNCTION) : -len("</function>")].partition(">")
    properties = (schemas.get(name.strip()) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    while True:
        rest = rest.strip()
        if not rest:
            break
        if not rest.startswith(PARAMETER):
            return None
        key, found, rest = rest[len(PARAMETER) :].partition(">")
        value, closed, rest = rest.partition("</parameter>")
        if not (found and closed):
            return None
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[key.strip()] = _typed(value, properties.get(key.strip()))
    if not name.strip():
        return None
    return [tool_call(name.strip(), json.dumps(arguments))]


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: text where the schema says string (or says
    nothing and the text is not JSON), else the JSON it spells."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json_text.loads(value)
    except ValueError:
        return value


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


def _block_calls(body: str) -> list[dict[str, Any]] | None:
    """The calls in one `<tool_call>` block: one object, or a list of them (the form SmolLM2 and
    Conveyor's written tools use); None if it is not calls."""
    try:
        parsed = json_text.loads(body)
    except ValueError:
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = [_read_call(item) for item in items]
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _call(body: str) -> dict[str, Any] | None:
    try:
        parsed = json_text.loads(body)
    except ValueError:
        return None
    return _read_call(parsed)


def _read_call(parsed: Any) -> dict[str, Any] | None:
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return tool_call(parsed["name"], text)


def partial_tag(text: str, tag: str) -> int:
    """How many of `text`'s last characters may begin `tag` (text a stream holds back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
