"""Verifying drafted tokens (`core/speculation.py`): which drafts a sequence keeps, and the token
that follows them.

A request with drafts d1..dk runs k + 1 rows; row i's distribution is the model's next token after
d1..di. Draft d(i+1) is kept with probability p_i(d(i+1)) (always where it is row i's argmax,
never elsewhere, for a greedy request); the first refused draft is replaced by a draw from row i's
distribution without it, and when every draft is kept row k gives one more token. An n-gram draft
is certain (its proposal puts all its mass on one token), so this is speculative sampling's rule,
and each token follows the model's distribution exactly as decoding one at a time would.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from engine.core.outputs import TokenLogprob
from engine.core.request import Request
from engine.worker.sampler import Sampler, raw_scores, token_logprobs


@dataclass(frozen=True, slots=True)
class VerifyGroup:
    """A request's rows among the step's sampled rows: `first` and the `drafts` after it."""

    request: Request
    first: int
    drafts: list[int]

    @property
    def rows(self) -> range:
        return range(self.first, self.first + len(self.drafts) + 1)


@dataclass(frozen=True, slots=True)
class Verified:
    """The drafts kept, and the token after them."""

    accepted: list[int]
    token: int


def groups_of(requests: list[Request], drafts: dict[str, list[int]]) -> list[VerifyGroup]:
    """The verifying requests' groups among the step's sampled rows (`requests`, one entry a
    row: a verifying request's k + 1 rows are consecutive)."""
    groups: list[VerifyGroup] = []
    row = 0
    while row < len(requests):
        request = requests[row]
        found = drafts.get(request.request_id)
        if found is None:
            row += 1
            continue
        groups.append(VerifyGroup(request, row, found))
        row += len(found) + 1
    return groups


def verify_chosen(tokens: list[int], group: VerifyGroup) -> Verified:
    """A greedy group whose rows' argmax tokens are `tokens` (all sampled rows): the drafts
    equal to the model's choice before them, then its choice after the last one kept."""
    chosen = tokens[group.first : group.first + len(group.drafts) + 1]
    kept = 0
    while kept < len(group.drafts) and group.drafts[kept] == chosen[kept]:
        kept += 1
    return Verified(group.drafts[:kept], chosen[kept])


def verify_sampled(
    sampler: Sampler, logits: torch.Tensor, groups: list[VerifyGroup]
) -> list[Verified]:
    """Each group verified against its rows' distributions (`logits` holds the rows of the
    step's sampled rows, indexed as the groups say): groups without a format all at once,
    constrained ones row by row (`_verify_constrained`)."""
    free = iter(_verify_free(sampler, logits, [g for g in groups if g.request.grammar is None]))
    return [
        next(free) if group.request.grammar is None else _verify_constrained(sampler, logits, group)
        for group in groups
    ]


def _verify_free(
    sampler: Sampler, logits: torch.Tensor, groups: list[VerifyGroup]
) -> list[Verified]:
    """Groups without a format: every row's distribution at once, then each group's drafts
    kept by its draws."""
    if not groups:
        return []
    device = logits.device
    rows = [row for group in groups for row in group.rows]
    owners = [as_row_sees(group, i) for group in groups for i in range(len(group.drafts) + 1)]
    local = _local_rows(groups)
    probs = sampler.distributions(logits[torch.tensor(rows, device=device)], owners)
    draft_rows = [local[g] + i for g, group in enumerate(groups) for i in range(len(group.drafts))]
    draft_ids = [token for group in groups for token in group.drafts]
    chances = probs[
        torch.tensor(draft_rows, device=device), torch.tensor(draft_ids, device=device)
    ].tolist()
    kept_counts: list[int] = []
    offset = 0
    for group in groups:
        count = len(group.drafts)
        draws = sampler.uniforms(count, group.request).tolist()
        kept = 0
        while kept < count and draws[kept] < chances[offset + kept]:
            kept += 1
        kept_counts.append(kept)
        offset += count
    final = torch.stack([probs[local[g] + kept] for g, kept in enumerate(kept_counts)])
    for g, (group, kept) in enumerate(zip(groups, kept_counts, strict=True)):
        if kept < len(group.drafts):
            _without(final[g], group.drafts[kept])
    tokens = sampler.draw(final, [group.request for group in groups]).tolist()
    return [
        Verified(group.drafts[:kept], token)
        for group, kept, token in zip(groups, kept_counts, tokens, strict=True)
    ]


def _verify_constrained(sampler: Sampler, logits: torch.Tensor, group: VerifyGroup) -> Verified:
    """A group under a format, row by row: row i masked by the matcher as it stands after the
    drafts kept before it, and no row's mask computed past the first refused draft (a mask
    costs more than a row's sampling; a step then computes one per token it gives, as
    without drafts). The matcher is taken back to where it was; `receive` advances it over
    the kept tokens as over any."""
    request, matcher = group.request, group.request.grammar
    valid = matcher.validate_tokens(group.drafts)  # consuming a refused one would break it
    kept = 0
    try:
        while True:
            row = logits[group.first + kept : group.first + kept + 1]
            probs = sampler.distributions(row, [as_row_sees(group, kept)])
            if kept == len(group.drafts):
                break
            draft = group.drafts[kept]
            chance = float(probs[0, draft])
            if kept >= valid or float(sampler.uniforms(1, request)[0]) >= chance:
                _without(probs[0], draft)
                break
            matcher.consume_token(draft)
            kept += 1
        token = int(sampler.draw(probs, [request])[0])
    finally:
        matcher.rollback(kept)
    return Verified(group.drafts[:kept], token)


def as_row_sees(group: VerifyGroup, row: int) -> Request:
    """The request as its group's row `row` sees it: its tokens and the drafts before the row,
    where its sampling reads them (penalties count them, bad words and `min_tokens` go by
    them); else the request itself."""
    request = group.request
    params = request.sampling_params
    reads = params.needs_penalties or request.bad_words or params.min_tokens
    if row == 0 or not reads:
        return request
    view = copy.copy(request)
    view.output_token_ids = [*request.output_token_ids, *group.drafts[:row]]
    view.all_token_ids = [*request.all_token_ids, *group.drafts[:row]]
    return view


def verified_logprobs(
    logits: torch.Tensor, group: VerifyGroup, verified: Verified, mode: str = "raw_logprobs"
) -> list[TokenLogprob]:
    """The logprobs of each token the group keeps (its drafts, then its token), each from the
    raw logits of the row that chose it (a raw `--logprobs-mode`: the processed ones do not
    speculate), as a one-token step reports them."""
    kept = [*verified.accepted, verified.token]
    rows = logits[group.first : group.first + len(kept)].float()
    count = group.request.sampling_params.logprobs
    tokens = torch.tensor(kept, device=logits.device)
    entries = token_logprobs(raw_scores(rows, mode), tokens, [count] * len(kept))
    return [entry for entry in entries if entry is not None]


def _local_rows(groups: list[VerifyGroup]) -> list[int]:
    """Each group's first row among the groups' rows alone."""
    starts, at = [], 0
    for group in groups:
        starts.append(at)
        at += len(group.drafts) + 1
    return starts


def _without(weights: torch.Tensor, token: int) -> None:
    """Take a refused draft out of its row's distribution (the rest keep their proportions);
    a row with nothing else left (the draft's refusal was a rounding away from certain) keeps
    it."""
    rest = weights.clone()
    rest[token] = 0.0
    if bool(rest.sum() > 0):
        weights.copy_(rest)
