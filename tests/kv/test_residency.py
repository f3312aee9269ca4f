"""How long the prefix cache keeps its blocks (`engine/kv/residency.py`, vLLM's
`--kv-cache-metrics`): what a followed block reports when it is evicted, which blocks are
followed, and the `vllm:kv_block_*` histograms a server fills from them."""

from __future__ import annotations

import random

import pytest

from engine.kv.block_manager import BlockManager
from engine.kv.residency import BlockResidency, Eviction
from tests.kv.test_prefix_cache import compute, request_with
from tests.kv.traffic import arrive
from tests.server_utils import app_client


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def followed_manager(num_blocks: int, clock: Clock) -> BlockManager:
    manager = BlockManager(num_blocks, 4, enable_caching=True)
    manager.residency = BlockResidency(1.0, clock=clock)
    return manager


def test_an_evicted_block_reports_its_lifetime_idle_time_and_last_gaps():
    clock = Clock()
    residency = BlockResidency(1.0, clock=clock)
    residency.taken(7)
    for clock.now in (2.0, 5.0, 9.0, 10.0, 20.0):
        residency.hit(7)
    clock.now = 30.0
    residency.evicted(7)
    # The last four hits are remembered: three gaps.
    assert residency.take() == [Eviction(30.0, 10.0, (4.0, 1.0, 10.0))]
    assert residency.take() == []
    residency.taken(3)
    clock.now = 31.5
    residency.evicted(3)  # never hit: idle since taken, no gaps
    assert residency.take() == [Eviction(1.5, 1.5, ())]


def test_a_block_that_leaves_without_an_eviction_reports_nothing():
    residency = BlockResidency(1.0, clock=Clock())
    residency.taken(1)
    residency.dropped(1)
    residency.evicted(1)
    residency.evicted(2)  # never followed
    assert residency.take() == [] and residency.num_followed == 0


def test_a_share_of_the_blocks_is_followed_and_a_block_taken_again_starts_afresh():
    residency = BlockResidency(0.25, rng=random.Random(5), clock=Clock())
    for block in range(4000):
        residency.taken(block)
    assert 850 < residency.num_followed < 1150
    followed = residency.num_followed
    for block in range(4000):  # taken again: each drawn anew, no record left over
        residency.taken(block)
    assert residency.num_followed != followed and residency.num_followed < 1150


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5])
def test_a_share_outside_zero_to_one_is_refused(rate):
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        BlockResidency(rate)


def test_the_block_manager_reports_what_its_cache_evicts():
    clock = Clock()
    manager = followed_manager(4, clock)
    old = request_with(list(range(10, 18)), "old")  # two full blocks, cached
    compute(manager, old)
    manager.free(old)
    clock.now = 3.0
    again = request_with([*range(10, 18), 5], "again")  # finds both
    manager.claim_cached_prefix(again)
    assert again.num_computed_tokens == 8
    clock.now = 4.0
    manager.free(again)
    uncached = request_with([1, 2], "uncached")  # a partial block, never cached
    assert manager.allocate(uncached, 2)
    manager.free(uncached)
    assert manager.residency is not None and manager.residency.take() == []
    clock.now = 10.0
    filler = request_with(list(range(50, 66)), "filler")  # needs all four: evicts both
    assert manager.allocate(filler, 16)
    assert manager.residency.take() == [Eviction(10.0, 7.0, ()), Eviction(10.0, 7.0, ())]
    manager.check_invariants()


def test_a_cache_reset_forgets_without_reporting_and_traffic_keeps_the_books():
    clock = Clock()
    manager = followed_manager(24, clock)
    residency = manager.residency
    assert residency is not None
    request = request_with(list(range(10, 18)))
    compute(manager, request)
    manager.free(request)
    assert manager.reset_cache() == 2
    assert residency.take() == [] and residency.num_followed == 0
    rng = random.Random(3)
    prefixes = [[rng.randrange(100) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    live = []
    reported = 0
    for i in range(400):
        clock.now = float(i)
        if live and rng.random() < 0.45:
            manager.free(live.pop(rng.randrange(len(live))))
        elif (arrived := arrive(manager, rng, prefixes, str(i), 100)) is not None:
            live.append(arrived)
        for eviction in residency.take():
            assert 0 <= eviction.idle <= eviction.lifetime
            assert all(gap >= 0 for gap in eviction.reuse_gaps) and len(eviction.reuse_gaps) <= 3
            reported += 1
        # Followed blocks are exactly the held and the cached ones: none leaks.
        assert residency.num_followed == manager.num_blocks - len(manager._free)
    assert reported > 0


async def test_a_server_fills_vllms_residency_histograms_when_asked():
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    prompts = [[i + 40] * 12 for i in range(6)]  # each fills 3 blocks of 4; 12 blocks in all
    options = {"num_blocks": 12, "enable_prefix_caching": True, "kv_cache_metrics_sample": 1.0}
    async with app_client(**options) as (client, _):
        for prompt in [*prompts, prompts[-1]]:
            response = await client.post("/v1/completions", json={**body, "prompt": prompt})
            assert response.status_code == 200, response.text
        metrics = (await client.get("/metrics")).text
    counts = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:kv_block_") and "_count{" in line
    }
    evicted = counts["vllm:kv_block_lifetime_seconds_count"]
    assert evicted > 0 and counts["vllm:kv_block_idle_before_evict_seconds_count"] == evicted
    assert "vllm:kv_block_reuse_gap_seconds_count" in counts
    async with app_client(num_blocks=12, enable_prefix_caching=True) as (client, _):
        assert "vllm:kv_block_" not in (await client.get("/metrics")).text


def test_vllms_flags_turn_the_residency_on_at_their_share(capsys):
    from server.cli import build_parser, engine_config

    def sample(*argv: str) -> float | None:
        return engine_config(build_parser().parse_args(["serve", *argv])).kv_cache_metrics_sample

    assert sample() is None
    assert sample("--kv-cache-metrics") == 0.01
    assert sample("--kv-cache-metrics", "--kv-cache-metrics-sample", "0.5") == 0.5
    assert sample("--no-kv-cache-metrics", "--kv-cache-metrics-sample", "0.5") is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-metrics-sample", "2"])
    assert "a share in (0, 1]" in capsys.readouterr().err
