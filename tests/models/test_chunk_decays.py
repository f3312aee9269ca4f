"""The decays between a chunk's positions, as the chunked prompt scans read them."""

from __future__ import annotations

import torch

from engine.models.chunk_decays import LEAST_LOG_DECAY, pairwise


def test_each_later_position_takes_the_decay_since_each_earlier_one_and_none_from_after():
    decays = (-torch.rand(3, 16)).cumsum(-1)
    got = pairwise(decays)
    i, j = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    want = torch.where(j <= i, (decays[:, :, None] - decays[:, None, :]).exp(), 0.0)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[:, j > i], torch.zeros_like(got[:, j > i]))
    assert torch.equal(got.diagonal(dim1=-2, dim2=-1), torch.ones(3, 16))


def test_decays_steeper_than_the_bound_are_taken_at_the_bound():
    decays = torch.tensor([0.0, -50.0, -500.0, -5000.0])
    got = pairwise(decays)
    least = torch.tensor(LEAST_LOG_DECAY).exp()
    assert got[1, 0] == torch.tensor(-50.0).exp()
    assert got[2, 0] == least and got[3, 1] == least and got[3, 2] == least
    assert torch.isfinite(got).all() and got.triu(1).eq(0).all()
