"""vLLM's `bad_words`: words a reply may not write.

Each word is tokenized as it stands and with one leading space (a word mid-sentence is usually
its space-prefixed tokens). A sequence's last token is ruled out at a step where the output so
far ends with the rest of it, so a one-token word is never written and a longer one cannot be
completed; as in vLLM, only the output counts, not the prompt, and the same text written in
other tokens is not caught.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences, without repeats."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        for prefix in ("", " "):
            ids = tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)


def banned_tokens(sequences: Sequence[tuple[int, ...]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a sequence after `output`."""
    banned = []
    for sequence in sequences:
        before = len(sequence) - 1
        if before == 0 or (
            len(output) >= before and tuple(output[len(output) - before :]) == sequence[:-1]
        ):
            banned.append(sequence[-1])
    return banned


def needs_history(sequences: Sequence[tuple[int, ...]]) -> bool:
    """Whether the ban depends on the tokens written so far (some word spans tokens)."""
    return any(len(sequence) > 1 for sequence in sequences)
