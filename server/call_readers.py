"""The streaming readers of a reply's tool calls (`server/tool_parsers.py` makes the one a
format needs): text outside the calls as content, a possible tag held back until it is known
not to be one, and the calls as OpenAI's `delta.tool_calls` entries as they are written
(`server/call_stream.py`).

- `TaggedReader`: calls in blocks between tags, each block read as it arrives where the format
  has a scanner, else whole once it closes; a block the reply leaves open reads as if closed.
- `WholeReplyReader`: a reply that opens as calls is held from the content to its end, its
  calls streamed meanwhile; any other reply streams as content.
- `MistralReader`: text until `[TOOL_CALLS]`, then the calls to the end of the reply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from server import call_formats as formats
from server.call_formats import TOOL_CALLS, Calls
from server.call_stream import (
    BlockScanner,
    CallNumbers,
    HeldCalls,
    cut_at,
    may_still_begin,
    settle,
)

# OpenAI's `delta.tool_calls` entries: a call's first carries its `index`, `id`, `type` and
# `function` (`name` and the start of its `arguments`), later ones more of its arguments.
Entries = list[dict[str, Any]]


class CallReader(Protocol):
    def feed(self, text: str) -> tuple[str, Entries]: ...

    def finish(self) -> tuple[str, Entries]: ...


@dataclass(slots=True)
class TaggedReader:
    """Reads calls between `open` and `close` tags out of text arriving in pieces cut anywhere;
    `read` reads one block's calls (None: not calls, and the block stays text). With `scan`, a
    block's calls stream as it arrives (`server/call_stream.py`), else each whole once its
    block closes."""

    open: str
    close: str
    read: Callable[[str], Calls | None]
    scan: Callable[[], BlockScanner] | None = None
    _buffer: str = ""
    _in_call: bool = False
    _body: list[str] = field(default_factory=list)  # the open block's text so far
    _scanner: BlockScanner | None = None
    _calls: CallNumbers = field(default_factory=CallNumbers)

    def feed(self, text: str) -> tuple[str, Entries]:
        """Content that can be shown now, and the tool-call entries `text` completes."""
        self._buffer += text
        content: list[str] = []
        entries: Entries = []
        while True:
            if self._in_call:
                body, closed, self._buffer = cut_at(self._buffer, self.close)
                entries += self._block_text(body)
                if not closed:
                    break
                kept, done = self._end_block(closed=True)
                content.append(kept)
                entries += done
                continue
            before, opened, self._buffer = cut_at(self._buffer, self.open)
            content.append(before)
            if not opened:
                break
            self._in_call, self._body = True, []
            self._scanner = None if self.scan is None else self.scan()
        return "".join(content), entries

    def _block_text(self, text: str) -> Entries:
        """Take more of the open block; the entries its calls have grown by."""
        if not text:
            return []
        self._body.append(text)
        if self._scanner is None:
            return []
        self._scanner.feed(text)
        return self._calls.entries(self._scanner.calls)

    def _end_block(self, closed: bool) -> tuple[str, Entries]:
        """The block has ended (closed, or the reply ended inside it, which reads it as if
        closed): its calls, or its text where it holds none."""
        body = "".join(self._body)
        self._in_call, self._body = False, []
        streamed = [] if self._scanner is None else self._scanner.calls
        self._scanner = None
        calls = settle(streamed, self.read(body))
        if not calls:
            return self.open + body + (self.close if closed else ""), []
        entries = self._calls.entries(calls)
        self._calls.next_block()
        return "", entries

    def finish(self) -> tuple[str, Entries]:
        """What is left when the output ends: the calls of a block left open (or its text, where
        it holds none), or a partial tag, as text."""
        if not self._in_call:
            rest, self._buffer = self._buffer, ""
            return rest, []
        entries = self._block_text(self._buffer)
        self._buffer = ""
        text, done = self._end_block(closed=False)
        return text, entries + done


@dataclass(slots=True)
class WholeReplyReader:
    """Holds a reply that opens with one of `openers` until it ends, then reads it whole
    (`read`: the calls, or None where it is not calls, and the reply is content), its calls
    streamed meanwhile where `held` can; streams any other reply."""

    openers: tuple[str, ...]
    read: Callable[[str], Calls | None]
    held: HeldCalls
    _pieces: list[str] = field(default_factory=list)  # the reply held so far
    _start: str = ""  # its start past blanks, while undecided
    _holding: bool | None = None  # None until the reply's start shows whether it opens calls

    def feed(self, text: str) -> tuple[str, Entries]:
        if self._holding is False:
            return text, []
        self._pieces.append(text)
        if self._holding is None:
            self._start += text if self._start else text.lstrip()
            start = self._start
            if not start or may_still_begin(start, self.openers):
                return "", []  # it may still open as calls: hold it until it shows
            self._holding = start.startswith(self.openers)
            text = "".join(self._pieces)  # all of the reply so far goes to the calls' reading
        if self._holding:
            return "", self.held.feed(text)
        released, self._pieces = "".join(self._pieces), []
        return released, []

    def finish(self) -> tuple[str, Entries]:
        text, self._pieces = "".join(self._pieces), []
        if not self._holding:
            return text, []
        called, entries = self.held.end(self.read(text.strip()))
        return ("", entries) if called else (text, [])


@dataclass(slots=True)
class MistralReader:
    """Streams text until `[TOOL_CALLS]` (a partial tag held back), then holds the rest of the
    reply, its calls streamed where `held` can, and reads it whole at the end."""

    held: HeldCalls
    _buffer: str = ""  # text that may begin the tag
    _calls: list[str] | None = None  # the reply after the tag, once it has come

    def feed(self, text: str) -> tuple[str, Entries]:
        if self._calls is not None:
            self._calls.append(text)
            return "", self.held.feed(text)
        content, found, rest = cut_at(self._buffer + text, TOOL_CALLS)
        if not found:
            self._buffer = rest
            return content, []
        self._buffer, self._calls = "", [rest]
        return content, self.held.feed(rest)

    def finish(self) -> tuple[str, Entries]:
        if self._calls is None:
            text, self._buffer = self._buffer, ""
            return text, []
        text, self._calls = "".join(self._calls), None
        called, entries = self.held.end(formats.mistral(text.strip()))
        return ("", entries) if called else (TOOL_CALLS + text, [])
