"""The prefix cache's events (`engine/kv/events.py`): what the block manager records when it
stores, evicts and forgets blocks, and that a router mirroring the events knows exactly the
blocks the cache holds."""

from __future__ import annotations

import random

import pytest

from engine.core.request import Request
from engine.kv.block_manager import BlockManager
from engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    KVEvent,
    KVEventsConfig,
    external_hash,
    rank_endpoint,
)
from engine.lora.registry import LoRARequest
from tests.kv.traffic import arrive, request_with


def recording(num_blocks: int = 16, block_size: int = 4) -> BlockManager:
    manager = BlockManager(num_blocks, block_size, enable_caching=True)
    manager.events = EventLog()
    return manager


def compute(manager: BlockManager, request: Request) -> None:
    manager.claim(request, manager.cached_prefix(request))
    assert manager.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


class Mirror:
    """What a router that reads the events knows: the hashes cached, each block's tokens, and
    its parent's hash."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, events: list[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_hash
                size = event.block_size
                assert len(event.token_ids) == size * len(event.block_hashes)
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * size : (i + 1) * size])
                    self.blocks[block_hash] = (parent, tokens)
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    del self.blocks[block_hash]  # a removal names a block stored before
            else:
                self.blocks.clear()

    def prefix(self, block_hash: int) -> list[int]:
        """The whole token prefix a block ends, read back through its parents."""
        chain: list[int] = []
        current: int | None = block_hash
        while current is not None:
            parent, tokens = self.blocks[current]
            chain[:0] = tokens
            current = parent
        return chain


def test_nothing_is_recorded_unless_asked():
    manager = BlockManager(16, 4, enable_caching=True)
    compute(manager, request_with(list(range(10, 20))))
    assert manager.events is None


def test_published_blocks_are_one_event_with_their_tokens_and_chained_hashes():
    manager = recording()
    request = request_with(list(range(10, 21)), "a")  # two full blocks and 3 tokens
    compute(manager, request)
    events = manager.events.take()
    assert events == [
        BlockStored(
            [external_hash(h) for h in request.block_hashes[:2]],
            None,
            list(range(10, 18)),
            4,
        )
    ]
    assert manager.events.take() == []
    # The sequence grows by a block: its event names the block before as its parent.
    request.append_output(5)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    (grown,) = manager.events.take()
    assert isinstance(grown, BlockStored)
    assert grown.parent_hash == external_hash(request.block_hashes[1])
    assert grown.token_ids == [18, 19, 20, 5]


def test_a_block_whose_content_is_cached_already_is_not_stored_again():
    manager = recording()
    compute(manager, request_with(list(range(10, 19)), "a"))
    manager.events.take()
    # The same prompt computed again by a request that did not look for it in the cache
    # (its blocks stay private): no event.
    twin = request_with(list(range(10, 19)), "b")
    assert manager.allocate(twin, twin.num_tokens)
    twin.num_computed_tokens = twin.num_tokens
    manager.cache_full_blocks(twin)
    assert manager.events.take() == []


def test_an_adapters_blocks_carry_its_id_and_name():
    adapter = LoRARequest("sql", 3, "/adapters/sql")
    manager = recording()
    compute(manager, request_with(list(range(10, 15)), "a", lora=adapter))
    (event,) = manager.events.take()
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name) == (3, "sql")


def test_evicted_blocks_are_removed_in_one_event_per_run():
    manager = recording(num_blocks=4)
    old = request_with(list(range(10, 19)), "old")  # 3 blocks, 2 of them full
    compute(manager, old)
    manager.free(old)
    stored = manager.events.take()
    assert len(stored) == 1
    new = request_with(list(range(40, 56)), "new")  # needs all 4 blocks: evicts both
    assert manager.allocate(new, new.num_tokens)
    assert manager.events.take() == [BlockRemoved(stored[0].block_hashes[::-1])]


def test_a_reset_that_empties_the_cache_is_one_clear_and_one_that_cannot_names_blocks():
    manager = recording()
    kept = request_with(list(range(10, 19)), "kept")
    gone = request_with(list(range(50, 59)), "gone")
    compute(manager, kept)
    compute(manager, gone)
    manager.free(gone)
    stored = manager.events.take()
    assert manager.reset_cache() == 2  # `kept` still holds its blocks
    assert manager.events.take() == [BlockRemoved(stored[1].block_hashes[::-1])]
    manager.free(kept)
    assert manager.reset_cache() == 2
    assert manager.events.take() == [AllBlocksCleared()]
    assert manager.reset_cache() == 0
    assert manager.events.take() == []


def test_a_mirror_of_the_events_holds_exactly_the_cached_blocks_under_random_traffic():
    rng = random.Random(5)
    manager = recording(num_blocks=24)
    mirror = Mirror()
    prefixes = [[rng.randrange(300) for _ in range(rng.randint(4, 20))] for _ in range(5)]
    live: list[Request] = []
    for i in range(500):
        roll = rng.random()
        if roll < 0.02:
            manager.reset_cache()
        elif live and roll < 0.45:
            manager.free(live.pop(rng.randrange(len(live))))
        elif (request := arrive(manager, rng, prefixes, str(i), 300)) is not None:
            live.append(request)
        mirror.apply(manager.events.take())
        cached = {external_hash(h): h for h in manager._by_hash}
        assert set(mirror.blocks) == set(cached)
    # Every block the router knows, read back through its parents, is the prompt prefix the
    # cache keys it by.
    for request in live:
        for index, block_hash in enumerate(request.block_hashes):
            if external_hash(block_hash) in mirror.blocks:
                end = (index + 1) * 4
                assert mirror.prefix(external_hash(block_hash)) == request.all_token_ids[:end]


def test_the_config_reads_vllms_fields_and_refuses_others():
    config = KVEventsConfig.of(
        {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "topic": "kv@pod@m"}
    )
    assert config.publishes and config.endpoint == "tcp://*:6000"
    assert not KVEventsConfig.of({"enable_kv_cache_events": True, "publisher": "null"}).publishes
    assert not KVEventsConfig.of({}).publishes
    for fields, message in [
        ({"enable": True}, "unknown KV events config fields: enable"),
        ({"publisher": "nats"}, "unknown KV events publisher"),
        ({"buffer_steps": 0}, "buffer_steps must be at least 1"),
        ({"hwm": True}, "hwm must be an integer"),
        ({"endpoint": "localhost:5557"}, "not a ZeroMQ address"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be bool"),
    ]:
        with pytest.raises(ValueError, match=message):
            KVEventsConfig.of(fields)


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://[::1]:6000", 1, "tcp://[::1]:6001"),
        ("tcp://127.0.0.1:*", 3, "tcp://127.0.0.1:*"),  # a port picked when bound
        ("ipc:///tmp/kv", 1, "ipc:///tmp/kv_dp1"),
        ("inproc://cache", 2, "inproc://cache_dp2"),
    ],
)
def test_each_data_parallel_rank_publishes_on_its_own_endpoint(endpoint, rank, expected):
    """vLLM's ranks add their rank to the configured ports, so one config serves a fleet."""
    assert rank_endpoint(endpoint, rank) == expected
    config = KVEventsConfig(endpoint=endpoint, replay_endpoint=endpoint).for_rank(rank)
    assert (config.endpoint, config.replay_endpoint) == (expected, expected)
    assert KVEventsConfig(endpoint=endpoint).for_rank(rank).replay_endpoint is None
    with pytest.raises(ValueError, match="no port for rank 1"):
        rank_endpoint("tcp://*:65535", 1)
