"""A thinking model's budget of reasoning tokens (vLLM's `thinking_token_budget`): once the
reply has spent that many tokens inside its thought, the tokens of the thought's closing tag
are forced, one a step, and the reply goes on to its answer.

The thought starts at the beginning of the output where the prompt opened it, else where the
output writes one of the opening tags; it ends early where the output writes the closing tag
itself. Tags are found in the text of the output's last tokens (`detokenizer.wrote`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.core.detokenizer import wrote


class ThoughtCounter:
    """Counts one sequence's reasoning tokens and says which token, if any, is forced next."""

    __slots__ = (
        "_decode",
        "_end",
        "_starts",
        "budget",
        "closing",
        "count",
        "done",
        "forcing",
        "inside",
    )

    def __init__(
        self,
        budget: int,
        starts: Sequence[str],
        end: str,
        closing: list[int],
        inside: bool,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.budget = budget
        self._starts = tuple(starts)
        self._end = end
        # The closing tag's token ids, forced in turn once the budget is spent.
        self.closing = closing
        self._decode = decode
        self.inside = inside
        self.count = 0
        self.done = False
        # How many of the closing tokens have been forced (None: not forcing).
        self.forcing: int | None = None
        self._spent()

    @property
    def forced_token(self) -> int | None:
        """The token the next step must sample, while the closing tag is being forced."""
        return None if self.forcing is None else self.closing[self.forcing]

    def append(self, output_token_ids: list[int]) -> None:
        """Follow the output's newest token."""
        if self.done:
            return
        if self.forcing is not None:
            self.forcing += 1
            if self.forcing == len(self.closing):
                self.forcing, self.done = None, True
            return
        if not self.inside:
            self.inside = wrote(self._starts, output_token_ids, self._decode)
            self._spent()
            return
        self.count += 1
        if wrote((self._end,), output_token_ids, self._decode):
            self.done = True  # the thought closed on its own
            return
        self._spent()

    def _spent(self) -> None:
        if self.inside and not self.done and self.count >= self.budget:
            self.forcing = 0 if self.closing else None
            self.done = not self.closing
