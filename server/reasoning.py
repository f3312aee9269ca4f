"""Reasoning read out of a thinking model's reply (`--reasoning-parser`): the text between a
start tag and an end tag is the reasoning, what follows is the answer.

The tags are the parser's (`ThoughtTags`): `<think>` and `</think>` (`deepseek_r1`, `qwen3`),
`[THINK]` and `[/THINK]` (`mistral`: Magistral's special tokens, which the reply's text then
keeps), or Granite 3.2's phrases, `Here is my thought process:` and `Here is my response:`
(`granite`, with `Here's` too). A reply is in its reasoning from its first token where the
prompt's generation part ends with a start tag (DeepSeek-R1's and the Qwen3 thinking models'
templates open it there), or where the reply itself opens with one (Qwen3 with thinking on).
Otherwise, for one (Qwen3 with `enable_thinking: false` closes the thought in the prompt) the
whole reply is the answer. A reply cut short before the end tag is all reasoning. The streaming
reader holds back text that may be the start of a tag until it is known not to be.

(vLLM's parsers of the same names read these replies the same way.)
"""

from __future__ import annotations

from dataclasses import dataclass

from server.call_stream import partial_tag


@dataclass(frozen=True, slots=True)
class ThoughtTags:
    """What opens a reply's reasoning and what closes it (any of each); `special`: the tags
    are special tokens, which the reply's text must keep to be read."""

    starts: tuple[str, ...]
    ends: tuple[str, ...]
    special: bool = False


THINK = ThoughtTags(("<think>",), ("</think>",))
MISTRAL = ThoughtTags(("[THINK]",), ("[/THINK]",), special=True)
GRANITE = ThoughtTags(
    ("Here is my thought process:", "Here's my thought process:"),
    ("Here is my response:", "Here's my response:"),
)
SEED = ThoughtTags(("<seed:think>",), ("</seed:think>",))
# `openai_gptoss` reads gpt-oss's Harmony channels instead (`server/harmony.py`). The names are
# vLLM's; theirs for GLM-4.5, Kimi K2, OLMo 3, DeepSeek-V3.1, MiniMax-M2 and ERNIE 4.5 read
# `<think>` as `qwen3` does.
TAGS = {
    "deepseek_r1": THINK,
    "qwen3": THINK,
    "deepseek_v3": THINK,
    "glm45": THINK,
    "kimi_k2": THINK,
    "olmo3": THINK,
    "minimax_m2": THINK,
    "ernie45": THINK,
    "mistral": MISTRAL,
    "granite": GRANITE,
    "seed_oss": SEED,
}
PARSERS = (*TAGS, "openai_gptoss")


def tags_for(parser: str | None) -> ThoughtTags:
    """The tags `--reasoning-parser` reads (`<think>`'s where it names none of its own)."""
    return TAGS.get(parser or "", THINK)


def opens_in_reasoning(prompt_text: str, tags: ThoughtTags = THINK) -> bool:
    """Whether a reply to this rendered prompt starts inside its reasoning."""
    return prompt_text.rstrip().endswith(tags.starts)


def split_reasoning(
    text: str, open_at_start: bool, tags: ThoughtTags = THINK
) -> tuple[str | None, str]:
    """The reasoning (None where the reply has none) and the answer of a whole reply."""
    reader = ThinkReader(open_at_start, tags)
    reasoning, answer = reader.feed(text)
    more, rest = reader.finish()
    reasoning += more
    return (reasoning if reader.reasoned else None), answer + rest


def _find(text: str, tags: tuple[str, ...]) -> tuple[int, int]:
    """Where the first of `tags` in `text` starts, and its length; (-1, 0) if none is."""
    found = [(at, len(tag)) for tag in tags if (at := text.find(tag)) >= 0]
    return min(found) if found else (-1, 0)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many of `text`'s last characters may begin one of `tags`."""
    return max(partial_tag(text, tag) for tag in tags)


class ThinkReader:
    """Splits a reply arriving in pieces cut anywhere into reasoning and answer."""

    __slots__ = ("_after_end", "_buffer", "_state", "reasoned", "tags")

    def __init__(self, open_at_start: bool, tags: ThoughtTags = THINK) -> None:
        self.tags = tags
        # "start": not yet known whether the reply opens with a start tag; "thinking"; "answer".
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
            if any(start.startswith(opening) for start in self.tags.starts):
                return "", ""  # blanks, or part of a start tag: not known yet
            started = [start for start in self.tags.starts if opening.startswith(start)]
            if started:
                self._state, self.reasoned = "thinking", True
                self._buffer = opening[len(started[0]) :]
            else:
                self._state = "answer"
        if self._state == "thinking":
            end, size = _find(self._buffer, self.tags.ends)
            if end < 0:
                cut = len(self._buffer) - _held(self._buffer, self.tags.ends)
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + size :]
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
