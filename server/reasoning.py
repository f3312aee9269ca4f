"""Reasoning read out of a thinking model's reply (`--reasoning-parser`): the text between
`<think>` and `</think>` is the reasoning, what follows is the answer.

A reply is in its reasoning from its first token where the prompt's generation part ends with
`<think>` (DeepSeek-R1's and the Qwen3 thinking models' templates open it there), or where the
reply itself opens with `<think>` (Qwen3 with thinking on). Otherwise, for one (Qwen3 with
`enable_thinking: false` closes the thought in the prompt) the whole reply is the answer. A
reply cut short before `</think>` is all reasoning. The streaming reader holds back text that may
be the start of a tag until it is known not to be.

(vLLM's `deepseek_r1` and `qwen3` parsers read these replies the same way; both names select
this reader.)
"""

from __future__ import annotations

from server.tool_parsers import partial_tag

START, END = "<think>", "</think>"
# `openai_gptoss` reads gpt-oss's Harmony channels instead (`server/harmony.py`).
PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")


def opens_in_reasoning(prompt_text: str) -> bool:
    """Whether a reply to this rendered prompt starts inside its reasoning."""
    return prompt_text.rstrip().endswith(START)


def split_reasoning(text: str, open_at_start: bool) -> tuple[str | None, str]:
    """The reasoning (None where the reply has none) and the answer of a whole reply."""
    reader = ThinkReader(open_at_start)
    reasoning, answer = reader.feed(text)
    more, rest = reader.finish()
    reasoning += more
    return (reasoning if reader.reasoned else None), answer + rest


class ThinkReader:
    """Splits a reply arriving in pieces cut anywhere into reasoning and answer."""

    __slots__ = ("_after_end", "_buffer", "_state", "reasoned")

    def __init__(self, open_at_start: bool) -> None:
        # "start": not yet known whether the reply opens with <think>; "thinking"; "answer".
        self._state = "thinking" if open_at_start else "start"
        self._buffer = ""
        # The answer's first characters after </think> are blanks still being dropped.
        self._after_end = False
        self.reasoned = open_at_start

    def feed(self, text: str) -> tuple[str, str]:
        """Reasoning and answer text that can be shown now."""
        self._buffer += text
        reasoning = answer = ""
        if self._state == "start":
            opening = self._buffer.lstrip()
            if START.startswith(opening):
                return "", ""  # blanks, or part of <think>: not known yet
            if opening.startswith(START):
                self._state, self.reasoned = "thinking", True
                self._buffer = opening[len(START) :]
            else:
                self._state = "answer"
        if self._state == "thinking":
            end = self._buffer.find(END)
            if end < 0:
                cut = len(self._buffer) - partial_tag(self._buffer, END)
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + len(END) :]
            self._state, self._after_end = "answer", True
        if self._after_end:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return reasoning, ""
            self._after_end = False
        answer, self._buffer = self._buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        rest, self._buffer = self._buffer, ""
        if self._state == "thinking":
            return rest, ""
        return "", rest.lstrip() if self._after_end else rest
