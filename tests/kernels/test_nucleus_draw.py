"""Conveyor's CPU nucleus draw (`csrc/elementwise/nucleus_draw.cpp`) against a reference in
double that sorts each row, and where the sampler uses it."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import ops as cpu_ops
from engine.worker import sampler as sampler_module
from engine.worker.sampler import Sampler
from tests.helpers import needs_cpu_kernels, reference_draw, reference_kept

pytestmark = needs_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.has("elementwise"), "the C++ kernels must build on the test machine"


def draw(
    x: torch.Tensor, top_p: list[float], min_p: list[float], u: list[float], top_k=None
) -> list[int]:
    """The kernel's tokens; `top_k` None or 0 in a row for none."""
    vocab = x.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in (top_k or [0] * x.shape[0])]
    return cpu_ops.nucleus_draw(
        x, torch.tensor(ks), torch.tensor(top_p), torch.tensor(min_p), torch.tensor(u)
    ).tolist()


@pytest.mark.parametrize("vocab", [1, 7, 64, 1003, 8000])
def test_draws_what_a_sort_of_the_row_draws(vocab):
    """Peaked, spread and flat rows, some rounded to bf16 (ties at the k-th largest and at the
    nucleus' edge), some with tokens ruled out, top_k from none to 40, top_p from 0.1 to 1 and
    some min_p: each row's token is the one the same uniform draws from the sorted
    reference."""
    generator = torch.Generator().manual_seed(vocab)
    rows = 96
    spread = torch.tensor([[[8.0, 2.0, 0.5, 0.03][row % 4]] for row in range(rows)])
    x = torch.randn(rows, vocab, generator=generator) * spread
    x[1::3] = x[1::3].bfloat16().float()
    x[2::5, ::7] = float("-inf")
    x[2::5, -1] = 0.0  # no row all -inf
    top_p = [[0.1, 0.5, 0.9, 0.95, 0.999, 1.0][row % 6] for row in range(rows)]
    min_p = [[0.0, 0.0, 0.05][row % 3] for row in range(rows)]
    top_k = [[0, 0, 0, 1, 5, 40, 0][row % 7] for row in range(rows)]
    u = torch.rand(rows, generator=generator).tolist()
    expected = [reference_draw(x[r], top_k[r], top_p[r], min_p[r], u[r]) for r in range(rows)]
    assert draw(x, top_p, min_p, u, top_k) == expected


def test_follows_the_nucleus_distribution():
    """Twenty thousand draws of one flat 60-token row at top_p 0.8: only nucleus tokens, each
    within four standard deviations of its renormalised probability."""
    generator = torch.Generator().manual_seed(3)
    row = torch.randn(60, generator=generator) * 0.7
    rows = 20_000
    x = row.expand(rows, 60).contiguous()
    u = torch.rand(rows, generator=generator).tolist()
    counts = torch.bincount(torch.tensor(draw(x, [0.8] * rows, [0.0] * rows, u)), minlength=60)
    nucleus = sorted(reference_kept(row, 0, 0.8))
    probs = torch.zeros(60, dtype=torch.float64)
    probs[nucleus] = torch.softmax(row[nucleus].double(), dim=0)
    assert set(counts.nonzero().flatten().tolist()) == set(nucleus)
    spread = (probs * (1 - probs) / rows).sqrt()
    assert ((counts / rows - probs).abs() <= 4 * spread + 1e-9).all()


def test_rows_with_no_choice_or_no_number():
    """A row of one allowed token always draws it; at a uniform of 0 a row draws its first
    kept token, just below 1 its last; a row of -inf gets its last token, a row with a NaN its
    first NaN, a row with +inf its first +inf."""
    x = torch.full((7, 20), float("-inf"))
    x[0:3, 13] = 1.5
    x[3, [2, 5, 9]] = torch.tensor([1.0, 2.0, 1.0])
    x[4, [2, 5, 9]] = torch.tensor([1.0, 2.0, 1.0])
    x[5] = 0.0
    x[5, [4, 11]] = float("nan")
    x[6] = 0.0
    x[6, [8, 12]] = float("inf")
    below_one = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    u = [0.0, 0.5, below_one, 0.0, below_one, 0.5, 0.5]
    assert draw(x, [0.9] * 7, [0.0] * 7, u) == [13, 13, 13, 2, 9, 4, 8]
    assert draw(torch.full((1, 20), float("-inf")), [0.9], [0.0], [0.5]) == [19]


def test_refuses_bad_inputs():
    params, ks = torch.ones(2), torch.tensor([8, 8])
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_ops.nucleus_draw(torch.randn(2, 8).double(), ks, params, params * 0, params / 2)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.nucleus_draw(torch.randn(8, 2).t(), ks, params, params * 0, params / 2)
    with pytest.raises(RuntimeError, match=r"\[rows\]"):
        cpu_ops.nucleus_draw(torch.randn(2, 8), ks, torch.ones(3), params * 0, params / 2)
    with pytest.raises(RuntimeError, match=r"top_k must be in \[1, vocab\]"):
        cpu_ops.nucleus_draw(torch.randn(2, 8), torch.tensor([0, 8]), params, params * 0, params)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_ops.nucleus_draw(torch.randn(2, 8), ks.int(), params, params * 0, params / 2)


def requests_of(kinds: list[dict]) -> list[Request]:
    return [
        Request(
            f"r{row}", [1], SamplingParams(**{"temperature": 0.8, "seed": row, **kind}), 0.0, 100
        )
        for row, kind in enumerate(kinds)
    ]


def test_the_sampler_draws_every_random_row_with_it_and_agrees_with_torch(monkeypatch):
    """On the CPU the kernel draws every random row (top-k, top-p, min-p or the whole
    vocabulary), greedy rows aside. Without the kernel, torch's route draws the same seeded
    tokens (over a small vocabulary: the two round apart, so a uniform within rounding of a
    token's edge in the running sum, rare as each token adds one such edge, could split them)."""
    kinds = [dict(top_p=0.9), dict(top_k=20), dict(), dict(top_p=0.95, min_p=0.1)] * 8
    kinds += [dict(top_k=50, top_p=0.8), dict(temperature=0.0)] * 4
    rows = len(kinds)
    generator = torch.Generator().manual_seed(5)
    spread = torch.tensor([[6.0 if row % 3 else 0.05] for row in range(rows)])
    values = (torch.randn(rows, 300, generator=generator) * spread).bfloat16().float()
    requests = requests_of(kinds)
    drawn_rows: list[int] = []
    real = cpu_ops.nucleus_draw

    def spied(x, *args):
        drawn_rows.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(cpu_ops, "nucleus_draw", spied)
    with_kernel = Sampler(300, torch.device("cpu")).sample(values.clone(), requests).token_ids
    assert drawn_rows == [rows - 4]
    torch_route = sampler_module._whole_vocabulary_choice
    monkeypatch.setattr(sampler_module, "_nucleus_kernel_choice", torch_route)
    in_torch = Sampler(300, torch.device("cpu")).sample(values.clone(), requests).token_ids
    assert drawn_rows == [rows - 4]
    assert with_kernel.tolist() == in_torch.tolist()
