"""Reading tool calls out of a model's free text (`tool_choice: "auto"`), in the format its chat
template teaches:

- `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5
  and Qwen3 write them (a block may also hold a list of such objects, as SmolLM2 writes them).
  The streaming reader holds back text that may be the start of a tag until it is known not to
  be, and hands out each call whole once its closing tag arrives; text outside the calls is
  content.
- `llama3_json`: the whole reply is one or more `{"name": ..., "parameters": {...}}` objects
  (after an optional `<|python_tag|>`, separated by `;`), as Llama 3.1-3.3 write them. A reply
  that opens with `{` is held until it ends, then read; any other reply is content.

(vLLM's parsers of the same names read the same formats.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.tools import tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PARSERS = ("hermes", "llama3_json")


def parser_for(name: str | None, chat_template: str | None) -> str | None:
    """The parser `--tool-call-parser` names, else the one the chat template's own tags show,
    else None (calls are not read from free text)."""
    if name is not None:
        return name
    if chat_template and OPEN in chat_template:
        return "hermes"
    if chat_template and PYTHON_TAG in chat_template:
        return "llama3_json"
    return None


def reader_for(parser: str) -> HermesReader | Llama3JsonReader:
    return HermesReader() if parser == "hermes" else Llama3JsonReader()


def parse_calls(parser: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The text outside the calls (None if only blanks) and the calls, from a whole output."""
    reader = reader_for(parser)
    content, calls = reader.feed(text)
    rest, more = reader.finish()
    content += rest
    calls += more
    return (content if content.strip() else None), calls


@dataclass(slots=True)
class HermesReader:
    """Reads calls out of text arriving in pieces cut anywhere."""

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
                block = _block_calls(body)
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
class Llama3JsonReader:
    """Holds a reply that opens with `{` (or the python tag) until it ends; streams any other."""

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
            self._holding = start.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(start)
        if self._holding:
            return "", []
        released, self._buffer = self._buffer, ""
        return released, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self._buffer = self._buffer, ""
        if not self._holding:
            return text, []
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        calls = [_call(part) for part in _json_objects(body)]
        if body and calls and all(call is not None for call in calls):
            return "", [call for call in calls if call is not None]
        return text, []


def _json_objects(body: str) -> list[str]:
    """`body` cut into the JSON objects it holds one after another (`;` or blanks between)."""
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
        parsed = json.loads(body)
    except ValueError:
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = [_read_call(item) for item in items]
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _call(body: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
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
