"""Verifying drafts keeps each token's distribution what one token a step would draw: the first
token follows the model's first row, the second (where the draft was kept) its second row."""

from __future__ import annotations

import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.worker.sampler import Sampler
from engine.worker.verify import VerifyGroup, groups_of, verify_chosen, verify_sampled

VOCAB = 6
# Two rows of logits: after the last known token, and after the draft.
LOGITS = torch.tensor(
    [
        [1.0, 0.2, 1.6, -0.5, 0.9, 0.0],
        [0.1, 2.0, -1.0, 0.7, 1.1, 0.3],
    ]
)
DRAFT = 2
TRIALS = 6000


def expected(params: SamplingParams) -> torch.Tensor:
    """Each row's distribution, computed here: temperature, then the top-k tokens kept, then
    those at least min_p of the likeliest."""
    probs = torch.softmax(LOGITS / params.temperature, dim=-1)
    if params.top_k > 0:
        kept = probs.topk(params.top_k, dim=-1).indices
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, kept, True)
        probs = torch.where(mask, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.min_p > 0:
        probs = torch.where(
            probs >= probs.max(dim=-1, keepdim=True).values * params.min_p, probs, 0
        )
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def outcomes(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each first token came, and each second token after a kept draft, over
    TRIALS groups (one request each) verified in one call."""
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=3)
    requests = [Request(f"r{i}", [0], params, 0.0, 100) for i in range(TRIALS)]
    groups = [VerifyGroup(r, 2 * i, [DRAFT]) for i, r in enumerate(requests)]
    logits = LOGITS.repeat(TRIALS, 1)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    for verified in verify_sampled(sampler, logits, groups):
        if verified.accepted:
            first[DRAFT] += 1
            second[verified.token] += 1
        else:
            first[verified.token] += 1
    return first / TRIALS, second / TRIALS


def test_sampled_tokens_follow_the_model_s_rows():
    for params in [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=3),
        SamplingParams(temperature=1.0, min_p=0.5),
    ]:
        want = expected(params)
        first, second = outcomes(params)
        # Three standard deviations of a frequency over TRIALS draws is below 0.02.
        assert torch.allclose(first, want[0], atol=0.02), (params, first, want[0])
        assert torch.allclose(second, want[0, DRAFT] * want[1], atol=0.02), (params, second)


def test_greedy_groups_keep_the_drafts_equal_to_the_argmax():
    sampler = Sampler(VOCAB, torch.device("cpu"))
    greedy = SamplingParams(temperature=0)
    kept = Request("kept", [0], greedy, 0.0, 100)
    refused = Request("refused", [0], greedy, 0.0, 100)
    # Row 0's argmax is 2 (the draft is kept), row 1's is 1.
    groups = [VerifyGroup(kept, 0, [2]), VerifyGroup(refused, 2, [4])]
    results = verify_sampled(sampler, LOGITS.repeat(2, 1), groups)
    assert [(r.accepted, r.token) for r in results] == [([2], 1), ([], 2)]
    chosen = [2, 1, 7, 7]
    assert verify_chosen(chosen, groups[0]) == results[0]
    assert verify_chosen([*chosen[:2], 2, 9], groups[1]).accepted == []


def test_groups_are_found_among_the_sampled_rows():
    params = SamplingParams()
    a, b, c = (Request(name, [0], params, 0.0, 100) for name in "abc")
    groups = groups_of([a, b, b, b, c, c], {"b": [5, 6], "c": [9]})
    assert [(g.request.request_id, g.first, g.drafts) for g in groups] == [
        ("b", 1, [5, 6]),
        ("c", 4, [9]),
    ]


def test_greedy_groups_draw_no_noise():
    """Greedy rows take their argmax without drawing noise over the vocabulary (a cost a row
    under a format paid, verified one by one): the sampler's generator is where it was."""
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=3)
    state = sampler._generator.get_state()
    requests = [Request(f"r{i}", [0], SamplingParams(temperature=0), 0.0, 100) for i in range(3)]
    groups = [VerifyGroup(r, 2 * i, [2]) for i, r in enumerate(requests)]
    verified = verify_sampled(sampler, LOGITS.repeat(3, 1), groups)
    assert [(v.accepted, v.token) for v in verified] == [([2], 1)] * 3
    assert torch.equal(sampler._generator.get_state(), state)
