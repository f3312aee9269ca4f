"""Tool calls read while their block is still arriving, so a stream hands out each call's name
as soon as it is written and its arguments as they grow (as vLLM's parsers stream them).

A scanner reads one block's text in pieces and keeps the calls it has seen so far: a call once
it has begun in its format, and of its arguments the text that cannot change, written as the whole
block's reader (`server/call_formats.py`) writes them. When the block ends, `settle` chooses
the calls it holds: the reader's where they go on from what was streamed, else the scanner's
(a block that turned out malformed, or a reply cut short, keeps the calls that began). A block
fed whole and one fed in pieces settle alike, so a stream and a whole reply agree.

- `JsonCalls`: a `{"name", "arguments"}` object or a list of them (`hermes`, `internlm`,
  `longcat`): an object's or a list's arguments stream as JSON.
- `DelimitedCalls`: `BEGIN head SEP {...} END` calls (`kimi_k2`, `deepseek_v31`): the name
  (and Kimi's id) once the head is written, the arguments' JSON object as it grows.

Formats that write calls as elements of parameters are read by `server/call_elements.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.call_array import new_call_id
from server.call_formats import Calls
from server.json_stream import JsonWriter

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class PartialCall:
    """A call as far as it is known: its name, the start of its arguments' text, and its id
    where the format writes one (Kimi's)."""

    name: str
    arguments: str = ""
    id: str | None = None


class BlockScanner(Protocol):
    calls: list[PartialCall]

    def feed(self, text: str) -> None: ...


def settle(partial: list[PartialCall], whole: Calls | None) -> list[PartialCall]:
    """A block's calls once it has ended: `whole` (its reader's) where they go on from
    `partial` (what the scanner streamed), else `partial`, each with arguments at least `{}`."""
    if whole is not None and _goes_on(partial, whole):
        return [_partial(call) for call in whole]
    return [PartialCall(call.name, call.arguments or "{}", call.id) for call in partial]


def _partial(call: dict[str, Any]) -> PartialCall:
    return PartialCall(call["function"]["name"], call["function"]["arguments"], call["id"])


def _goes_on(partial: list[PartialCall], whole: Calls) -> bool:
    if len(whole) < len(partial):
        return False
    for seen, call in zip(partial, whole, strict=False):
        function = call["function"]
        if function["name"] != seen.name or not function["arguments"].startswith(seen.arguments):
            return False
        if seen.id is not None and call["id"] != seen.id:
            return False
    return True


@dataclass(slots=True)
class CallNumbers:
    """The entries that tell a client of calls as they grow: each call numbered after the
    reply's earlier ones, announced once, then its arguments' new text."""

    _base: int = 0  # calls of the reply's earlier blocks
    _sent: list[tuple[str, int]] = field(default_factory=list)  # id, arguments sent, per call

    def entries(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = []
        for number, call in enumerate(calls):
            index = self._base + number
            if number == len(self._sent):
                call_id = call.id or new_call_id()
                function = {"name": call.name, "arguments": call.arguments}
                entries.append(
                    {"index": index, "id": call_id, "type": "function", "function": function}
                )
                self._sent.append((call_id, len(call.arguments)))
                continue
            call_id, sent = self._sent[number]
            if len(call.arguments) > sent:
                entries.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
                self._sent[number] = (call_id, len(call.arguments))
        return entries

    def next_block(self) -> None:
        self._base += len(self._sent)
        self._sent = []

    def whole(self, calls: Calls) -> list[dict[str, Any]]:
        """list[dict[str, Any]] of whole calls, numbered after the earlier ones."""
        entries = self.entries([_partial(call) for call in calls])
        self.next_block()
        return entries


@dataclass(slots=True)
class _Object:
    """One call object being read: its keys' values as far as they go."""

    name: str | None = None
    arguments: list[str] = field(default_factory=list)  # before the name is known
    argued: bool = False  # whether an arguments key has been read (later ones are not)
    call: PartialCall | None = None


@dataclass(slots=True)
class JsonCalls:
    """A call object, or a list of them, read a character at a time."""

    calls: list[PartialCall] = field(default_factory=list)
    _state: str = "start"
    _in_list: bool = False
    _object: _Object = field(default_factory=_Object)
    _key: str | None = None
    _writer: JsonWriter = field(default_factory=JsonWriter)
    _value: list[str] = field(default_factory=list)
    _begun: bool = False  # whether the value being read has its first character
    _streams: bool = False  # whether it is arguments begun as an object or array

    def feed(self, text: str) -> None:
        for char in text:
            if self._state == "value":
                if self._value_char(char):
                    continue
            elif self._state == "key":
                self._key_char(char)
                continue
            if char in " \t\r\n" or self._state in ("end", "failed"):
                continue
            self._structural(char)

    def _structural(self, char: str) -> None:
        state = self._state
        if state == "start" and char == "[":
            self._in_list, self._state = True, "list"
        elif state in ("start", "list") and char == "{":
            self._object, self._state = _Object(), "keys"
        elif state == "list" and char == ",":
            pass
        elif state == "list" and char == "]":
            self._state = "end"
        elif state == "keys" and char == '"':
            self._writer, self._state = JsonWriter(), "key"
            self._value = [self._writer.push(char)[0]]
        elif state == "keys" and char in ",}":
            self._state = "keys" if char == "," else ("list" if self._in_list else "end")
        elif state == "colon" and char == ":":
            self._writer, self._value, self._begun = JsonWriter(), [], False
            self._state = "value"
        else:
            self._state = "failed"

    def _key_char(self, char: str) -> None:
        written, _ = self._writer.push(char)
        self._value.append(written)
        if self._writer.done:
            self._key, self._value = json.loads("".join(self._value)), []
            self._state = "colon"

    def _value_char(self, char: str) -> bool:
        """Feed the value being read; whether it took `char`."""
        if not self._begun and char in " \t\r\n":
            return True
        writer, current = self._writer, self._object
        arguments = self._key in ARGUMENT_KEYS and not current.argued
        if not self._begun:
            self._begun, self._streams = True, arguments and char in "{["
        written, took = writer.push(char)
        if self._streams:
            self._argument_text(written)
        elif self._key == "name":
            self._value.append(written)
        if writer.failed:
            self._state = "failed"
        elif writer.done:
            self._value_done(arguments)
        return took

    def _argument_text(self, text: str) -> None:
        current = self._object
        if current.call is not None:
            current.call.arguments += text
        else:
            current.arguments.append(text)

    def _value_done(self, arguments: bool) -> None:
        current = self._object
        if arguments:
            current.argued = True
        elif self._key == "name" and current.name is None:
            name = json.loads("".join(self._value))
            if isinstance(name, str):
                current.name = name
                current.call = PartialCall(name, "".join(current.arguments))
                self.calls.append(current.call)
        self._state = "keys"


@dataclass(slots=True, kw_only=True)
class TagScanner:
    """What the scanners of tagged formats share: a buffer read in states, the tags that may
    come next, and text up to a closing tag."""

    calls: list[PartialCall] = field(default_factory=list)
    _buffer: str = ""
    _state: str = "between"
    # The call being read; it joins `calls` once its text shows it is a call in the format.
    _call: PartialCall = field(default_factory=lambda: PartialCall(""))
    _shown: bool = True

    def feed(self, text: str) -> None:
        self._buffer += text
        while self._buffer and self._state != "failed" and self._step():
            pass

    def _begin(self, call: PartialCall) -> None:
        self._call, self._shown = call, False

    def _show(self) -> None:
        if not self._shown:
            self.calls.append(self._call)
            self._shown = True

    def _write(self, text: str) -> None:
        self._call.arguments += text

    def _step(self) -> bool:
        """Read what the buffer holds in the current state; whether to go on."""
        raise NotImplementedError

    def _expect(self, tags: tuple[tuple[str, str], ...]) -> str | None:
        """Move past one of `tags` (blanks before it) to its state and return it; wait (None)
        while the buffer may still begin one; fail on anything else."""
        rest = self._buffer.lstrip()
        for tag, state in tags:
            if rest.startswith(tag):
                self._buffer, self._state = rest[len(tag) :], state
                return tag
        if not any(tag.startswith(rest) for tag, _ in tags):
            self._state = "failed"
        return None

    def _until(self, tag: str) -> tuple[str, bool]:
        """The buffer's text before `tag` and whether the tag has come (the buffer then goes on
        after it); text that may begin the tag is held back."""
        end = self._buffer.find(tag)
        if end >= 0:
            text, self._buffer = self._buffer[:end], self._buffer[end + len(tag) :]
            return text, True
        keep = partial_tag(self._buffer, tag)
        text = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return text, False


@dataclass(slots=True)
class DelimitedCalls(TagScanner):
    """`begin` HEAD `sep` ARGUMENTS `end` calls, blanks between them: `head` reads a head's
    name and id (None: not a call), the arguments are a JSON object."""

    begin: str
    sep: str
    end: str
    head: Callable[[str], tuple[str, str | None] | None]
    _writer: JsonWriter = field(default_factory=JsonWriter)

    def _step(self) -> bool:
        if self._state == "between":
            return self._expect(((self.begin, "head"),)) is not None
        if self._state == "head":
            return self._head()
        text, ended = self._until(self.end)
        self._arguments(text)
        if ended and self._state != "failed":
            self._state = "between"
            return True
        return False

    def _head(self) -> bool:
        sep = self._buffer.find(self.sep)
        if sep < 0:
            return False
        named = self.head(self._buffer[:sep].strip())
        if named is None:
            self._state = "failed"
            return False
        self._begin(PartialCall(named[0], id=named[1]))
        self._buffer, self._state = self._buffer[sep + len(self.sep) :], "arguments"
        self._writer = JsonWriter()
        return True

    def _arguments(self, text: str) -> None:
        """The call once its arguments begin as an object (anything else is not a call in the
        format), then their text as it grows."""
        for char in text:
            if not self._shown:
                if char in " \t\r\n":
                    continue
                if char != "{":
                    self._state = "failed"
                    return
                self._show()
            if self._writer.done or self._writer.failed:
                return
            self._write(self._writer.push(char)[0])


def partial_tag(text: str, tag: str) -> int:
    """How many of `text`'s last characters may begin `tag` (text a stream holds back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
