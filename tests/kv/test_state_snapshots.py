"""The bookkeeping of the snapshots of recurrent states that prefix caching resumes from: rows
reused least recently used first, known by a hash only once the step that filled them completed,
and a reservation that was overtaken never committed."""

from __future__ import annotations

import pytest
import torch

from engine.kv.state_cache import StateCache
from engine.kv.state_snapshots import StateSnapshots


def test_a_row_is_known_by_its_hash_only_once_committed():
    snapshots = StateSnapshots(2, 8)
    row, generation = snapshots.reserve()
    assert snapshots.find(b"a") is None and not snapshots.kept(b"a")
    snapshots.commit(row, generation, b"a")
    assert snapshots.find(b"a") == row and snapshots.num_kept == 1
    snapshots.check_invariants()


def test_rows_are_reused_least_recently_used_first():
    snapshots = StateSnapshots(2, 8)
    for name in (b"a", b"b"):
        snapshots.commit(*snapshots.reserve(), name)
    assert snapshots.find(b"a") is not None  # now b is the least recently used
    row, generation = snapshots.reserve()
    assert snapshots.find(b"b") is None and snapshots.find(b"a") is not None
    snapshots.commit(row, generation, b"c")
    assert snapshots.num_kept == 2
    snapshots.check_invariants()


def test_a_reservation_overtaken_before_its_commit_is_dropped():
    """Two reservations of one row before the first commits (one row, two saves in a step): the
    row holds the second's states, so only the second may name it."""
    snapshots = StateSnapshots(1, 8)
    first = snapshots.reserve()
    second = snapshots.reserve()
    assert first[0] == second[0] and first[1] != second[1]
    snapshots.commit(*first, b"a")
    assert snapshots.find(b"a") is None
    snapshots.commit(*second, b"b")
    assert snapshots.find(b"b") == second[0]


def test_states_kept_already_are_not_named_twice_and_clear_forgets_all():
    snapshots = StateSnapshots(3, 8)
    snapshots.commit(*snapshots.reserve(), b"a")
    snapshots.commit(*snapshots.reserve(), b"a")
    assert snapshots.num_kept == 1
    assert snapshots.clear() == 1 and snapshots.find(b"a") is None
    snapshots.check_invariants()
    with pytest.raises(ValueError, match="positive"):
        StateSnapshots(0, 8)


def test_the_state_cache_saves_and_restores_every_layers_rows():
    states = StateCache([((2, 3), None), ((4,), torch.float32)], 3, torch.bfloat16, "cpu", 2)
    assert [tuple(t.shape) for t in states.snapshots] == [(2, 2, 3), (2, 4)]
    for layer in states.layers:
        layer.copy_(torch.randn(layer.shape))
    states.save([(2, 1)])
    assert all(
        torch.equal(kept[1], layer[2])
        for kept, layer in zip(states.snapshots, states.layers, strict=True)
    )
    states.restore([(1, 0)])
    assert all(torch.equal(layer[0], layer[2]) for layer in states.layers)
    assert states.num_bytes == 3 * (6 * 2 + 4 * 4) + 2 * (6 * 2 + 4 * 4)
