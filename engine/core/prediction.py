"""OpenAI's Predicted Outputs: a request that knows most of its reply in advance (a file to
edit, a document to revise) gives it as `prediction`, and its steps draft from it.

`Prediction` follows the reply through the predicted tokens: while the reply's new tokens are
the next predicted ones, it drafts the tokens after them; where the reply departs from it (an
edit), it finds the reply's last few tokens in the prediction again, the first place at or
after where it was (else the last before), and drafts from there; where they occur nowhere,
it drafts nothing until they do. The drafts are verified as any (`core/speculation.py`), so
the reply is what it would be without a prediction, only written in fewer steps where it
agrees.
"""

from __future__ import annotations

import bisect

# The longest and shortest runs of the reply's last tokens looked for to find its place again,
# and how many places of its last two tokens are tried on each side of where it was.
LONGEST_RUN = 8
SHORTEST_RUN = 2
NEAREST = 64


class Prediction:
    """Where a reply stands in its predicted tokens, kept up to date as the reply grows."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        # Where the reply's next token is expected in `tokens`; None: lost.
        self.cursor: int | None = None
        self._followed = 0  # reply tokens read so far
        self._last = 0  # the cursor before the reply last departed
        # Each pair of predicted tokens -> the positions just past it, ascending; built the
        # first time the reply departs.
        self._ends: dict[tuple[int, int], list[int]] | None = None

    def draft(self, reply: list[int], count: int) -> list[int]:
        """Up to `count` predicted tokens to follow `reply` ([] where it is lost or at the
        prediction's end)."""
        self._follow(reply)
        if self.cursor is None:
            return []
        return list(self.tokens[self.cursor : self.cursor + count])

    def _follow(self, reply: list[int]) -> None:
        new = reply[self._followed :]
        if not new:
            return
        self._followed = len(reply)
        expected = self.cursor if self.cursor is not None else 0 if len(new) == len(reply) else None
        if expected is not None and tuple(new) == self.tokens[expected : expected + len(new)]:
            self.cursor = expected + len(new)
            return
        if self.cursor is not None:
            self._last = self.cursor
        self.cursor = self._found(reply, self._last)

    def _found(self, reply: list[int], since: int) -> int | None:
        """Just past the longest run (2 to 8 tokens) of the reply's last tokens that the
        prediction holds, among the places of its last two nearest to `since`: of equal runs,
        the first at or after `since`, else the last before."""
        if len(reply) < SHORTEST_RUN:
            return None
        ends = self._index().get((reply[-2], reply[-1]))
        if not ends:
            return None
        at = bisect.bisect_left(ends, since)
        nearest = ends[at : at + NEAREST] + ends[max(0, at - NEAREST) : at][::-1]
        best, longest = None, 0
        for end in nearest:
            length = self._run(reply, end)
            if length > longest:
                best, longest = end, length
        return best

    def _run(self, reply: list[int], end: int) -> int:
        """How many of the reply's last tokens (up to LONGEST_RUN) the prediction holds just
        before `end`."""
        tokens, length = self.tokens, 0
        limit = min(LONGEST_RUN, len(reply), end)
        while length < limit and reply[-1 - length] == tokens[end - 1 - length]:
            length += 1
        return length

    def _index(self) -> dict[tuple[int, int], list[int]]:
        """Each pair of consecutive predicted tokens -> the positions just past it,
        ascending (one entry per token: a long prediction costs little)."""
        if self._ends is None:
            tokens = self.tokens
            ends: dict[tuple[int, int], list[int]] = {}
            for end in range(SHORTEST_RUN, len(tokens) + 1):
                ends.setdefault((tokens[end - 2], tokens[end - 1]), []).append(end)
            self._ends = ends
        return self._ends
