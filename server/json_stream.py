"""One JSON value arriving a character at a time, written again as `json.dumps(json.loads(...))`
writes it (`", "` and `": "` between the parts, ASCII escapes), so far as it can be known: a
container's brackets and keys as they come, a string's characters as they arrive, a number or
literal once it ends. What it has written never changes, and once the value is complete the
whole equals `json.dumps` of it (but for a key written twice, which `json.loads` keeps once).

A model's tool-call arguments stream through it while the text of the call is still arriving.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum, auto

from server.json_text import MAX_DEPTH

# What each one-character escape (after its backslash) stands for.
_SIMPLE_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}
_HEX = frozenset("0123456789abcdefABCDEF")
_PLAIN = re.compile(r'[^"\\]+')
_SCALAR_ENDS = frozenset(',]}:"[{ \t\r\n')


class Want(Enum):
    VALUE = auto()  # a value (or, straight after `[`, the array's end)
    KEY = auto()  # a key (or, straight after `{`, the object's end)
    COLON = auto()
    NEXT = auto()  # `,` or the container's end
    DONE = auto()
    FAILED = auto()


def escaped(text: str) -> str:
    """`text` as it stands inside `json.dumps`'s quotes."""
    return json.dumps(text)[1:-1]


@dataclass(slots=True)
class JsonWriter:
    """Feed characters with `push`; `done` once the value is complete, `failed` where the text
    is not JSON (nothing more is written then)."""

    want: Want = Want.VALUE
    _stack: list[str] = field(default_factory=list)  # the open containers' brackets
    _first: bool = False  # straight after an opening bracket
    _string: bool = False  # inside a string
    _key: list[str] | None = None  # a key's characters, written once it closes
    _escape: str | None = None  # an escape's characters after its backslash
    _scalar: str = ""  # a number or literal's characters

    @property
    def done(self) -> bool:
        return self.want is Want.DONE

    @property
    def failed(self) -> bool:
        return self.want is Want.FAILED

    def push(self, char: str) -> tuple[str, bool]:
        """The text `char` lets be written, and whether the value took it (a number or literal at
        the top ends at the first character after it, which is not the value's)."""
        if self.want in (Want.DONE, Want.FAILED):
            return "", False
        if self._string:
            return self._string_char(char), True
        if self._scalar:
            if char not in _SCALAR_ENDS:
                self._scalar += char
                return "", True
            written = self._end_scalar()
            if self.want in (Want.DONE, Want.FAILED):
                return written, False
            more, took = self._structural(char)
            return written + more, took
        return self._structural(char)

    def run(self, text: str, at: int) -> tuple[str, int]:
        """Inside a string value (no escape begun): its plain characters from `at` up to the next
        quote or backslash, written at once, and where they end (`at` where there are none)."""
        if not self._string or self._escape is not None or self._key is not None:
            return "", at
        plain = _PLAIN.match(text, at)
        if plain is None:
            return "", at
        return escaped(plain.group()), plain.end()

    def _structural(self, char: str) -> tuple[str, bool]:
        if char in " \t\r\n":
            return "", True
        want, first = self.want, self._first
        self._first = False
        if want is Want.VALUE:
            if first and char == "]":
                return self._close(char), True
            return self._value(char), True
        if want is Want.KEY:
            if first and char == "}":
                return self._close(char), True
            if char != '"':
                return self._fail(), True
            self._string, self._key = True, []
            return "", True
        if want is Want.COLON:
            if char != ":":
                return self._fail(), True
            self.want = Want.VALUE
            return ": ", True
        if char == ",":  # Want.NEXT
            self.want = Want.KEY if self._stack[-1] == "{" else Want.VALUE
            return ", ", True
        if char == {"{": "}", "[": "]"}[self._stack[-1]]:
            return self._close(char), True
        return self._fail(), True

    def _value(self, char: str) -> str:
        if char in "{[":
            if len(self._stack) >= MAX_DEPTH:
                return self._fail()
            self._stack.append(char)
            self.want, self._first = (Want.KEY if char == "{" else Want.VALUE), True
            return char
        if char == '"':
            self._string = True
            return '"'
        if char in _SCALAR_ENDS:
            return self._fail()
        self._scalar = char
        return ""

    def _close(self, bracket: str) -> str:
        self._stack.pop()
        self._after_value()
        return bracket

    def _after_value(self) -> None:
        self.want = Want.NEXT if self._stack else Want.DONE

    def _end_scalar(self) -> str:
        text, self._scalar = self._scalar, ""
        try:
            value = json.loads(text)
        except ValueError:
            return self._fail()
        self._after_value()
        return json.dumps(value)

    def _string_char(self, char: str) -> str:
        if self._escape is not None:
            return self._escape_char(char)
        if char == "\\":
            self._escape = ""
            return ""
        if char == '"':
            return self._end_string()
        return self._string_text(char)

    def _string_text(self, text: str) -> str:
        if self._key is not None:
            self._key.append(text)
            return ""
        return escaped(text)

    def _escape_char(self, char: str) -> str:
        assert self._escape is not None
        if self._escape == "":
            if char in _SIMPLE_ESCAPES:
                self._escape = None
                return self._string_text(_SIMPLE_ESCAPES[char])
            if char != "u":
                return self._fail()
            self._escape = "u"
            return ""
        if char not in _HEX:
            return self._fail()
        self._escape += char
        if len(self._escape) < 5:
            return ""
        unit, self._escape = chr(int(self._escape[1:], 16)), None
        return self._string_text(unit)

    def _end_string(self) -> str:
        self._string = False
        if self._key is not None:
            key, self._key = "".join(self._key), None
            self.want = Want.COLON
            return json.dumps(key)
        self._after_value()
        return '"'

    def _fail(self) -> str:
        self.want = Want.FAILED
        return ""

    def finish(self) -> str:
        """The text a number or literal at the top ends with when nothing follows it."""
        if self._scalar and not self._stack:
            return self._end_scalar()
        return ""
