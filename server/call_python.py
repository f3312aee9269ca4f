"""Tool calls written as Python calls, read while they arrive (see `server/call_stream.py`): a
list of them (`pythonic`, as Llama 3.2 and Llama 4 write them) or one a line (`olmo3`).

Each argument goes into the arguments as JSON once its value is complete: at the `,` or `)`
that ends it outside strings and brackets, read as a Python literal. A call shows once its
first argument has been read so (or its closing parenthesis is written).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from server.call_formats import python_expression, python_json
from server.call_stream import PartialCall, TagScanner

_VALUE_ENDS = ",)"


@dataclass(slots=True)
class PythonCalls(TagScanner):
    """`listed`: a Python list of calls, `[name(key=value, ...), ...]`; else one call a line.
    `json_names`: JSON's `true`, `false` and `null` read as Python's literals (OLMo 3's)."""

    listed: bool = True
    json_names: bool = False
    _value: list[str] = field(default_factory=list)  # the value read so far
    _quote: str | None = None  # the quotes of the string the value is inside
    _escape: bool = False
    _depth: int = 0  # brackets open in the value
    _keys: int = 0

    def _step(self) -> bool:
        state = self._state
        if state == "between":
            return self._opening()
        if state == "name":
            return self._named()
        if state == "key":
            return self._keyed()
        if state == "value":
            return self._valued()
        if state == "next":
            return self._next()
        if state == "after":
            return self._after()
        self._buffer = ""  # the list has ended: the rest is the whole reading's to judge
        return False

    def _opening(self) -> bool:
        if not self.listed:
            self._state = "name"
            return True
        return self._expect((("[", "name"),)) is not None

    def _named(self) -> bool:
        start = self._buffer.find("(")
        if start < 0:
            return False
        name, self._buffer = self._buffer[:start].strip(), self._buffer[start + 1 :]
        if not name.isidentifier():
            self._state = "failed"
            return False
        self._begin(PartialCall(name))
        self._keys, self._state = 0, "key"
        return True

    def _keyed(self) -> bool:
        rest = self._buffer.lstrip()
        if rest.startswith(")"):
            self._buffer = rest[1:]
            return self._end_call()
        equals = rest.find("=")
        if equals < 0:
            return False
        key, self._buffer = rest[:equals].strip(), rest[equals + 1 :]
        if not key.isidentifier():
            self._state = "failed"
            return False
        self._write(("{" if self._keys == 0 else ", ") + json.dumps(key) + ": ")
        self._keys += 1
        self._value, self._quote, self._escape, self._depth = [], None, False, 0
        self._state = "value"
        return True

    def _valued(self) -> bool:
        """Read the value up to the `,` or `)` that ends it outside strings and brackets."""
        end = self._value_end()
        if end < 0:
            return False
        node = python_expression(("".join(self._value) + self._buffer[:end]).strip())
        value = None if node is None else python_json(node, self.json_names)
        if value is None:
            self._state = "failed"
            return False
        self._show()
        self._write(value)
        self._buffer, self._state = self._buffer[end:], "next"
        return True

    def _value_end(self) -> int:
        """Where in the buffer the value ends; -1 while it goes on (what was read moves into
        `_value`, but for a quote that may open a triple-quoted string)."""
        buffer, at = self._buffer, 0
        while at < len(buffer):
            char = buffer[at]
            if self._quote is not None:
                near_end = len(buffer) - at < 3
                if near_end and len(self._quote) == 3 and self._quote.startswith(buffer[at:]):
                    break  # it may close the string: wait for what follows
                at += self._in_string(buffer, at)
                continue
            if char in "\"'":
                if len(buffer) - at < 3:
                    break  # it may open a triple-quoted string: wait for what follows
                self._quote = char * 3 if buffer.startswith(char * 3, at) else char
                at += len(self._quote)
                continue
            if self._depth == 0 and char in _VALUE_ENDS:
                return at
            self._depth += 1 if char in "([{" else -1 if char in ")]}" else 0
            at += 1
        self._value.append(buffer[:at])
        self._buffer = buffer[at:]
        return -1

    def _in_string(self, buffer: str, at: int) -> int:
        """How many characters of a string's text to move past."""
        assert self._quote is not None
        if self._escape:
            self._escape = False
        elif buffer[at] == "\\":
            self._escape = True
        elif buffer.startswith(self._quote, at):
            size, self._quote = len(self._quote), None
            return size
        return 1

    def _next(self) -> bool:
        tag = self._expect(((",", "key"), (")", "after")))
        if tag == ")":
            return self._end_call()
        return tag is not None

    def _end_call(self) -> bool:
        self._show()
        self._write("}" if self._keys else "{}")
        self._state = "after"
        return True

    def _after(self) -> bool:
        if not self.listed:
            self._state = "name"
            return True
        return self._expect(((",", "name"), ("]", "end"))) is not None
