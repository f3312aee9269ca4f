"""Tool calls read while they are still arriving, so a stream hands out each call as soon as it
has begun in its format and its arguments as they grow (as vLLM's parsers stream them).

A scanner reads a block's (or a held reply's) text in pieces and keeps the calls it has seen so
far: a call once it has begun in its format, and of its arguments the text that cannot change,
written as the whole reader (`server/call_formats.py`) writes them. When the block ends,
`settle` chooses the calls it holds: the reader's where they go on from what was streamed, else
the scanner's (a block that turned out malformed, or a reply cut short, keeps the calls that
began). A block fed whole and one fed in pieces settle alike, so a stream and a whole reply
agree. `CallNumbers` turns the calls into OpenAI's `delta.tool_calls` entries.

- `JsonCalls`: `{"name", "arguments"}` objects or lists of them (`hermes`, `internlm`,
  `longcat`, the `<tool_calls>` blocks, and the JSON whole-reply formats), or Apertus'
  `{"NAME": {...}}`: a call once it is named and its arguments' object begins, then that object
  as it grows.
- `DelimitedCalls`: `BEGIN head SEP {...} END` calls (`kimi_k2`, `deepseek_v31`, Mistral's
  `NAME[ARGS]{...}`, and `deepseek_v3` with the arguments fenced), the same way.
- `HeldCalls`: the calls of a reply held whole until it ends (`llama3_json`, `mistral`, ...).

Calls written as elements of parameters are read by `server/call_elements.py`, calls written
as Python by `server/call_python.py`, Gemma's call syntax by `server/call_gemma.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.call_array import new_call_id
from server.call_formats import ARGS as MISTRAL_ARGS
from server.call_formats import TOOL_CALLS as MISTRAL_CALLS
from server.call_formats import Calls, plain_head
from server.json_stream import JsonWriter

ARGUMENT_KEYS = ("arguments", "parameters")
FENCE, JSON_FENCE = "```", "```json"


@dataclass(slots=True)
class PartialCall:
    """A call as far as it is known: its name, the start of its arguments' text (kept in the
    pieces it came in, `size` characters), and its id where the format writes one (Kimi's)."""

    name: str
    id: str | None = None
    size: int = 0
    _pieces: list[str] = field(default_factory=list)

    @classmethod
    def whole(cls, name: str, arguments: str, call_id: str | None = None) -> PartialCall:
        call = cls(name, call_id)
        call.write(arguments)
        return call

    @property
    def arguments(self) -> str:
        return "".join(self._pieces)

    def write(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self.size += len(text)

    def since(self, start: int) -> str:
        """The arguments' text from character `start` on (read from the last pieces back)."""
        tail, at = [], self.size
        for piece in reversed(self._pieces):
            if at <= start:
                break
            at -= len(piece)
            tail.append(piece[max(start - at, 0) :])
        return "".join(reversed(tail))


class BlockScanner(Protocol):
    @property
    def calls(self) -> list[PartialCall]: ...

    def feed(self, text: str) -> None: ...


def settle(partial: list[PartialCall], whole: Calls | None) -> list[PartialCall]:
    """A block's calls once it has ended: `whole` (its reader's) where they go on from
    `partial` (what the scanner streamed), else `partial`, each with arguments at least `{}`."""
    if whole is not None and _goes_on(partial, whole):
        return [_partial(call) for call in whole]
    return [PartialCall.whole(call.name, call.arguments or "{}", call.id) for call in partial]


def _partial(call: dict[str, Any]) -> PartialCall:
    function = call["function"]
    return PartialCall.whole(function["name"], function["arguments"], call["id"])


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
    _sent: list[int] = field(default_factory=list)  # how much of each call's arguments is sent

    def entries(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        """The entries that bring the client up to `calls` (the current block's so far)."""
        entries: list[dict[str, Any]] = []
        for number, call in enumerate(calls):
            index = self._base + number
            if number == len(self._sent):
                function = {"name": call.name, "arguments": call.arguments}
                call_id = call.id or new_call_id()
                entries.append(
                    {"index": index, "id": call_id, "type": "function", "function": function}
                )
                self._sent.append(call.size)
            elif call.size > self._sent[number]:
                more = call.since(self._sent[number])
                entries.append({"index": index, "function": {"arguments": more}})
                self._sent[number] = call.size
        return entries

    def next_block(self) -> None:
        self._base += len(self._sent)
        self._sent = []


@dataclass(slots=True)
class _Object:
    """One call object being read: the call as far as it goes. It shows once it has a name and
    its arguments have begun as an object, or once the object ends with a name."""

    call: PartialCall = field(default_factory=lambda: PartialCall(""))
    named: bool = False
    opened: bool = False  # whether its arguments have begun as an object
    argued: bool = False  # whether an arguments key has been read (later ones are not)
    shown: bool = False


@dataclass(slots=True)
class JsonCalls:
    """Call objects, or lists of them, one after another (`;` or `,` between them or not), read a
    character at a time; `keyed`: each object's key is the call's name and its value the
    arguments (`{"NAME": {...}}`, Apertus')."""

    keyed: bool = False
    calls: list[PartialCall] = field(default_factory=list)
    _state: str = "start"
    _in_list: bool = False
    _object: _Object = field(default_factory=_Object)
    _key: str | None = None
    _writer: JsonWriter = field(default_factory=JsonWriter)
    _value: list[str] = field(default_factory=list)
    _begun: bool = False  # whether the value being read has its first character
    _streams: bool = False  # whether it is arguments begun as an object

    def feed(self, text: str) -> None:
        at = 0
        while at < len(text):
            if self._state == "value" and self._streams:  # a string's plain run at once
                written, end = self._writer.run(text, at)
                if end > at:
                    self._object.call.write(written)
                    at = end
                    continue
            char = text[at]
            at += 1
            if self._state == "value":
                if self._value_char(char):
                    continue
            elif self._state == "key":
                self._key_char(char)
                continue
            if char in " \t\r\n" or self._state == "failed":
                continue
            self._structural(char)

    def _structural(self, char: str) -> None:
        state = self._state
        if state == "start" and char == "[":
            self._in_list, self._state = True, "list"
        elif state in ("start", "list") and char == "{":
            self._object, self._state = _Object(), "keys"
        elif state in ("start", "list") and char in ",;":
            pass
        elif state == "list" and char == "]":
            self._in_list, self._state = False, "start"
        elif state == "keys" and char == '"':
            self._writer, self._state = JsonWriter(), "key"
            self._value = [self._writer.push(char)[0]]
        elif state == "keys" and char == ",":
            pass
        elif state == "keys" and char == "}":
            self._show(True)
            self._state = "list" if self._in_list else "start"
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
            current = self._object
            if self.keyed and not current.named:
                current.call.name, current.named = self._key or "", bool(self._key)
            self._state = "colon"

    def _value_char(self, char: str) -> bool:
        """Feed the value being read; whether it took `char`."""
        if not self._begun and char in " \t\r\n":
            return True
        writer, current = self._writer, self._object
        arguments = (self.keyed or self._key in ARGUMENT_KEYS) and not current.argued
        if not self._begun:
            self._begun, self._streams = True, arguments and char == "{"
            if self._streams:
                current.opened = True
                self._show(current.named)
        written, took = writer.push(char)
        if self._streams:
            current.call.write(written)
        elif self._key == "name":
            self._value.append(written)
        if writer.failed:
            self._state = "failed"
        elif writer.done:
            self._value_done(arguments)
        return took

    def _value_done(self, arguments: bool) -> None:
        current = self._object
        if arguments:
            current.argued = True
        elif not self.keyed and self._key == "name" and not current.named:
            name = json.loads("".join(self._value))
            if isinstance(name, str):
                current.call.name, current.named = name, True
                self._show(current.opened)
        self._state = "keys"

    def _show(self, ready: bool) -> None:
        current = self._object
        if ready and current.named and not current.shown:
            self.calls.append(current.call)
            current.shown = True


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
        self._call.write(text)

    def _write_json(self, writer: JsonWriter, text: str) -> None:
        """Feed `text` to `writer` until its value ends, writing what it writes into the call
        (a string's plain runs at once)."""
        at = 0
        while at < len(text) and not (writer.done or writer.failed):
            written, end = writer.run(text, at)
            if end == at:
                written, end = writer.push(text[at])[0], at + 1
            self._write(written)
            at = end

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
        text, ended, self._buffer = cut_at(self._buffer, tag)
        return text, ended


@dataclass(slots=True)
class DelimitedCalls(TagScanner):
    """`begin` HEAD `sep` ARGUMENTS `end` calls, blanks between them: `head` reads a head's
    name and id (None: not a call), the arguments are a JSON object. `fenced`: DeepSeek-V3's,
    where the head is `function`, the name a line after `sep`, then the arguments in a fenced
    block."""

    begin: str
    sep: str
    end: str
    head: Callable[[str], tuple[str, str | None] | None]
    fenced: bool = False
    _writer: JsonWriter = field(default_factory=JsonWriter)

    def _step(self) -> bool:
        if self._state == "between":
            return self._expect(((self.begin, "head"),)) is not None
        if self._state == "head":
            return self._head()
        if self._state == "name":
            return self._name_line()
        if self._state == "fence":
            return self._fence()
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
        head, self._buffer = self._buffer[:sep].strip(), self._buffer[sep + len(self.sep) :]
        if self.fenced:
            self._state = "name" if head == "function" else "failed"
            return self._state == "name"
        named = self.head(head)
        if named is None:
            self._state = "failed"
            return False
        self._begin(PartialCall(named[0], id=named[1]))
        self._state, self._writer = "arguments", JsonWriter()
        return True

    def _name_line(self) -> bool:
        end = self._buffer.find("\n")
        if end < 0:
            return False
        name, self._buffer = self._buffer[:end].strip(), self._buffer[end + 1 :]
        if not name:
            self._state = "failed"
            return False
        self._begin(PartialCall(name))
        self._state = "fence"
        return True

    def _fence(self) -> bool:
        """Past the fence (` ``` ` or ` ```json `) that opens the arguments."""
        rest = self._buffer.lstrip()
        if rest.startswith(JSON_FENCE):
            self._buffer = rest[len(JSON_FENCE) :]
        elif JSON_FENCE.startswith(rest):
            return False  # it may still be either
        elif rest.startswith(FENCE):
            self._buffer = rest[len(FENCE) :]
        else:
            self._state = "failed"
            return False
        self._state, self._writer = "arguments", JsonWriter()
        return True

    def _arguments(self, text: str) -> None:
        """The call once its arguments begin as an object (anything else is not a call in the
        format), then their text as it grows."""
        if not self._shown:
            text = text.lstrip()
            if not text:
                return
            if not text.startswith("{"):
                self._state = "failed"
                return
            self._show()
        self._write_json(self._writer, text)


@dataclass(slots=True)
class MistralCalls:
    """What follows Mistral's `[TOOL_CALLS]`: a JSON list (or objects) of calls, or
    `NAME[ARGS]{...}` calls, each after its own `[TOOL_CALLS]`."""

    _inner: BlockScanner | None = None
    _start: str = ""

    @property
    def calls(self) -> list[PartialCall]:
        return [] if self._inner is None else self._inner.calls

    def feed(self, text: str) -> None:
        if self._inner is None:
            self._start += text
            start = self._start.lstrip()
            if not start:
                return
            self._inner = (
                JsonCalls()
                if start[0] in "[{"
                else DelimitedCalls("", MISTRAL_ARGS, MISTRAL_CALLS, plain_head)
            )
            text, self._start = start, ""
        self._inner.feed(text)


@dataclass(slots=True)
class HeldCalls:
    """Calls streamed out of a reply held to be read whole at its end: `scan` starts once the
    text is past whichever of `skip` (a tag that opens the calls) it begins with."""

    scan: Callable[[], BlockScanner] | None
    skip: tuple[str, ...] = ()
    numbers: CallNumbers = field(default_factory=CallNumbers)
    _scanner: BlockScanner | None = None
    _start: str = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The entries `text` (more of the held reply) lets be sent."""
        if self.scan is None:
            return []
        if self._scanner is None:
            self._start += text
            start = self._start.lstrip()
            if not start or may_still_begin(start, self.skip):
                return []  # an opening tag may still be arriving
            opening = next((tag for tag in self.skip if start.startswith(tag)), "")
            self._scanner, self._start, text = self.scan(), "", start[len(opening) :]
        self._scanner.feed(text)
        return self.numbers.entries(self._scanner.calls)

    def end(self, whole: Calls | None) -> tuple[bool, list[dict[str, Any]]]:
        """Whether the reply holds calls once it has ended (`whole`: its reader's), and the
        entries left to send."""
        calls = settle([] if self._scanner is None else self._scanner.calls, whole)
        return bool(calls), self.numbers.entries(calls)


def may_still_begin(start: str, tags: tuple[str, ...]) -> bool:
    """Whether `start` is a proper beginning of one of `tags` (more text will tell)."""
    return any(tag.startswith(start) and tag != start for tag in tags)


def cut_at(text: str, tag: str) -> tuple[str, bool, str]:
    """`text` before `tag`, whether the tag has come, and what is left to read: the text after
    the tag, or, where it has not come, the end of `text` that may begin it (held back)."""
    end = text.find(tag)
    if end >= 0:
        return text[:end], True, text[end + len(tag) :]
    ready = len(text) - partial_tag(text, tag)
    return text[:ready], False, text[ready:]


def partial_tag(text: str, tag: str) -> int:
    """How many of `text`'s last characters may begin `tag` (text a stream holds back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
