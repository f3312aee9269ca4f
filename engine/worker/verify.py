"""Verifying drafted tokens (`core/speculation.py`): which drafts a sequence keeps, and the token
that follows them.

A request with drafts d1..dk runs k + 1 rows; row i's distribution is the model's next token after
d1..di. Each row draws its token as a step without drafts would draw it there (the sampler's
same code; for a seeded request, the same draw, keyed by the token's position); draft d(i+1)
is kept while it is the token row i drew, and the first row whose token differs gives that
token (when every draft is kept, row k gives one more). A draft is certain (its proposal puts all
its mass on one token), so this keeps it with probability p_i(d(i+1)) and otherwise gives a
token of p_i without it, as speculative sampling's rule does; and a seeded request writes the
same tokens with drafts as without. In a recurrent model each row keeps its states in a slot of
its own (`InputBatch.state_sources`), and the request's slot takes its last kept row's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from engine.core.outputs import TokenLogprob
from engine.core.request import Request
from engine.worker.input_batch import InputBatch
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


def kept_state_copies(batch: InputBatch, accepted: dict[str, list[int]]) -> list[tuple[int, int]]:
    """The copies of recurrent states a verifying step leaves: for each request that kept
    drafts (`accepted`, by request id), its last kept row's slot into its first row's, its own
    (none where the model keeps no states, or the request kept no draft)."""
    if not len(batch.state_sources):
        return []
    first_rows: dict[str, int] = {}
    for row, request in enumerate(batch.requests):
        first_rows.setdefault(request.request_id, row)
    slots = batch.state_slots
    copies = []
    for request_id, kept in accepted.items():
        first = first_rows[request_id]
        if kept:
            copies.append((int(slots[first + len(kept)]), int(slots[first])))
    return copies


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
    """Each group verified against the tokens its rows draw (`logits` holds the rows of the
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
    """Groups without a format: every row's token drawn at once, then each group's drafts
    kept while they are the tokens drawn before them."""
    if not groups:
        return []
    device = logits.device
    rows = [row for group in groups for row in group.rows]
    owners = [as_row_sees(group, i) for group in groups for i in range(len(group.drafts) + 1)]
    positions = [_position(group, i) for group in groups for i in range(len(group.drafts) + 1)]
    drawn = sampler.choose(logits[torch.tensor(rows, device=device)], owners, positions).tolist()
    verified, at = [], 0
    for group in groups:
        verified.append(_kept(group, drawn[at : at + len(group.drafts) + 1]))
        at += len(group.drafts) + 1
    return verified


def _kept(group: VerifyGroup, drawn: list[int]) -> Verified:
    """The drafts equal to the tokens its rows drew before them, and the token after."""
    kept = 0
    while kept < len(group.drafts) and group.drafts[kept] == drawn[kept]:
        kept += 1
    return Verified(group.drafts[:kept], drawn[kept])


def _position(group: VerifyGroup, row: int) -> int:
    """Where row `row`'s token lies in its request's output."""
    return group.request.num_output_tokens + row


def _verify_constrained(sampler: Sampler, logits: torch.Tensor, group: VerifyGroup) -> Verified:
    """A group under a format, row by row: row i masked by the matcher as it stands after the
    drafts kept before it, and no row's mask computed past the first draft refused (a mask
    costs more than a row's sampling; a step then computes one per token it gives, as
    without drafts). The matcher is taken back to where it was; `receive` advances it over
    the kept tokens as over any."""
    matcher = group.request.grammar
    valid = matcher.validate_tokens(group.drafts)  # consuming a refused one would break it
    kept = 0
    try:
        while True:
            row = logits[group.first + kept : group.first + kept + 1]
            owner = as_row_sees(group, kept)
            token = int(sampler.choose(row, [owner], [_position(group, kept)])[0])
            if kept == len(group.drafts) or kept >= valid or token != group.drafts[kept]:
                break
            matcher.consume_token(token)
            kept += 1
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
    tokens = torch.tensor(kept, device=logits.device).clamp(min=0)  # NO_TOKEN: failed anyway
    entries = token_logprobs(raw_scores(rows, mode), tokens, [count] * len(kept))
    return [entry for entry in entries if entry is not None]
