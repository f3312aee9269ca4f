"""The sampler's Triton kernels (on the GPU; in Triton's interpreter here). Top-p rows: the
token is the exponential race's winner over the row's nucleus, as a sort of the whole
vocabulary gives it, and the sampler's choices with the kernel are those of its torch route,
with no value read back from the device. Seeded rows: Exp(1) noise that depends on the seed
and the draw alone."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.worker.sampler import Sampler
from tests.conftest import TRITON_DEVICE, needs_triton

pytestmark = needs_triton


def sorted_race(
    logits: torch.Tensor, noise: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Each row's nucleus from a full sort (a token stays while the mass before it is below
    top_p), cut by min-p, then the race p / noise over what is left."""
    probs = torch.softmax(logits, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    keep_sorted = ordered.cumsum(dim=-1) - ordered < top_p[:, None]
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    keep &= probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return torch.where(keep, probs / noise, -1.0).argmax(dim=-1)


def draw(logits, noise, top_p, min_p) -> torch.Tensor:
    from engine.kernels.triton.sampling import nucleus_sample

    device = torch.device(TRITON_DEVICE)
    rows = torch.arange(logits.shape[0], device=device)
    return nucleus_sample(
        logits.to(device), noise.to(device), rows, top_p.to(device), min_p.to(device)
    ).cpu()


@pytest.mark.parametrize("spread", [0.05, 1.0, 4.0, 12.0])
def test_the_kernel_draws_the_race_winner_over_the_nucleus(spread):
    """Flat rows (a nucleus of most of the vocabulary, many rounds of pivoting) to peaked ones
    (a nucleus of a few tokens), top_p from 0.01 to 0.99, some rows with min_p, one row with
    most of its vocabulary ruled out."""
    generator = torch.Generator().manual_seed(int(spread * 100))
    rows, vocab = 24, 3000
    logits = torch.randn(rows, vocab, generator=generator) * spread
    logits[1, 7:] = float("-inf")
    noise = torch.empty(rows, vocab).exponential_(generator=generator)
    top_p = torch.rand(rows, generator=generator) * 0.98 + 0.01
    min_p = torch.rand(rows, generator=generator) * 0.3 * (torch.arange(rows) % 3 == 0)
    assert torch.equal(draw(logits, noise, top_p, min_p), sorted_race(logits, noise, top_p, min_p))


def test_tokens_tied_at_the_edge_of_the_nucleus_stay_in_it_together():
    """A sort would keep the first few of equal tokens by position; the kernel keeps every
    token as likely as one the nucleus needs, so each of them can be drawn."""
    logits = torch.full((200, 64), float("-inf"))
    logits[:, 0] = 2.0
    logits[:, 1:11] = 0.0  # p = 0.45 for token 0, 0.055 for each of ten tied tokens
    noise = torch.empty_like(logits).exponential_(generator=torch.Generator().manual_seed(1))
    drawn = draw(logits, noise, torch.full((200,), 0.5), torch.zeros(200))
    assert set(drawn.tolist()) == set(range(11))


# Triton's interpreter subtracts -inf from -inf in numpy for the all -inf row.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_row_with_nothing_to_draw_from_gets_token_0_and_ends():
    logits = torch.randn(3, 100)
    logits[0] = float("-inf")
    logits[1, 5] = float("nan")
    logits[2, :] = float("nan")
    noise = torch.ones(3, 100)
    drawn = draw(logits, noise, torch.full((3,), 0.9), torch.zeros(3))
    assert drawn[0] == 0 and drawn[2] == 0 and 0 <= drawn[1] < 100


def request(name: str, **params: object) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(**params), 0.0, 10_000)


def _at(position: int, **params: object) -> Request:
    """A request about to sample the token at `position` of its output."""
    found = request("s", **params)
    for _ in range(position):
        found.append_output(5)
    return found


BATCH = [
    dict(top_p=0.9),
    dict(top_p=0.95, temperature=0.7),
    dict(top_p=0.5, min_p=0.1),
    dict(top_p=0.8, top_k=20),
    dict(temperature=0.0),
    dict(temperature=1.3),
    dict(top_p=0.9, seed=7),
    dict(min_p=0.05),
    dict(top_p=0.99, temperature=2.0),
]


class NoHostReads:
    """Fails a test that reads a value of a tensor back on the host while it is active."""

    NAMES = ("__bool__", "item", "tolist")

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(torch.Tensor, name, self._refuse(name))

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)

    @staticmethod
    def _refuse(name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a value back on the host")

        return refuse


def test_the_sampler_with_the_kernel_chooses_as_its_torch_route_and_reads_nothing_back():
    """Over steps of a batch with every kind of row (peaked and flat logits), the kernel route
    gives the torch route's tokens (seeded rows aside: their noise differs by route); its
    sampling reads no tensor value on the host (the torch route's search does, for its
    top-p-only rows)."""
    device = torch.device(TRITON_DEVICE)
    vocab = 2000
    with_kernel = Sampler(vocab, device, seed=3, triton_kernels=True)
    in_torch = Sampler(vocab, device, seed=3, race=True)  # the kernel's race, drawn by torch
    requests = [request(f"r{i}", **params) for i, params in enumerate(BATCH)]
    generator = torch.Generator().manual_seed(11)
    chosen = []
    for step in range(6):
        spread = torch.tensor([0.02 if (row + step) % 2 else 6.0 for row in range(len(BATCH))])
        logits = (torch.randn(len(BATCH), vocab, generator=generator) * spread[:, None]).to(device)
        with NoHostReads():
            drawn = with_kernel.sample(logits.clone(), requests).token_ids
        expected = in_torch.sample(logits.clone(), requests).token_ids
        unseeded = [row for row, params in enumerate(BATCH) if "seed" not in params]
        assert drawn[unseeded].tolist() == expected[unseeded].tolist()
        chosen.append(drawn.tolist())
    assert len({tuple(tokens) for tokens in chosen}) == len(chosen)
    with pytest.raises(AssertionError, match="read a value back"), NoHostReads():
        in_torch.sample(logits.clone(), requests[:1])


def test_the_kernels_are_usable_here_and_one_that_answers_wrongly_is_turned_down(
    monkeypatch, caplog
):
    from engine.kernels.triton import sampling

    sampling.usable.cache_clear()
    assert sampling.usable(TRITON_DEVICE)
    monkeypatch.setattr(sampling, "nucleus_sample", lambda logits, *args: logits[:, 0].long())
    sampling.usable.cache_clear()
    try:
        assert not sampling.usable(TRITON_DEVICE)
    finally:
        sampling.usable.cache_clear()
    assert "Triton sampling kernels unusable" in caplog.text and "instead of [1, 0]" in caplog.text


def test_rows_with_a_top_k_read_nothing_back_on_the_torch_route():
    """A top_k bounds the candidates, so the torch route needs no answer from the device."""
    device = torch.device(TRITON_DEVICE)
    requests = [request("a", top_k=5), request("b", top_k=50, top_p=0.7), request("c")]
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2)).to(device)
    with NoHostReads():
        drawn = Sampler(500, device).sample(logits, requests).token_ids
    assert drawn.shape == (3,)


def test_seeded_noise_is_exponential_and_depends_on_the_seed_and_draw_alone():
    from engine.kernels.triton.sampling import seeded_noise

    device = torch.device(TRITON_DEVICE)
    noise = torch.zeros(4, 40_000, device=device)
    rows = torch.arange(4, device=device)
    seeded_noise(noise, rows, [7, 7, 8, -1], [0, 1, 0, 0])
    noise = noise.cpu()
    assert torch.allclose(noise.mean(dim=1), torch.ones(4), atol=0.03)
    assert torch.allclose(noise.var(dim=1), torch.ones(4), atol=0.06)
    assert bool((noise > 0).all())
    again = torch.zeros(3, 40_000, device=device)
    seeded_noise(again, torch.tensor([2, 0, 1], device=device), [7, 8, 2**64 - 1], [1, 0, 0])
    again = again.cpu()
    assert torch.equal(again[2], noise[1]) and torch.equal(again[0], noise[2])
    assert torch.equal(again[1], noise[3])  # -1 and 2**64 - 1 are one seed, as for generators
    assert not torch.equal(noise[0], noise[1])


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    device = torch.device(TRITON_DEVICE)
    vocab = 300
    values = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)).to(device)
    alone = Sampler(vocab, device, triton_kernels=True)
    # The step-th token of the request (its noise is keyed by the seed and that position).
    tokens_alone = [
        alone.sample(values.clone(), [_at(step, seed=42, top_p=0.9)]).token_ids.item()
        for step in range(12)
    ]
    busy = Sampler(vocab, device, seed=123, triton_kernels=True)
    tokens_busy = []
    for step in range(12):
        mates = [request(f"m{i}", temperature=1.5, seed=i) for i in range(step % 4)]
        batch = [*mates, _at(step, seed=42, top_p=0.9)]
        generator = torch.Generator().manual_seed(step)
        mate_logits = torch.randn(len(mates), vocab, generator=generator).to(device)
        drawn = busy.sample(torch.cat([mate_logits, values]), batch).token_ids
        tokens_busy.append(drawn[-1].item())
    assert tokens_alone == tokens_busy
    assert len(set(tokens_alone)) > 1


def test_seeded_draws_follow_the_distribution():
    """Three hundred requests with their own seeds, each drawing once from p = (0.25, 0.75)."""
    device = torch.device(TRITON_DEVICE)
    values = torch.full((300, 8), -30.0)
    values[:, 3], values[:, 4] = 0.0, float(torch.log(torch.tensor(3.0)))
    requests = [request(f"r{i}", seed=1000 + i) for i in range(300)]
    sampler = Sampler(8, device, triton_kernels=True)
    picks = sampler.sample(values.to(device), requests).token_ids.tolist()
    assert set(picks) == {3, 4}
    assert 0.65 < picks.count(4) / len(picks) < 0.85  # four standard deviations


@pytest.mark.parametrize("overlap", [False, True])
def test_an_engine_sampling_in_the_kernels_gives_the_torch_route_s_tokens(overlap):
    """Whole requests through the engine, steps in turn or overlapped: top-p rows (some with
    min-p) drawn by the kernel follow the tokens the torch route draws from the same noise (in
    the race it runs on a GPU)."""
    from tests.helpers import run_all, tiny_core, tiny_llama, tokens_of

    model = tiny_llama()
    prompts = [[5, 9, 33, 2], list(range(40, 60)), [7] * 9, [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [
        SamplingParams(top_p=0.9, max_tokens=12, ignore_eos=True),
        SamplingParams(top_p=0.5, min_p=0.05, temperature=1.3, max_tokens=12, ignore_eos=True),
        SamplingParams(top_p=0.99, temperature=2.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    tokens = []
    for kernels in (True, False):
        core, _ = tiny_core(model)
        core.runner.sampler.triton_kernels = kernels
        core.runner.sampler.race = True
        core.overlap = overlap
        outputs = run_all(core, prompts, params)
        tokens.append([tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))])
    assert tokens[0] == tokens[1]
    assert len({tuple(t) for t in tokens[0][:3]}) == 3
