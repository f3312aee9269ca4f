"""vLLM's `draft_model` speculation: a smaller model of the same tokenizer writes each
request's next tokens, greedily, one after another, and the served model verifies them in
one step as it verifies n-gram drafts (`core/speculation.py`, `worker/verify.py`).

The draft model runs on its own `ModelRunner`, over its own paged KV cache with its own block
manager (with the server's prefix caching, its own prefix cache: a shared system prompt is
computed once by the draft model too). Each drafting request has a shadow there: a greedy
`Request` over the same tokens, whose computed tokens are those the draft's cache holds.
Before a step is scheduled, the shadows first catch up with the tokens their requests took
since (the bonus token and the kept drafts; a new request's whole prompt, in chunks of the step
budget) and sample the first draft, then run one row each for every further draft. After
verification, the draft's cache keeps the drafts the served model kept: only the tokens past
them are computed again.

Drafts are what the draft model would write at temperature 0, whatever the request's own
sampling: a draft is a point mass, kept where the served model draws it (`worker/verify.py`),
so sampled replies follow the served model's distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import Drafter, SpeculativeConfig
from engine.kv.block_manager import BlockManager
from engine.scheduling.scheduler import ScheduledRequest, SchedulerOutput
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0)


@dataclass(slots=True)
class DraftLimits:
    """How far the draft model goes: sequences up to `max_len` tokens (its context, or the
    config's `max_model_len`), tokens below `vocab_size` (the served model's vocabulary), and
    at most `round_tokens` tokens in the round that catches the shadows up (the step budget)."""

    max_len: int
    vocab_size: int
    round_tokens: int


@dataclass(slots=True)
class Shadow:
    """A request's copy in the draft model: `request` holds the tokens, the draft cache's
    blocks and how many of them it has computed; `synced` is how many of the real request's
    tokens it had taken when it last drafted (the drafts follow them)."""

    request: Request
    synced: int


class ModelDrafter(Drafter):
    """Drafts for a step's requests in rounds of the draft model (see the module's words)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        blocks: BlockManager,
        limits: DraftLimits,
    ) -> None:
        super().__init__(config)
        self.runner = runner
        self.blocks = blocks
        self.limits = limits
        self._shadows: dict[str, Shadow] = {}
        self._failures = 0

    def draft_all(self, requests: list[Request]) -> None:
        wanted = {r.request_id: count for r in requests if (count := self.wanted(r, self.most(r)))}
        if not wanted:
            return
        chosen = [r for r in requests if r.request_id in wanted]
        try:
            drafts = self._rounds([self._synced(r) for r in chosen], wanted)
        except Exception:  # a failing draft model costs the drafts, never the requests
            self._failures += 1
            if self._failures == 1:
                logger.exception("the draft model failed; its requests decode without drafts")
            self._forget(list(self._shadows))
            return
        for request in chosen:
            request.draft_token_ids = self.allowed(request, drafts.get(request.request_id, []))

    def release(self, request_ids: list[str]) -> None:
        super().release(request_ids)
        self._forget(request_ids)

    @property
    def num_shadows(self) -> int:
        return len(self._shadows)

    # ---- shadows ---------------------------------------------------------------------------

    def _synced(self, request: Request) -> Request:
        """The request's shadow, holding its tokens: what the draft's cache computed stays
        where the tokens are those it drafted (the kept drafts), the rest is run again."""
        tokens = request.all_token_ids
        shadow = self._shadows.get(request.request_id)
        if shadow is None or shadow.synced > len(tokens):
            self._forget([request.request_id])
            copy = Request(request.request_id, list(tokens), GREEDY, 0.0, self.limits.max_len)
            copy.cache_salt = request.cache_salt  # a tenant's prefixes stay its own here too
            self.blocks.claim_cached_prefix(copy)
            self._shadows[request.request_id] = Shadow(copy, len(tokens))
            return copy
        copy, synced = shadow.request, shadow.synced
        kept = _common_length(copy.all_token_ids[synced:], tokens[synced:])
        _cut(copy, synced + kept)
        _grow(copy, tokens[synced + kept :])
        shadow.synced = len(tokens)
        return copy

    def _forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            shadow = self._shadows.pop(request_id, None)
            if shadow is not None:
                self.blocks.free(shadow.request)

    def _room(self, shadow: Request, tokens: int, keep: set[str]) -> bool:
        """Blocks for the shadow to hold `tokens` tokens; where the draft's cache is short,
        the shadows of requests not drafting now (preempted, waiting) give theirs back."""
        if self.blocks.allocate(shadow, tokens):
            return True
        self._forget([i for i in self._shadows if i not in keep])
        return self.blocks.allocate(shadow, tokens)

    # ---- rounds ----------------------------------------------------------------------------

    def _rounds(self, shadows: list[Request], wanted: dict[str, int]) -> dict[str, list[int]]:
        """Run the draft model over the shadows: the first round catches each up and samples
        its first draft, each further round feeds the last draft and samples the next."""
        items, counts = self._first_round(shadows, wanted)
        drafts: dict[str, list[int]] = {shadow.request_id: [] for shadow in shadows}
        while items:
            copies = self.blocks.take_copies()
            output = self.runner.execute(SchedulerOutput(items, block_copies=copies))
            following = []
            for item in items:
                shadow = item.request
                shadow.num_computed_tokens += item.num_tokens
                token = output.sampled_token_ids.get(shadow.request_id)
                if token is None:  # a chunk of a long catch-up: no draft this step
                    continue
                written = drafts[shadow.request_id]
                if token >= self.limits.vocab_size:  # no token of the served model
                    continue
                written.append(token)
                _grow(shadow, [token])
                if len(written) < counts[shadow.request_id]:
                    following.append(ScheduledRequest(shadow, 1))
            items = following
        self._publish(shadows)
        return drafts

    def _publish(self, shadows: list[Request]) -> None:
        """Offer the shadows' full blocks of their requests' own tokens to the draft's prefix
        cache (never blocks of drafts, which may yet be cut and written again)."""
        for shadow in shadows:
            synced = self._shadows[shadow.request_id].synced
            self.blocks.cache_full_blocks(shadow, min(shadow.num_computed_tokens, synced))

    def _first_round(
        self, shadows: list[Request], wanted: dict[str, int]
    ) -> tuple[list[ScheduledRequest], dict[str, int]]:
        """Each shadow's catch-up (within the round's budget) and how many tokens it drafts
        (fewer where the draft's context ends sooner); blocks for the drafts it feeds back."""
        budget = self.limits.round_tokens
        keep = {shadow.request_id for shadow in shadows}
        items: list[ScheduledRequest] = []
        counts: dict[str, int] = {}
        for shadow in shadows:
            behind = shadow.num_tokens - shadow.num_computed_tokens
            run = min(behind, budget)
            count = min(wanted[shadow.request_id], self.limits.max_len - shadow.num_tokens + 1)
            if run < 1 or count < 1:
                continue
            # The drafts but the last are fed back: their K/V need slots too.
            end = (
                shadow.num_tokens + count - 1 if run == behind else shadow.num_computed_tokens + run
            )
            if not self._room(shadow, end, keep):
                continue
            budget -= run
            items.append(ScheduledRequest(shadow, run))
            counts[shadow.request_id] = count
        return items, counts


def _common_length(first: list[int], second: list[int]) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        length += 1
    return length


def _cut(shadow: Request, length: int) -> None:
    """Keep the shadow's first `length` tokens (its cache keeps at most those)."""
    del shadow.all_token_ids[length:]
    del shadow.output_token_ids[max(0, length - shadow.num_prompt_tokens) :]
    shadow.num_computed_tokens = min(shadow.num_computed_tokens, length)


def _grow(shadow: Request, tokens: list[int]) -> None:
    shadow.all_token_ids.extend(tokens)
    shadow.output_token_ids.extend(tokens)
