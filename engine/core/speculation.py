"""N-gram speculation (vLLM's `ngram` method, "prompt lookup"): draft the next tokens of a
sequence from what followed the latest earlier match of its last few tokens, in its prompt or
its output so far. A step then runs each draft as one more decode row of the sequence and keeps
the drafts its model agrees with, plus the token of the first row that disagreed (or of the last
row): several tokens for the price of a slightly wider decode step.

Only requests whose next token depends on nothing but the logits of its row and the tokens
before it (penalties, bad words, `min_tokens` and an output format read those, drafts
included) draft: a format that has not started yet, a thought budget still counting or images
make a request decode one token a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.draft_gate import DraftGate
from engine.core.request import Request

# vLLM's default n-gram lengths where the config names neither.
DEFAULT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for the `ngram` method: draft up to
    `num_speculative_tokens` tokens from the longest match of the sequence's last
    `prompt_lookup_max` .. `prompt_lookup_min` tokens; none while more than
    `disable_by_batch_size` requests run (where a step's rows already keep the device busy,
    more rows cost more than the tokens they keep). Without it, drafts are made where steps
    of the same size have been faster with them (`draft_gate.py`)."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    method: str = "ngram"
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(
                f"speculative method {self.method!r} is not served: only 'ngram' (drafts "
                "from the sequence itself) is; draft models, EAGLE and MTP are not"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must be 1 <= min <= max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")

    @classmethod
    def of(cls, fields: dict[str, Any]) -> SpeculativeConfig:
        """The config a `--speculative-config` JSON object gives: only the fields n-gram
        speculation reads; either lookup length alone sets both, as in vLLM."""
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "disable_by_batch_size",
        }
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown speculative config fields: {', '.join(unknown)}")
        if "num_speculative_tokens" not in fields:
            raise ValueError("the speculative config needs num_speculative_tokens")
        for name, value in fields.items():
            if name == "method" or (name == "disable_by_batch_size" and value is None):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative config field {name} must be an integer")
        lower = fields.get("prompt_lookup_min")
        upper = fields.get("prompt_lookup_max")
        lower = lower if lower is not None else upper if upper is not None else DEFAULT_LOOKUP
        upper = upper if upper is not None else lower
        return cls(
            num_speculative_tokens=fields["num_speculative_tokens"],
            prompt_lookup_min=lower,
            prompt_lookup_max=upper,
            method=str(fields.get("method", "ngram")),
            disable_by_batch_size=fields.get("disable_by_batch_size"),
        )


class NgramIndex:
    """Where each n-gram of a sequence (for n in [shortest, longest]) last ended, kept up to
    date as the sequence grows: a lookup costs `longest - shortest + 1` dictionary reads."""

    def __init__(self, shortest: int, longest: int) -> None:
        self.shortest = shortest
        self.longest = longest
        # n -> n-gram -> the position just past its latest occurrence.
        self._ends: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(shortest, longest + 1)
        }
        self._indexed = 0  # n-grams ending at or before this position are in `_ends`

    def draft(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest of
        `tokens`' suffixes that occurred before ([] where none did)."""
        self._catch_up(tokens)
        length = len(tokens)
        for n in range(min(self.longest, length - 1), self.shortest - 1, -1):
            end = self._ends[n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + count]
        return []

    def _catch_up(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the sequence's last position (the suffix being
        looked up must find an earlier occurrence, not itself)."""
        last = len(tokens) - 1
        for end in range(self._indexed + 1, last + 1):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, last)


class Drafter:
    """Drafts each running request's next tokens before a step is scheduled."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}
        # The most tokens each request drafts next (`kept`); absent: num_speculative_tokens.
        self._lengths: dict[str, int] = {}
        # Without `disable_by_batch_size`, whether drafts pay is measured (`draft_gate.py`).
        self.gate = DraftGate()

    def draft_step(self, requests: list[Request], running: int) -> None:
        """Draft for the requests a step just advanced, `running` requests in all: none while
        more run than `disable_by_batch_size`, or, without it, where the gate finds that steps
        of this size gain nothing by drafts."""
        limit = self.config.disable_by_batch_size
        wanted = running <= limit if limit is not None else self.gate.drafts(running)
        for request in requests:
            if wanted:
                self.draft(request)
            else:
                request.draft_token_ids = []

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step of `rows` requests, with drafts or without, gave `tokens` output
        tokens in `seconds` (its drafting included)."""
        self.gate.observe(rows, drafted, tokens, seconds)

    def draft(self, request: Request) -> None:
        """Set `request.draft_token_ids` for its next step: none where it cannot speculate
        or may write at most one more token."""
        request.draft_token_ids = []
        room = request.max_output_tokens - request.num_output_tokens - 1
        if room <= 0 or request.is_finished or not speculates(request):
            return
        index = self._indexes.get(request.request_id)
        if index is None:
            config = self.config
            index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            self._indexes[request.request_id] = index
        most = self._lengths.get(request.request_id, self.config.num_speculative_tokens)
        drafts = index.draft(request.all_token_ids, min(most, room))
        if drafts and request.grammar is not None:  # the drafts its format allows
            drafts = drafts[: request.grammar.validate_tokens(drafts)]
        request.draft_token_ids = drafts

    def kept(self, request_id: str, kept: int) -> None:
        """A step kept `kept` of the request's drafts: it drafts one more than that next time
        (so a request whose text stops repeating spends one row a step on drafts, and one that
        repeats grows back)."""
        most = self.config.num_speculative_tokens
        self._lengths[request_id] = min(kept + 1, most)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)
            self._lengths.pop(request_id, None)


def speculates(request: Request) -> bool:
    """Whether the request's next tokens may be drafted: each depends only on its row's logits
    and the tokens before it (as `Sampler` processes them; its logprobs are its row's too), and
    its tokens are all on the host."""
    return (
        request.num_pending_tokens == 0
        and request.deferred_grammar is None
        and (request.thought is None or request.thought.done)
        and request.forced_token is None
        and request.images is None
    )
