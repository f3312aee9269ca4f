"""Top-k and top-p: which tokens each row keeps, found without sorting the vocabulary.

A row keeps every token at least its threshold. Its top-k is every token at least its k-th
largest logit (the ties of that logit kept, as vLLM keeps them). Its top-p nucleus (over the
top-k where it has one, renormalised, as vLLM applies them) is every token whose probability
mass strictly above it is below top_p: the best token always, and every token tied with the
last one the nucleus needs, as the GPU's nucleus kernel keeps them. The search is a `topk` of
the batch's largest top_k, or of the first NUCLEUS_FIRST_WIDTH tokens where some row has top_p
alone; an LLM's nucleus usually lies there. A flatter row's nucleus reaches past them: its edge
is then found from a histogram of its probability mass by logit (one pass over the row) and a
sort of the one bucket that holds the edge.
"""

from __future__ import annotations

import torch

from engine.core.sampling_params import SamplingParams
from engine.worker.transfer import to_device

# How many candidates the search takes where some row has top_p and no top_k.
NUCLEUS_FIRST_WIDTH = 256
# The buckets of a flat row's histogram: its edge is sorted among one bucket's tokens.
EDGE_BUCKETS = 2048
# Logits this far below a row's log-sum-exp share the histogram's last bucket: their mass is
# below any nucleus' reach (e^-40 each).
LOWEST_LOGIT = 40.0


def top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`logits` with everything outside each row's top-k and top-p nucleus at -inf (a row with
    neither keeps every logit). Only rows with top_p and no top-k make the search ask the host
    anything; on a GPU the sampler draws those rows in the nucleus kernel instead."""
    rows = [row for row, p in enumerate(params) if p.uses_top_k or p.top_p < 1.0]
    if len(rows) < len(params):  # rows that keep every token stay as they are
        index = to_device(rows, logits.device)
        kept = logits.clone()
        kept[index] = top_k_top_p(logits[index], [params[row] for row in rows])
        return kept
    return logits.masked_fill(logits < thresholds(logits, params)[:, None], float("-inf"))


def row_top_ks(params: list[SamplingParams], vocab: int) -> list[int]:
    """Each row's top_k within the vocabulary, the vocabulary's size where it has none."""
    return [min(p.top_k, vocab) if p.uses_top_k else vocab for p in params]


def thresholds(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The smallest logit each row keeps, every row bounded by a top-k or a top-p: its k-th
    largest or its nucleus' edge, whichever is larger."""
    vocab = logits.shape[1]
    device = logits.device
    ks = row_top_ks(params, vocab)
    top_k = to_device(ks, device)
    top_p = to_device([p.top_p for p in params], device)
    limited = top_k < vocab
    below = [k for k in ks if k < vocab]
    # Every row with a top_k: its largest. Else at least the first search width.
    every_limited = len(below) == len(ks)
    width = min(vocab, max(below) if every_limited else max([*below, NUCLEUS_FIRST_WIDTH]))
    candidates = logits.topk(width, dim=-1).values
    kth = candidates.gather(1, (top_k.clamp(max=width) - 1)[:, None]).squeeze(1)
    kth = torch.where(limited, kth, float("-inf"))
    # Each row's mass counts against its top-k, the ties of its k-th largest past the
    # candidates included (or against the whole vocabulary).
    norm = torch.logsumexp(logits.masked_fill(logits < kth[:, None], float("-inf")), dim=-1)
    candidates = candidates.masked_fill(candidates < kth[:, None], float("-inf"))
    edge = _sorted_edge(candidates, (candidates - norm[:, None]).exp(), top_p)
    edge = torch.where(top_p < 1.0, edge, float("-inf"))
    if not every_limited and width < vocab:
        # A row without top_k whose nucleus, ties of its edge included, may reach past them.
        open_rows = ~limited & (candidates[:, -1] >= edge)
        if bool(open_rows.any()):
            index = open_rows.nonzero().squeeze(1)
            edge[index] = nucleus_edge(
                logits[index], top_p[index], norm[index], candidates[index, -1]
            )
    return torch.maximum(edge, kth)


def _sorted_edge(
    candidates: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The smallest logit of each row's nucleus among its sorted `candidates`: that of the last
    one whose mass before it is below top_p (the first, at least); -inf where the nucleus
    reaches past the candidates kept."""
    before = probs.cumsum(dim=-1) - probs
    last = ((before < top_p[:, None]).sum(dim=-1) - 1).clamp_(min=0)
    return candidates.gather(1, last[:, None]).squeeze(1)


def nucleus_edge(
    logits: torch.Tensor, top_p: torch.Tensor, whole: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """The smallest logit of each row's top-p nucleus, `whole` each row's log-sum-exp and
    `start` a logit at or above the edge. Each row's mass is summed by buckets of logit from
    `start` down (all above it in the first, the lowest logits in the last); the edge lies in
    the first bucket whose running sum reaches top_p, where that bucket's tokens alone are
    sorted and summed on from the mass before it."""
    probs = torch.sub(logits, whole[:, None]).exp_()
    lowest = torch.maximum(logits.amin(dim=-1), whole - LOWEST_LOGIT)
    lowest = torch.minimum(lowest, start - 1e-3)
    scale = (EDGE_BUCKETS / (start - lowest))[:, None]
    position = torch.sub(start[:, None], logits).mul_(scale).nan_to_num_(nan=EDGE_BUCKETS - 1)
    # Through int32: a float's conversion to int64 is several times slower on the CPU.
    bucket = position.clamp_(0, EDGE_BUCKETS - 1).int().long()
    mass = torch.zeros(logits.shape[0], EDGE_BUCKETS, device=logits.device)
    running = mass.scatter_add_(1, bucket, probs).cumsum(dim=-1)
    edge_bucket = (running < top_p[:, None]).sum(dim=-1).clamp_(max=EDGE_BUCKETS - 1)
    before = running.gather(1, (edge_bucket - 1).clamp(min=0)[:, None]).squeeze(1)
    before = torch.where(edge_bucket > 0, before, torch.zeros_like(before))
    inside = bucket == edge_bucket[:, None]
    count = inside.sum(dim=-1, dtype=torch.int32)
    width = max(1, int(count.max()))
    values = torch.where(inside, logits, float("-inf")).topk(width, dim=-1).values
    reached = before[:, None] + (values - whole[:, None]).exp().cumsum(dim=-1)
    last = torch.minimum((reached < top_p[:, None]).sum(dim=-1), (count.long() - 1).clamp(min=0))
    return values.gather(1, last[:, None]).squeeze(1)
