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
not to; a reply cut short ends its last message where it stops.

(vLLM reads gpt-oss's replies this way under `--reasoning-parser openai_gptoss` and
`--tool-call-parser openai`.)
"""

from __future__ import annotations

import re
from typing import Any

from server.tools import tool_call

MESSAGE, CHANNEL, START = "<|message|>", "<|channel|>", "<|start|>"
# What ends a message's body: the end of a turn, a call, the end of the reply.
ENDS = ("<|end|>", "<|call|>", "<|return|>")
# Where a structured output begins: the answer's body.
FINAL = f"{CHANNEL}final{MESSAGE}"
PARSER = "openai"
REASONING_PARSER = "openai_gptoss"
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")

Delta = tuple[str, str, list[dict[str, Any]]]


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes Harmony's messages (gpt-oss's does)."""
    template = chat_template or ""
    return CHANNEL in template and MESSAGE in template


def split_harmony(text: str) -> Delta:
    """The reasoning, the content and the calls of a whole reply."""
    reader = HarmonyReader()
    reasoning, content, calls = reader.feed(text)
    more, rest, last = reader.finish()
    return reasoning + more, content + rest, calls + last


class HarmonyReader:
    """Splits a Harmony reply arriving in pieces cut anywhere into reasoning, content and
    calls."""

    __slots__ = ("_body", "_buffer", "_channel", "_header", "_recipient", "reasoned")

    def __init__(self) -> None:
        self._buffer = ""
        # In a header (until `<|message|>`) or in a body.
        self._header = True
        self._channel = "final"
        self._recipient: str | None = None
        # A call's arguments, gathered until its message ends.
        self._body = ""
        self.reasoned = False

    def feed(self, text: str) -> Delta:
        """Reasoning, content and whole calls that can be shown now."""
        self._buffer += text
        reasoning, content, calls = "", "", []
        while self._header is False or self._read_header():
            end, marker = _first_end(self._buffer)
            shown = end if end >= 0 else len(self._buffer) - _held(self._buffer)
            more, rest = self._emit(self._buffer[:shown])
            reasoning, content = reasoning + more, content + rest
            if end < 0:
                self._buffer = self._buffer[shown:]
                break
            calls += self._end_message()
            self._buffer = self._buffer[end + len(marker) :]
        return reasoning, content, calls

    def finish(self) -> Delta:
        """What is left at the end of the reply: a message cut short ends there."""
        rest, self._buffer = self._buffer, ""
        if self._header:
            plain = rest.strip() and not rest.lstrip().startswith("<|")
            return "", rest if plain else "", []
        reasoning, content = self._emit(rest)
        return reasoning, content, self._end_message()

    def _read_header(self) -> bool:
        """Read a whole header, if it has arrived; False while it has not. A reply that opens
        with text and no header is all answer."""
        at = self._buffer.find(MESSAGE)
        if at < 0:
            opening = self._buffer.lstrip()
            if opening and not "<|".startswith(opening[:2]):  # text, not a marker
                self._header, self._channel, self._recipient = False, "final", None
                return True
            return False
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE) :]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._recipient = recipient.group(1) if recipient else None
        self._header = False
        return True

    def _emit(self, text: str) -> tuple[str, str]:
        """A body's text as reasoning or content (a call's arguments are kept until it ends)."""
        if not text:
            return "", ""
        if self._recipient is not None:
            self._body += text
            return "", ""
        if self._channel == "analysis":
            self.reasoned = True
            return text, ""
        return "", text

    def _end_message(self) -> list[dict[str, Any]]:
        """Close the message: a call's whole arguments make a call."""
        calls = []
        if self._recipient is not None:
            calls.append(tool_call(self._recipient, self._body.strip()))
        self._header, self._recipient, self._body = True, None, ""
        return calls


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
