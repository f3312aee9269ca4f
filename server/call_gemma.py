"""Tool calls in Gemma's call syntax, read while they arrive (see `server/call_stream.py`):

    call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{temp:<|"|>c<|"|>}}

Keys are bare, strings stand between a delimiter (Gemma 4's `<|"|>`, FunctionGemma's
`<escape>`) with no escapes inside, other values are numbers, `true`, `false`, `null`, nested
`{...}` objects or `[...]` lists; any other bare value is read as text. The arguments are
written as JSON as they come (`json.dumps`'s spacing), a string's characters as they arrive;
the whole block's reading (`calls`) is the same scanner run over the block, so a stream and a
whole reply agree.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from server.call_formats import BlockReader, Calls, Schemas
from server.call_stream import PartialCall, TagScanner
from server.json_stream import escaped
from server.json_text import MAX_DEPTH
from server.tools import tool_call

CALL = "call:"
GEMMA4_STRING, FUNCTIONGEMMA_STRING = '<|"|>', "<escape>"
_NAME = re.compile(r"[\w\-.]+")
_BARE_ENDS = re.compile(r"[,}\]]")


@dataclass(slots=True)
class GemmaCalls(TagScanner):
    """`call:NAME{...}` calls, their strings between `quote`s."""

    quote: str = GEMMA4_STRING
    _stack: list[str] = field(default_factory=list)  # the open objects' and lists' brackets
    _first: bool = True  # nothing written yet in the innermost object or list

    def _step(self) -> bool:
        state = self._state
        if state == "between":
            return self._expect(((CALL, "name"),)) is not None
        if state == "name":
            return self._named()
        if state == "string":
            return self._string()
        rest = self._buffer.lstrip()
        if not rest:
            self._buffer = ""
            return False
        self._buffer = rest
        if state == "key":
            return self._key()
        if state == "value":
            return self._value()
        return self._after()  # "after": a value has ended

    def _named(self) -> bool:
        brace = self._buffer.find("{")
        if brace < 0:
            return False
        name, self._buffer = self._buffer[:brace].strip(), self._buffer[brace + 1 :]
        if _NAME.fullmatch(name) is None:
            self._state = "failed"
            return False
        self._begin(PartialCall(name))
        self._show()  # `call:NAME{`: the call has begun
        self._open("{")
        return self._state != "failed"

    def _open(self, bracket: str) -> None:
        if len(self._stack) >= MAX_DEPTH:  # deeper than JSON is read back anywhere
            self._state = "failed"
            return
        self._stack.append(bracket)
        self._write(bracket)
        self._first, self._state = True, "key" if bracket == "{" else "value"

    def _key(self) -> bool:
        if self._buffer.startswith("}"):
            self._buffer = self._buffer[1:]
            return self._close("}")
        colon = self._buffer.find(":")
        if colon < 0:
            return False
        key, self._buffer = self._buffer[:colon].strip(), self._buffer[colon + 1 :]
        if not key or any(char in key for char in '{}[],"'):
            self._state = "failed"
            return False
        self._write(("" if self._first else ", ") + json.dumps(key) + ": ")
        self._first, self._state = False, "value"
        return True

    def _value(self) -> bool:
        """A value: a string, an object, a list, or a bare one (or, in a list, its end)."""
        buffer = self._buffer
        in_list = self._stack[-1] == "["
        if in_list and buffer.startswith("]"):
            self._buffer = buffer[1:]
            return self._close("]")
        separator = ", " if in_list and not self._first else ""
        if buffer.startswith(self.quote):
            self._buffer = buffer[len(self.quote) :]
            self._write(separator + '"')
            self._first, self._state = False, "string"
            return True
        if self.quote.startswith(buffer):
            return False  # it may still open a string
        if buffer[0] in "{[":
            self._buffer = buffer[1:]
            self._write(separator)
            self._open(buffer[0])
            return self._state != "failed"
        end = _BARE_ENDS.search(buffer)
        if end is None:
            return False
        self._write(separator + json.dumps(_bare(buffer[: end.start()].strip())))
        self._buffer, self._first, self._state = buffer[end.start() :], False, "after"
        return True

    def _string(self) -> bool:
        text, ended = self._until(self.quote)
        self._write(escaped(text) + ('"' if ended else ""))
        if ended:
            self._state = "after"
        return ended

    def _after(self) -> bool:
        char, self._buffer = self._buffer[0], self._buffer[1:]
        if char == ",":
            self._state = "key" if self._stack[-1] == "{" else "value"
            return True
        if char in "}]":
            return self._close(char)
        self._state = "failed"
        return False

    def _close(self, bracket: str) -> bool:
        if not self._stack or {"{": "}", "[": "]"}[self._stack[-1]] != bracket:
            self._state = "failed"
            return False
        self._stack.pop()
        self._write(bracket)
        self._first = False
        self._state = "after" if self._stack else "between"
        return True

    @property
    def complete(self) -> bool:
        """Whether every call read has ended, with nothing after them but blanks."""
        return self._state == "between" and not self._buffer.strip() and bool(self.calls)


def _bare(text: str) -> Any:
    """A bare value: a JSON number or literal where it spells one, else its text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if not isinstance(value, (str, list, dict)) else text


def gemma_reader(quote: str) -> BlockReader:
    """The whole block's reading: the scanner run over it, its calls where it read them all."""

    def read(body: str, schemas: Schemas | None = None) -> Calls | None:
        scanner = GemmaCalls(quote=quote)
        scanner.feed(body)
        if not scanner.complete:
            return None
        return [tool_call(call.name, call.arguments) for call in scanner.calls]

    return read
