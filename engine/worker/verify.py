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

from dataclasses import dataclass

import torch

from engine.core.outputs import TokenLogprob
from engine.core.request import Request
from engine.worker.sampler import GrammarMasks, Sampler, fill_mask, token_logprobs


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
    step's sampled rows, indexed as the groups say)."""
    if not groups:
        return []
    device = logits.device
    rows = [row for group in groups for row in group.rows]
    owners = [group.request for group in groups for _ in group.rows]
    local = _local_rows(groups)
    masks = draft_masks(groups, local, logits.shape[1])
    probs = sampler.distributions(logits[torch.tensor(rows, device=device)], owners, masks)
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


def draft_masks(groups: list[VerifyGroup], local: list[int], vocab: int) -> GrammarMasks | None:
    """Each constrained group's rows' masks, row i's after the matcher takes the drafts before
    it (then taken back): the format rules each draft as it would rule a sampled token. A draft
    the matcher refuses (drafts are checked when made, so none should be) leaves the rows after
    it the mask before it: that draft is refused there anyway, and they are never used."""
    constrained = [g for g, group in enumerate(groups) if group.request.grammar is not None]
    if not constrained:
        return None
    count = sum(len(groups[g].drafts) + 1 for g in constrained)
    masks = GrammarMasks.empty(count, vocab)
    at = 0
    for g in constrained:
        group, matcher = groups[g], groups[g].request.grammar
        valid = matcher.validate_tokens(group.drafts)  # consuming a refused one would break it
        for i in range(len(group.drafts) + 1):
            masks.rows.append(local[g] + i)
            if i > valid:
                masks.bits[at + i] = masks.bits[at + i - 1]
                continue
            fill_mask(matcher, masks.bits[at + i])
            if i < valid:
                matcher.consume_token(group.drafts[i])
        matcher.rollback(valid)
        at += len(group.drafts) + 1
    return masks


def verified_logprobs(
    logits: torch.Tensor, group: VerifyGroup, verified: Verified
) -> list[TokenLogprob]:
    """The logprobs of each token the group keeps (its drafts, then its token), each from the
    raw logits of the row that chose it, as a one-token step reports them."""
    kept = [*verified.accepted, verified.token]
    rows = logits[group.first : group.first + len(kept)].float()
    count = group.request.sampling_params.logprobs
    tokens = torch.tensor(kept, device=logits.device)
    entries = token_logprobs(torch.log_softmax(rows, dim=-1), tokens, [count] * len(kept))
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
