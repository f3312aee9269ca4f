from __future__ import annotations

import pytest

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kv.block_manager import BlockManager


def make_request(request_id: str = "r", prompt_len: int = 4) -> Request:
    return Request(
        request_id, list(range(prompt_len)), SamplingParams(), 0.0, max_total_tokens=1_000
    )


def test_allocate_grows_block_by_block_and_free_returns_everything():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request()
    assert manager.allocate(request, 4)
    assert len(request.block_ids) == 1
    assert manager.allocate(request, 5)
    assert len(request.block_ids) == 2
    assert manager.allocate(request, 8)  # still fits in two blocks
    assert len(request.block_ids) == 2
    assert manager.num_used_blocks == 2 and manager.num_free_blocks == 6
    manager.free(request)
    assert request.block_ids == []
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_allocation_is_all_or_nothing():
    manager = BlockManager(num_blocks=3, block_size=2)
    first, second = make_request("a"), make_request("b")
    assert manager.allocate(first, 4)
    assert not manager.allocate(second, 4)  # needs 2 blocks, 1 free
    assert second.block_ids == []
    assert manager.num_free_blocks == 1
    manager.check_invariants()


def test_blocks_are_reference_counted_and_never_shared_by_accident():
    manager = BlockManager(num_blocks=6, block_size=2)
    requests = [make_request(str(i)) for i in range(3)]
    for request in requests:
        assert manager.allocate(request, 4)
    held = [b for r in requests for b in r.block_ids]
    assert len(set(held)) == len(held) == 6
    assert all(manager.ref_count(b) == 1 for b in held)
    manager.free(requests[1])
    assert manager.num_free_blocks == 2
    assert manager.allocate(make_request("new"), 3)
    manager.check_invariants()


def test_free_plus_used_is_total_through_random_traffic():
    import random

    rng = random.Random(7)
    manager = BlockManager(num_blocks=32, block_size=4)
    live: list[Request] = []
    for step in range(500):
        if live and rng.random() < 0.4:
            manager.free(live.pop(rng.randrange(len(live))))
        else:
            request = make_request(str(step))
            if manager.allocate(request, rng.randint(1, 40)):
                live.append(request)
        manager.check_invariants()
        assert manager.num_used_blocks == sum(len(r.block_ids) for r in live)


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
