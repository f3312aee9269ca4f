"""Replies in OpenAI's Harmony format (gpt-oss): a reply is a run of messages, each a header and a
body between special tokens,

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>

and a tool call is a message to a function, its body the call's JSON arguments:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(the recipient may also stand before the channel). The `analysis` channel is the model's
reasoning, `final` its answer, `commentary` to a function a call, and `commentary` to no one a
preamble shown as content. The markers are special tokens, so such replies keep special tokens
in their text. The streaming reader holds back text that may begin a marker until it is known
not to; a reply cut short ends its last message where it stops. A call streams as OpenAI's
`delta.tool_calls` entries: its name once its header is read, then its body (blanks around it
left out) as it arrives.

(vLLM reads gpt-oss's replies this way under `--reasoning-parser openai_gptoss` and
`--tool-call-parser openai`.)
"""

from __future__ import annotations

import re
from typing import Any

from server.call_array import assemble
from server.call_stream import CallNumbers, PartialCall

MESSAGE, CHANNEL, START = "<|message|>", "<|channel|>", "<|start|>"
CALL, CONSTRAIN = "<|call|>", "<|constrain|>"
# What ends a message's body: the end of a turn, a call, the end of the reply.
ENDS = ("<|end|>", CALL, "<|return|>")
# Where a structured output begins: the answer's body.
FINAL = f"{CHANNEL}final{MESSAGE}"
PARSER = "openai"
REASONING_PARSER = "openai_gptoss"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")

# The reasoning, the content and the `delta.tool_calls` entries a piece of a reply gives.
Delta = tuple[str, str, list[dict[str, Any]]]


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes Harmony's messages (gpt-oss's does)."""
    template = chat_template or ""
    return CHANNEL in template and MESSAGE in template


def split_harmony(text: str) -> Delta:
    """The reasoning, the content and the calls of a whole reply."""
    reader = HarmonyReader()
    reasoning, content, entries = reader.feed(text)
    more, rest, last = reader.finish()
    return reasoning + more, content + rest, assemble(entries + last)


class HarmonyReader:
    """Splits a Harmony reply arriving in pieces cut anywhere into reasoning, content and
    calls."""

    __slots__ = ("_blanks", "_buffer", "_call", "_channel", "_header", "_numbers", "reasoned")

    def __init__(self) -> None:
        self._buffer = ""
        # In a header (until `<|message|>`) or in a body.
        self._header = True
        self._channel = "final"
        # The call a message to a function makes, its arguments as far as they are known.
        self._call: PartialCall | None = None
        self._blanks = ""  # blanks at the end of its body so far, which may end it
        self._numbers = CallNumbers()
        self.reasoned = False

    def feed(self, text: str) -> Delta:
        """Reasoning, content and call entries that can be shown now."""
        self._buffer += text
        reasoning, content, entries = "", "", []
        while self._header is False or self._read_header():
            end, marker = _first_end(self._buffer)
            shown = end if end >= 0 else len(self._buffer) - _held(self._buffer)
            more, rest = self._emit(self._buffer[:shown])
            reasoning, content = reasoning + more, content + rest
            entries += self._call_entries()
            if end < 0:
                self._buffer = self._buffer[shown:]
                break
            self._end_message()
            self._buffer = self._buffer[end + len(marker) :]
        return reasoning, content, entries

    def finish(self) -> Delta:
        """What is left at the end of the reply: a message cut short ends there."""
        rest, self._buffer = self._buffer, ""
        if self._header:
            plain = rest.strip() and not rest.lstrip().startswith("<|")
            return "", rest if plain else "", []
        reasoning, content = self._emit(rest)
        entries = self._call_entries()
        self._end_message()
        return reasoning, content, entries

    def _read_header(self) -> bool:
        """Read a whole header, if it has arrived; False while it has not. A reply that opens
        with text and no header is all answer."""
        at = self._buffer.find(MESSAGE)
        if at < 0:
            opening = self._buffer.lstrip()
            if opening and not "<|".startswith(opening[:2]):  # text, not a marker
                self._header, self._channel, self._call = False, "final", None
                return True
            return False
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE) :]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._call = PartialCall(recipient.group(1)) if recipient else None
        self._header = False
        return True

    def _emit(self, text: str) -> tuple[str, str]:
        """A body's text as reasoning, content or a call's arguments."""
        if not text:
            return "", ""
        if self._call is not None:
            self._arguments(text)
            return "", ""
        if self._channel == "analysis":
            self.reasoned = True
            return text, ""
        return "", text

    def _arguments(self, text: str) -> None:
        """More of a call's body: blanks before it are not its, blanks after held until more
        follows them."""
        assert self._call is not None
        if self._call.size == 0:
            text = text.lstrip()
        text = self._blanks + text
        body = text.rstrip()
        self._call.write(body)
        self._blanks = text[len(body) :] if self._call.size else ""

    def _call_entries(self) -> list[dict[str, Any]]:
        return [] if self._call is None else self._numbers.entries([self._call])

    def _end_message(self) -> None:
        if self._call is not None:
            self._numbers.next_block()
        self._header, self._call, self._blanks = True, None, ""


def _first_end(text: str) -> tuple[int, str]:
    """Where the first marker that ends a body (or starts another message) stands, and it."""
    found = [(text.find(marker), marker) for marker in (*ENDS, START)]
    return min(((at, m) for at, m in found if at >= 0), default=(-1, ""))


def _held(text: str) -> int:
    """How many of `text`'s last characters may begin a marker."""
    at = text.rfind("<")
    if at < 0 or ">" in text[at:]:
        return 0
    return len(text) - at if "<|".startswith(text[at : at + 2]) else 0
