from __future__ import annotations

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.worker.sampler import Sampler, inverse_cdf, takes_argmax

VOCAB = 50


def request(
    name: str = "r",
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    **params: object,
) -> Request:
    req = Request(
        name,
        prompt or [1, 2, 3],
        SamplingParams(**params),
        0.0,
        10_000,
        eos_token_ids=frozenset({0}),
    )
    for token in output or []:
        req.append_output(token)
    return req


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * 3


def sample(requests: list[Request], values: torch.Tensor, sampler: Sampler | None = None):
    sampler = sampler or Sampler(VOCAB, torch.device("cpu"))
    return sampler(values.clone(), requests)


def test_greedy_is_argmax():
    values = logits(4)
    out = sample([request(str(i), temperature=0) for i in range(4)], values)
    assert out.token_ids == values.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=1e-4)]
)
def test_settings_that_leave_one_candidate_equal_greedy(params):
    values = logits(8, seed=3)
    requests = [request(str(i), **params) for i in range(8)]
    assert sample(requests, values).token_ids == values.argmax(dim=-1).tolist()


def test_top_k_never_samples_outside_the_top_k():
    values = logits(1, seed=1)
    allowed = set(values[0].topk(3).indices.tolist())
    sampler = Sampler(VOCAB, torch.device("cpu"))
    seen = {
        sample([request(top_k=3, temperature=2.0)], values, sampler).token_ids[0]
        for _ in range(200)
    }
    assert seen <= allowed and len(seen) > 1


def test_top_p_keeps_the_smallest_nucleus():
    values = torch.full((1, VOCAB), -20.0)
    values[0, 5], values[0, 6], values[0, 7] = 2.0, 1.0, 0.0  # probs ~ .665, .245, .09
    sampler = Sampler(VOCAB, torch.device("cpu"))
    seen = {sample([request(top_p=0.8)], values, sampler).token_ids[0] for _ in range(300)}
    assert seen == {5, 6}


def test_sampling_follows_the_distribution():
    values = torch.full((1, VOCAB), -30.0)
    values[0, 3], values[0, 4] = 0.0, float(torch.log(torch.tensor(3.0)))  # p = .25 / .75
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=5)
    picks = [sample([request()], values, sampler).token_ids[0] for _ in range(2000)]
    share = picks.count(4) / len(picks)
    assert set(picks) == {3, 4}
    assert 0.70 < share < 0.80


@pytest.mark.parametrize("race", [False, True])
def test_both_ways_of_drawing_follow_a_whole_distribution(race):
    """Twelve thousand draws from a 50-token distribution (some tokens ruled out), by the
    running sum and by the race: each token's share within four standard deviations of its
    probability, and no ruled-out token drawn."""
    weights = torch.rand(VOCAB, generator=torch.Generator().manual_seed(4)) ** 3
    weights[::7] = 0.0
    probs = weights / weights.sum()
    rows = 12_000
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=8, race=race)
    requests = [request(f"r{i}") for i in range(rows)]
    drawn = sampler.choose(weights.log().expand(rows, VOCAB).clone(), requests, [0] * rows)
    counts = torch.bincount(drawn, minlength=VOCAB).double()
    assert counts[::7].sum() == 0
    spread = (probs * (1 - probs) / rows).sqrt().double()
    assert ((counts / rows - probs.double()).abs() <= 4 * spread + 1e-9).all()


def test_the_running_sum_never_lands_on_a_token_of_no_weight():
    weights = torch.tensor(
        [[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.0] * 6, [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]]
    )
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    for u, first_row in [(0.0, 1), (0.4999, 1), (0.5, 3), (float(below_one), 3)]:
        drawn = inverse_cdf(weights, torch.tensor([u, u, u])).tolist()
        # A row of no weight gets its last token (its caller reads it as ruled out).
        assert drawn == [first_row, 5, 5], u
    # A draw of 1 itself (rounding of u * total) still lands on a token of weight.
    assert inverse_cdf(weights, torch.ones(3)).tolist() == [3, 5, 5]


def test_seeded_request_is_reproducible_whatever_shares_the_batch():
    values = logits(1, seed=9)
    alone = Sampler(VOCAB, torch.device("cpu"))
    # The step-th token of the request (its noise is keyed by the seed and that position).
    tokens_alone = [
        sample([request("s", [5] * step, seed=42)], values, alone).token_ids[0]
        for step in range(20)
    ]
    busy = Sampler(VOCAB, torch.device("cpu"), seed=123)
    tokens_busy = []
    for step in range(20):
        mates = [request(f"m{i}", temperature=1.5) for i in range(step % 4)]
        batch = [*mates, request("s", [5] * step, seed=42)]
        values_busy = torch.cat([logits(len(mates), seed=step), values])
        tokens_busy.append(sample(batch, values_busy, busy).token_ids[-1])
    assert tokens_alone == tokens_busy
    assert len(set(tokens_alone)) > 1


def test_logit_bias_forces_and_bans_tokens():
    values = logits(2)
    out = sample(
        [
            request("a", temperature=0, logit_bias={17: 100.0}),
            request("b", temperature=0, logit_bias={int(values[1].argmax()): -100.0}),
        ],
        values,
    )
    assert out.token_ids[0] == 17
    assert out.token_ids[1] != int(values[1].argmax())


def test_allowed_token_ids_are_all_a_row_can_draw():
    values = logits(3, seed=5)
    allowed = (3, 11, 40)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    drawn = set()
    for step in range(40):
        rows = [
            request("greedy", temperature=0, allowed_token_ids=allowed),
            request("free", temperature=0),
            request("hot", [5] * step, temperature=5.0, allowed_token_ids=allowed, seed=2),
        ]
        out = sample(rows, values, sampler)
        assert out.token_ids[0] == max(allowed, key=lambda t: float(values[0, t]))
        assert out.token_ids[1] == int(values[1].argmax())
        drawn.add(out.token_ids[2])
    assert drawn == set(allowed)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    values = torch.zeros(1, VOCAB)
    values[0, 0] = 10.0  # EOS is the favourite
    values[0, 9] = 9.0
    early = request(temperature=0, min_tokens=2, output=[5], stop_token_ids=(9,))
    late = request(temperature=0, min_tokens=2, output=[5, 6])
    assert sample([early], values).token_ids == [int(values[0, 1:9].argmax()) + 1]
    assert sample([late], values).token_ids == [0]


def test_repetition_penalty_discourages_seen_tokens():
    values = torch.zeros(1, VOCAB)
    values[0, 7], values[0, 8] = 2.0, 1.9
    plain = sample([request(temperature=0, output=[7])], values).token_ids
    penalised = sample([request(temperature=0, output=[7], repetition_penalty=1.5)], values)
    assert plain == [7] and penalised.token_ids == [8]


def test_presence_and_frequency_penalties_follow_openai():
    values = torch.zeros(1, VOCAB)
    values[0, 7], values[0, 8] = 2.0, 1.0
    out = [7, 7, 7]
    assert sample(
        [request(temperature=0, output=out, frequency_penalty=0.4)], values
    ).token_ids == [8]  # 2.0 - 3 * 0.4 = 0.8 < 1.0
    assert sample([request(temperature=0, output=out, presence_penalty=0.5)], values).token_ids == [
        7
    ]  # 2.0 - 0.5 = 1.5 > 1.0
    assert sample([request(temperature=0, output=out, presence_penalty=1.5)], values).token_ids == [
        8
    ]


def test_logprobs_of_sampled_token_and_alternatives():
    values = logits(2, seed=4)
    reference = torch.log_softmax(values, dim=-1)
    out = sample([request("a", temperature=0, logprobs=3), request("b", temperature=0)], values)
    first = out.logprobs[0]
    assert out.logprobs[1] is None
    assert first.token_id == out.token_ids[0]
    assert first.rank == 1
    assert first.logprob == pytest.approx(reference[0].max().item(), abs=1e-5)
    top_ids = [token for token, _ in first.top]
    assert top_ids == reference[0].topk(3).indices.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(
        reference[0].topk(3).values.tolist(), abs=1e-5
    )


def test_rank_of_a_sampled_token_that_was_not_the_best():
    values = torch.zeros(1, VOCAB)
    values[0, 3], values[0, 4] = 5.0, 4.0
    out = sample([request(temperature=0, logprobs=0, logit_bias={4: 2.0})], values)
    assert out.token_ids == [4]
    assert out.logprobs[0].rank == 2  # logprobs are the model's, before the bias
    assert out.logprobs[0].top == ()


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        (request(temperature=0), True),
        (request(temperature=0, seed=7, top_k=3, stop_token_ids=(4,)), True),
        (request(temperature=0.7), False),
        (request(temperature=0, logprobs=0), False),
        (request(temperature=0, logit_bias={4: 3.0}), False),
        (request(temperature=0, allowed_token_ids=(4, 5)), False),
        (request(temperature=0, repetition_penalty=1.2), False),
        (request(temperature=0, presence_penalty=0.5), False),
        (request(temperature=0, min_tokens=2), False),
        (request(output=[5, 5], temperature=0, min_tokens=2), True),
    ],
)
def test_which_requests_take_the_argmax_of_raw_logits(req: Request, expected: bool) -> None:
    """The model may choose these rows' tokens itself (`ModelRunner` over a greedy LM head)."""
    assert takes_argmax([req]) is expected
    assert takes_argmax([request(temperature=0), req]) is expected


def test_a_temperature_too_small_to_divide_by_samples_greedily():
    values = logits(3, seed=4)
    rows = [
        request("tiny", temperature=1e-38, seed=1),
        request("zero", temperature=0),
        request("warm", temperature=1e-4, seed=1),
    ]
    out = sample(rows, values)
    assert out.token_ids[:2] == values[:2].argmax(dim=-1).tolist()
    assert rows[0].sampling_params.greedy and not rows[2].sampling_params.greedy


def per_row_reference(values: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Penalties and `min_tokens` one row at a time, the plain way."""
    values = values.clone()
    for row, req in enumerate(requests):
        params = req.sampling_params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(req.all_token_ids).unique()
            old = values[row, seen]
            values[row, seen] = torch.where(
                old > 0, old / params.repetition_penalty, old * params.repetition_penalty
            )
        if req.output_token_ids and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=VOCAB)
            values[row] -= params.frequency_penalty * counts
            values[row] -= params.presence_penalty * (counts > 0).float()
        if req.num_output_tokens < params.min_tokens:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else {0})
            values[row, sorted(banned)] = float("-inf")
    return values


@pytest.mark.parametrize("seed", range(10))
def test_batched_penalties_and_min_tokens_equal_the_per_row_reference(seed):
    rng = torch.Generator().manual_seed(seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=rng))]

    requests = []
    for i in range(12):
        output = torch.randint(VOCAB, (int(torch.randint(0, 20, (1,), generator=rng)),),
                               generator=rng).tolist()  # fmt: skip
        requests.append(
            request(
                f"r{i}",
                output=output,
                prompt=torch.randint(1, VOCAB, (5,), generator=rng).tolist(),
                temperature=pick(0.0, 0.8),
                repetition_penalty=pick(1.0, 1.3, 0.7),
                presence_penalty=pick(0.0, 0.5, -0.4),
                frequency_penalty=pick(0.0, 0.3),
                min_tokens=pick(0, 5, 30),
                stop_token_ids=pick((), (9, 11)),
                ignore_eos=pick(False, True),
            )
        )
    values = logits(12, seed)
    batched = Sampler(VOCAB, torch.device("cpu"))._process(values.clone(), requests)
    assert torch.equal(batched, per_row_reference(values, requests))


def mode_sampler(mode: str) -> Sampler:
    return Sampler(VOCAB, torch.device("cpu"), logprobs_mode=mode)


def test_raw_logits_mode_reports_the_model_s_logits():
    values = logits(1, seed=6)
    out = sample(
        [request(temperature=0.8, top_k=3, logprobs=4)], values, mode_sampler("raw_logits")
    )
    entry = out.logprobs[0]
    assert entry.logprob == pytest.approx(values[0, entry.token_id].item())
    assert [lp for _, lp in entry.top] == pytest.approx(values[0].topk(4).values.tolist())


def test_processed_logprobs_are_the_distribution_sampling_draws_from():
    """vLLM's `processed_logprobs`: after the penalty and temperature, the top-k's tokens
    renormalized and the others at -inf, reported as -9999."""
    values = logits(1, seed=7)
    seen = values[0].topk(2).indices.tolist()  # the penalty changes which tokens lead
    params = {"temperature": 0.7, "top_k": 4, "repetition_penalty": 1.3, "logprobs": 6}
    row = request(output=seen, **params)
    out = sample([row], values, mode_sampler("processed_logprobs"))
    penalised = values[0].clone()
    for token in {1, 2, 3, *seen}:  # the prompt's tokens and the output's
        value = penalised[token]
        penalised[token] = value / 1.3 if value > 0 else value * 1.3
    scaled = penalised / 0.7
    kept = scaled.topk(4).indices
    reference = torch.full_like(scaled, float("-inf"))
    reference[kept] = torch.log_softmax(scaled[kept], dim=-1)
    entry = out.logprobs[0]
    assert entry.token_id in kept.tolist()
    assert entry.logprob == pytest.approx(reference[entry.token_id].item(), abs=1e-5)
    shown = [lp for _, lp in entry.top]
    assert shown[:4] == pytest.approx(reference[kept].sort(descending=True).values.tolist())
    assert shown[4:] == [-9999.0, -9999.0]


def test_processed_logits_of_a_greedy_row_carry_its_bias_but_no_temperature():
    values = logits(2, seed=8)
    rows = [
        request("g", temperature=0, logit_bias={5: 3.0}, logprobs=1),
        request("s", temperature=2.0, logprobs=1),
    ]
    out = sample(rows, values, mode_sampler("processed_logits"))
    biased = values[0].clone()
    biased[5] += 3.0
    assert out.logprobs[0].logprob == pytest.approx(biased.max().item())
    chosen = out.logprobs[1].token_id
    assert out.logprobs[1].logprob == pytest.approx(values[1, chosen].item() / 2.0)


@pytest.mark.parametrize(
    "kind",
    [
        dict(top_k=40),
        dict(top_p=0.9),
        dict(top_k=200, top_p=0.5),
        dict(top_p=0.97, min_p=0.02),
        dict(top_k=5, min_p=0.3),
        dict(top_p=0.999),  # flat rows: a nucleus of most of the vocabulary
        dict(),  # bounded by nothing: the whole vocabulary's sum
    ],
)
def test_a_step_draws_what_verifying_a_draft_draws_for_a_seeded_row(kind):
    """A seeded row draws the same token whether a step samples it alone or a verify step
    chooses it among others at that position of its output (the same draw, keyed by the
    position), peaked rows and flat ones, never a token ruled out among them."""
    vocab, rows = 3000, 240
    generator = torch.Generator().manual_seed(12)
    spread = torch.tensor([6.0 if row % 2 else 0.05 for row in range(rows)])[:, None]
    values = torch.randn(rows, vocab, generator=generator) * spread
    values[:, ::11] = float("-inf")
    requests = [
        request(f"r{row}", [5] * (row % 3), temperature=0.8, seed=row, **kind)
        for row in range(rows)
    ]
    sampler = Sampler(vocab, torch.device("cpu"))
    stepped = torch.cat(
        [
            sampler.sample(values[row : row + 1].clone(), [requests[row]]).token_ids
            for row in range(rows)
        ]
    )
    verified = sampler.choose(values.clone(), requests, [row % 3 for row in range(rows)])
    assert stepped.tolist() == verified.tolist()
    assert bool(torch.isfinite(values.gather(1, stepped[:, None])).all())
    assert len(set(stepped.tolist())) > rows // 4
