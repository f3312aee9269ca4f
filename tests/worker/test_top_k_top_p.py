"""Which tokens top-k and top-p keep (`engine/worker/top_k_top_p.py`), against references
that sort the whole vocabulary."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.worker import top_k_top_p as module
from engine.worker.sampler import Sampler, position_key
from engine.worker.top_k_top_p import top_k_top_p
from tests.helpers import reference_draw, reference_kept, reference_nucleus


def kept_tokens(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


class CountedTopk:
    """Records the width of every `Tensor.topk` while it is active."""

    def __init__(self) -> None:
        self.widths: list[int] = []
        self._original = torch.Tensor.topk

    def __enter__(self) -> CountedTopk:
        original = self._original

        def counted(tensor, k, *args, **kwargs):
            self.widths.append(k)
            return original(tensor, k, *args, **kwargs)

        torch.Tensor.topk = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.topk = self._original  # type: ignore[method-assign]


def test_top_k_sorts_only_the_batch_s_largest_k_and_keeps_the_same_tokens():
    """With every row's top_k below the vocabulary the candidates come from `topk`; the kept
    set is the full sort's (random logits have no ties)."""
    values = torch.randn(6, 50, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(top_k=k, top_p=p)
        for k, p in [(1, 1.0), (5, 1.0), (10, 0.5), (3, 0.9), (20, 0.99), (7, 0.2)]
    ]
    with CountedTopk() as counted:
        fast = top_k_top_p(values.clone(), params)
    assert counted.widths == [20]
    for row, p in enumerate(params):
        order = values[row].argsort(descending=True)
        probs = values[row, order[: p.top_k]].softmax(-1)
        before = probs.cumsum(-1) - probs
        keep = order[: p.top_k][(before < p.top_p) | (torch.arange(p.top_k) == 0)]
        assert kept_tokens(fast[row]) == set(keep.tolist())
        assert torch.equal(fast[row, keep], values[row, keep])


def test_a_flat_row_s_nucleus_is_found_without_sorting_the_vocabulary():
    """A peaked row's nucleus lies among the first candidates; a flat row's reaches far past
    them, and is found by its histogram, sorting no more than a bucket: both keep what a sort
    of the whole vocabulary keeps, and a row with neither top_k nor top_p keeps every logit."""
    vocab = 20_000
    values = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    values[0] *= 12  # peaked: a nucleus of a few tokens
    values[1] *= 0.05  # flat: a nucleus of most of the vocabulary
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9), SamplingParams()]
    with CountedTopk() as counted:
        kept = top_k_top_p(values.clone(), params)
    assert counted.widths[0] == module.NUCLEUS_FIRST_WIDTH
    assert len(counted.widths) == 2 and counted.widths[1] < vocab // 20
    for row in (0, 1):
        assert kept_tokens(kept[row]) == reference_nucleus(values[row], 0.9)
        finite = torch.isfinite(kept[row])
        assert torch.equal(kept[row, finite], values[row, finite])
    assert len(reference_nucleus(values[0], 0.9)) < 50
    assert len(reference_nucleus(values[1], 0.9)) > 10_000
    assert torch.equal(kept[2], values[2])


@pytest.mark.parametrize("seed", range(4))
def test_tokens_tied_at_the_edge_stay_together_peaked_or_flat(seed):
    """Logits rounded to bf16 (ties everywhere, as a bf16 model's): each row keeps exactly
    the tokens whose mass strictly above is below its top_p, whether its nucleus lies among
    the first candidates or is cut from its histogram."""
    generator = torch.Generator().manual_seed(seed)
    vocab, rows = 8000, 24
    spread = torch.tensor([[[8.0, 2.0, 0.5, 0.03][row % 4]] for row in range(rows)])
    values = (torch.randn(rows, vocab, generator=generator) * spread).bfloat16().float()
    top_ps = [[0.1, 0.5, 0.9, 0.95, 0.99, 0.999][row % 6] for row in range(rows)]
    kept = top_k_top_p(values.clone(), [SamplingParams(top_p=p) for p in top_ps])
    for row, top_p in enumerate(top_ps):
        assert kept_tokens(kept[row]) == reference_nucleus(values[row], top_p), row


@pytest.mark.parametrize("seed", range(3))
def test_a_top_k_keeps_every_tie_of_its_k_th_largest(seed):
    """bf16-rounded logits: a row's top-k keeps every token at least its k-th largest logit
    (as vLLM), and its nucleus is taken over those; rows with a top_k alone, with a top_p too,
    and with a top_p alone share the batch."""
    generator = torch.Generator().manual_seed(seed)
    vocab, rows = 3000, 12
    spread = torch.tensor([[[4.0, 0.5, 0.05][row % 3]] for row in range(rows)])
    values = (torch.randn(rows, vocab, generator=generator) * spread).bfloat16().float()
    settings = [(k, p) for k in (0, 1, 7, 300) for p in (1.0, 0.6, 0.95)]
    settings = [(k, p) if (k, p) != (0, 1.0) else (0, 0.3) for k, p in settings]
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings]
    kept = top_k_top_p(values.clone(), params)
    ties = 0
    for row, (k, p) in enumerate(settings):
        assert kept_tokens(kept[row]) == reference_kept(values[row], k, p), (row, k, p)
        if 0 < k < vocab:
            kth = values[row].sort(descending=True).values[k - 1]
            ties += int((values[row] == kth).sum()) > 1
    assert ties >= 3  # some k-th largest logits are tied


def test_a_top_k_whose_ties_run_past_the_candidates_keeps_them_all():
    """k = 3 over a row whose second to tenth largest logits are equal: all ten stay, and the
    nucleus over them counts the mass of all ten."""
    values = torch.full((2, 1000), -5.0)
    values[:, 40] = 3.0
    values[:, 100:109] = 2.0
    kept = top_k_top_p(
        values.clone(), [SamplingParams(top_k=3), SamplingParams(top_k=3, top_p=0.5)]
    )
    assert kept_tokens(kept[0]) == {40, *range(100, 109)}
    # 3.0 holds e / (e + 9) of the ten's mass, about 0.23: the nucleus needs the tied 2.0s.
    assert kept_tokens(kept[1]) == {40, *range(100, 109)}
    one = top_k_top_p(values[:1].clone(), [SamplingParams(top_k=3, top_p=0.2)])
    assert kept_tokens(one[0]) == {40}


def test_a_run_of_ties_across_the_candidates_edge_is_kept_whole():
    """The nucleus ends inside a run of 300 equal logits that crosses the 256th candidate:
    all 300 stay, with the 150 above them."""
    values = torch.full((1, 5000), -10.0)
    values[0, :150] = 5.0
    values[0, 1000:1300] = 3.0
    top = 150 * torch.tensor(5.0).exp()
    middle = 300 * torch.tensor(3.0).exp()
    top_p = float((top + middle / 2) / (top + middle + 4550 * torch.tensor(-10.0).exp()))
    kept = top_k_top_p(values.clone(), [SamplingParams(top_p=top_p)])
    assert kept_tokens(kept[0]) == set(range(150)) | set(range(1000, 1300))


def test_rows_with_few_or_no_finite_logits_keep_what_they_have():
    """A format or bad words leave a flat row a few tokens, or none: the search keeps the
    ones it has (every one where top_p needs them) and a row of none stays all -inf."""
    vocab = 4000
    values = torch.full((3, vocab), float("-inf"))
    values[0, 7:3007:10] = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 0.01
    values[1, [3, 9, 27]] = torch.tensor([1.0, 1.0, 1.0])
    kept = top_k_top_p(values.clone(), [SamplingParams(top_p=0.999)] * 3)
    assert kept_tokens(kept[0]) == reference_nucleus(values[0], 0.999)
    assert len(kept_tokens(kept[0])) > 256
    assert kept_tokens(kept[1]) == {3, 9, 27}
    assert kept_tokens(kept[2]) == set()


def test_a_flat_row_is_drawn_from_its_nucleus_in_token_order():
    """Seeded flat rows, their nucleus past the first candidates: each draws the token its
    uniform picks from the running sum, in token order, of the reference nucleus'
    renormalised probabilities (in double)."""
    vocab, rows = 1500, 24
    values = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 0.3
    requests = [
        Request(f"r{row}", [1], SamplingParams(top_p=0.8, seed=row), 0.0, 100)
        for row in range(rows)
    ]
    drawn = Sampler(vocab, torch.device("cpu")).sample(values.clone(), requests).token_ids
    for row in range(rows):
        assert len(reference_nucleus(values[row], 0.8)) > module.NUCLEUS_FIRST_WIDTH
        generator = torch.Generator().manual_seed(position_key(row, 0))
        uniform = float(torch.rand(1, generator=generator))
        assert int(drawn[row]) == reference_draw(values[row], 0, 0.8, 0.0, uniform), row
