"""The calls a `"required"` tool_choice produces, read as they stream.

The output is a JSON array of `{"name": ..., "parameters": {...}}` objects (the structured
output enforces it). `CallArrayReader` turns it into OpenAI's `delta.tool_calls` entries: a
call's first entry carries its `id`, `type` and `function.name` once the name is complete,
later ones the text of its arguments as it arrives. Fed the whole output at once, the same
entries assemble into the non-streamed calls, so both agree, even for an output cut short.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class _Call:
    name: str | None = None
    announced: bool = False
    pending: list[str] = field(default_factory=list)  # arguments that arrived before the name


@dataclass(slots=True)
class CallArrayReader:
    """A character-level scanner of the array: depth, strings, and within each call object
    which key's value is being read."""

    _calls: list[_Call] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _string: list[str] = field(default_factory=list)
    _key: str | None = None
    _expect_key: bool = False
    _in_arguments: bool = False
    _started: bool = False  # whether the arguments' value has begun
    _blanks: str = ""  # blanks in the arguments, held until the value goes on past them

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The `tool_calls` delta entries `text` completes."""
        entries: list[dict[str, Any]] = []
        arguments: list[str] = []
        for char in text:
            if self._in_arguments and not self._ends_arguments(char):
                self._argument_char(char, arguments)
                continue
            if arguments:
                entries += self._arguments("".join(arguments))
                arguments = []
            entries += self._step(char)
        if arguments:
            entries += self._arguments("".join(arguments))
        return entries

    def _argument_char(self, char: str, arguments: list[str]) -> None:
        """Blanks around the value are not part of it: leading ones are dropped, others held."""
        if char.isspace() and not self._in_string:
            self._blanks += char
            return
        if self._blanks and self._started:
            arguments.append(self._blanks)
        self._blanks, self._started = "", True
        arguments.append(char)
        self._lex(char)

    def _ends_arguments(self, char: str) -> bool:
        """A `,` or `}` back at the call object's own depth, outside strings, ends its value."""
        if self._depth == 2 and not self._in_string and char in ",}":
            self._in_arguments, self._blanks = False, ""
            return True
        return False

    def _lex(self, char: str) -> None:
        """Track strings and depth inside the arguments' value."""
        if self._in_string:
            self._string_ends(char)
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1

    def _step(self, char: str) -> list[dict[str, Any]]:
        """One character outside the arguments: keys, the name, the structure."""
        if self._in_string:
            return self._string_char(char)
        if char == '"':
            self._in_string, self._string = True, []
        elif char in "{[":
            self._depth += 1
            if self._depth == 2:
                self._calls.append(_Call())
                self._expect_key = True
        elif char in "}]":
            self._depth -= 1
        elif char == "," and self._depth == 2:
            self._expect_key = True
        elif char == ":" and self._depth == 2:
            self._expect_key = False
            self._in_arguments = self._key in ("parameters", "arguments")
            self._started = False
        return []

    def _string_ends(self, char: str) -> bool:
        """Follow a string's escapes; whether `char` closes it."""
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            return True
        return False

    def _string_char(self, char: str) -> list[dict[str, Any]]:
        if self._string_ends(char):
            if self._depth != 2:
                return []
            value = json.loads('"' + "".join(self._string) + '"')
            if self._expect_key:
                self._key = value
            elif self._key == "name":
                self._calls[-1].name = value
                return self._announce()
            return []
        self._string.append(char)
        return []

    def _announce(self) -> list[dict[str, Any]]:
        call, index = self._calls[-1], len(self._calls) - 1
        call.announced = True
        arguments, call.pending = "".join(call.pending), []
        function = {"name": call.name, "arguments": arguments}
        return [{"index": index, "id": new_call_id(), "type": "function", "function": function}]

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        call = self._calls[-1]
        if not call.announced:
            call.pending.append(text)
            return []
        return [{"index": len(self._calls) - 1, "function": {"arguments": text}}]


def assemble(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole calls from delta entries, as a client's stream helper builds them."""
    calls: dict[int, dict[str, Any]] = {}
    for entry in entries:
        if "id" in entry:
            calls[entry["index"]] = {
                "id": entry["id"],
                "type": "function",
                "function": dict(entry["function"]),
            }
        else:
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    return [calls[index] for index in sorted(calls)]
