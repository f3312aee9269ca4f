"""Incremental, UTF-8 safe detokenization with stop strings.

Tokens are decoded in a short sliding window: the text of `tokens[prefix:read]` is compared with
that of `tokens[prefix:]`, and only the difference is emitted, never while it ends in the
replacement character (a multi-byte character still incomplete). Text that could be the start of
a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


Decode = Callable[[list[int], bool], str]


def plain_decode(tokenizer: Tokenizer) -> Decode:
    """`tokenizer.decode` as a function of (ids, skip_special_tokens); where that is the Rust
    backend's decode and nothing more (a Hugging Face fast tokenizer that neither overrides
    decoding nor cleans up spaces), the backend's own, about a third of the cost per call."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def _plain_backend(tokenizer: Any) -> Any | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    if kind.decode is not PreTrainedTokenizerBase.decode or \
            kind._decode is not TokenizersBackend._decode:
        return None
    return backend


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a character."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._decode_ids = plain_decode(tokenizer)
        self._skip_special = skip_special_tokens
        # A little prompt context makes the first output token decode with its leading space.
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        self._tokens: list[int] = list(context)
        self._prefix = 0
        self._read = len(context)

    def _decode(self, tokens: list[int]) -> str:
        return self._decode_ids(tokens, self._skip_special)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text that is now complete."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix:self._read])
        full_text = self._decode(self._tokens[self._prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Return whatever text is still held back, complete or not (the sequence ended)."""
        prefix_text = self._decode(self._tokens[self._prefix:self._read])
        full_text = self._decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        return full_text[len(prefix_text):]


def held_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class StopStringMatcher:
    """Accumulates output text, finds stop strings across token boundaries, and says what is
    safe to emit."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = stops
        self._include = include_stop
        self.text = ""
        self._emitted = 0

    def add(self, piece: str) -> tuple[str, str | None]:
        """Add decoded text; return (text safe to emit now, the stop string hit or None)."""
        self.text += piece
        hit = self._find_stop()
        if hit is not None:
            start, stop = hit
            self.text = self.text[: start + len(stop) if self._include else start]
            return self._emit(len(self.text)), stop
        return self._emit(len(self.text) - held_stop_prefix(self.text, self._stops)), None

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _find_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, self._emitted)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _emit(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
