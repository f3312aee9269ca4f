"""A format that holds only from a point in the output on: a thinking model's answer, after
its reasoning has closed with `</think>`, while the reasoning itself runs free."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.core.detokenizer import wrote


class DeferredGrammar:
    """A matcher at its start, waiting for `marker` to appear in the output's text."""

    __slots__ = ("_decode", "marker", "matcher")

    def __init__(self, matcher: Any, marker: str, decode: Callable[[list[int]], str]) -> None:
        self.matcher = matcher
        self.marker = marker
        self._decode = decode

    def opens(self, output_token_ids: list[int]) -> bool:
        """Whether the newest token completed the marker."""
        return wrote((self.marker,), output_token_ids, self._decode)
