"""Reading tool calls out of a model's free text (`tool_choice: "auto"`), in the format its chat
template teaches. `hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
as Qwen2.5 and Qwen3 write them (vLLM's `hermes` parser reads the same).

The streaming reader holds back text that may be the start of a tag until it is known not to be,
and hands out each call whole once its closing tag arrives; text outside the calls is content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from server.tools import tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)


def parser_for(name: str | None, chat_template: str | None) -> str | None:
    """The parser `--tool-call-parser` names, else the one the chat template's own tags show,
    else None (calls are not read from free text)."""
    if name is not None:
        return name
    if chat_template and OPEN in chat_template:
        return "hermes"
    return None


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The text outside the calls (None if only blanks) and the calls, from a whole output."""
    reader = HermesReader()
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
    _calls: int = field(default=0)

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
                call = _call(body)
                if call is None:  # not a call after all: keep the text as it was written
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = _partial_tag(self._buffer)
            content.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        self._calls += len(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the output ends: an unclosed call, or a partial tag, as text."""
        rest = (OPEN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        return rest, []


def _call(body: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return tool_call(parsed["name"], text)


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` may begin the opening tag."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
