"""Automatic prefix caching and block sharing, on plain data and on a tiny model."""

from __future__ import annotations

import random

import pytest

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kv.block_hash import ROOT_HASH, extend_block_hashes, hash_block
from engine.kv.block_manager import BlockManager
from tests.helpers import run_all, tiny_core, tokens_of
from tests.kv.traffic import arrive
from tests.scheduler_utils import create_request, create_scheduler, drain, scheduled_counts, step


def request_with(tokens: list[int], name: str = "r") -> Request:
    return Request(
        name, list(tokens), SamplingParams(max_tokens=4), 0.0, 10_000, eos_token_ids=frozenset({0})
    )


def compute(manager: BlockManager, request: Request) -> None:
    """Pretend the whole prompt was computed and publish its full blocks."""
    assert manager.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


# ---- hashing and the block manager ---------------------------------------------------------


def test_block_hashes_chain_the_whole_prefix():
    a, b = [], []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    extend_block_hashes(b, [9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 2, different prefix
    assert a[0] == hash_block(ROOT_HASH, [1, 2, 3, 4])
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, num_tokens=11)
    assert len(a) == 2  # the third block is not full within 11 tokens


def test_an_image_keys_the_block_it_starts_in_and_every_block_after():
    tokens = [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 7, 8]  # an image's placeholders at 4..9
    plain, cat, dog, cat_again = [], [], [], []
    extend_block_hashes(plain, tokens, 4)
    extend_block_hashes(cat, tokens, 4, extras=[(4, b"cat")])
    extend_block_hashes(dog, tokens, 4, extras=[(4, b"dog")])
    extend_block_hashes(cat_again, tokens, 4, extras=[(4, b"cat")])
    assert plain[0] == cat[0] == dog[0]  # the text before the image is shared
    assert all(c != d and c != p for c, d, p in zip(cat[1:], dog[1:], plain[1:], strict=True))
    assert cat == cat_again


def test_cached_blocks_are_found_and_shared_by_reference():
    manager = BlockManager(16, 4, enable_caching=True)
    first = request_with(list(range(10, 20)), "a")  # 2 full blocks + 2 tokens
    compute(manager, first)
    second = request_with([*range(10, 18), 99, 98, 97], "b")
    hits = manager.cached_prefix(second)
    assert hits == first.block_ids[:2]
    manager.claim(second, hits)
    assert all(manager.ref_count(b) == 2 for b in hits)
    manager.check_invariants()


def test_the_last_prompt_token_is_always_computed():
    manager = BlockManager(16, 4, enable_caching=True)
    first = request_with(list(range(10, 18)), "a")  # exactly 2 blocks
    compute(manager, first)
    same = request_with(list(range(10, 18)), "b")
    assert len(manager.cached_prefix(same)) == 1  # the second block holds the last token


def test_unheld_cached_blocks_wait_on_an_lru_list_and_are_evicted_only_when_needed():
    manager = BlockManager(6, 4, enable_caching=True)
    old = request_with(list(range(10, 18)), "old")
    new = request_with(list(range(30, 38)), "new")
    compute(manager, old)
    compute(manager, new)
    manager.free(old)
    manager.free(new)
    assert manager.num_cached_blocks == 4 and manager.num_free_blocks == 6
    manager.check_invariants()
    filler = request_with(list(range(50, 58)), "filler")
    assert manager.allocate(filler, 8)  # two never-used blocks: nothing evicted
    assert manager.num_cached_blocks == 4
    more = request_with(list(range(60, 68)), "more")
    assert manager.allocate(more, 8)  # now the least recently freed go: "old"'s
    assert manager.cached_prefix(request_with(list(range(10, 19)))) == []
    assert len(manager.cached_prefix(request_with(list(range(30, 39))))) == 2
    manager.check_invariants()


def test_fork_shares_blocks_and_a_write_copies_the_shared_block():
    manager = BlockManager(8, 4)
    parent = request_with(list(range(10, 16)), "p")  # 1 full block + 2 tokens
    assert manager.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = request_with(list(range(10, 16)), "c")
    manager.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert all(manager.ref_count(b) == 2 for b in parent.block_ids)
    child.num_computed_tokens = 5  # recompute the last prompt token
    shared_tail = parent.block_ids[1]
    assert manager.allocate(child, 6)
    assert manager.take_copies() == [(shared_tail, child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0]  # the full block stays shared
    assert manager.ref_count(shared_tail) == 1
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8
    manager.check_invariants()


def test_free_plus_cached_plus_used_is_total_under_random_traffic():
    rng = random.Random(11)
    manager = BlockManager(24, 4, enable_caching=True)
    prefixes = [[rng.randrange(100) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    live: list[Request] = []
    for i in range(400):
        if live and rng.random() < 0.45:
            manager.free(live.pop(rng.randrange(len(live))))
        elif (request := arrive(manager, rng, prefixes, str(i), 100)) is not None:
            live.append(request)
        manager.check_invariants()


# ---- the scheduler -------------------------------------------------------------------------


def test_scheduler_computes_only_the_uncached_part():
    scheduler = create_scheduler(num_blocks=32, block_size=4, enable_caching=True)
    scheduler.add_request(create_request("a", prompt_len=18, max_tokens=1))
    assert scheduled_counts(step(scheduler)) == {"a": 18}
    scheduler.add_request(create_request("b", prompt_len=18, max_tokens=1))
    assert scheduled_counts(step(scheduler)) == {"b": 2}  # 4 cached blocks
    assert scheduler.prefix_cache_hits == 16 and scheduler.prefix_cache_queries == 36


def test_n_samples_share_the_prompt_and_compute_one_token_each():
    scheduler = create_scheduler(num_blocks=32, block_size=4)
    leader = create_request("s0", prompt_len=10, max_tokens=3)
    scheduler.add_request(leader)
    for i in (1, 2):
        scheduler.add_request(create_request(f"s{i}", prompt_len=10, max_tokens=3), fork_of="s0")
    assert scheduled_counts(step(scheduler)) == {"s0": 10}
    # s0 has its first token; s1 and s2 now share its three blocks instead of computing them.
    assert scheduler.block_manager.num_used_blocks == 3
    assert scheduler.requests["s1"].block_ids == scheduler.requests["s0"].block_ids
    counts = scheduled_counts(step(scheduler))
    assert counts == {"s0": 1, "s1": 1, "s2": 1}
    # Each forked sample got a private copy of the partly filled block, the full ones stay shared.
    first_blocks = {scheduler.requests[name].block_ids[0] for name in ("s0", "s1", "s2")}
    assert len(first_blocks) == 1
    tails = {scheduler.requests[name].block_ids[2] for name in ("s0", "s1", "s2")}
    assert len(tails) == 3
    drain(scheduler)
    assert scheduler.block_manager.num_used_blocks == 0


def test_siblings_of_an_aborted_leader_compute_on_their_own():
    scheduler = create_scheduler(num_blocks=32, block_size=4)
    scheduler.add_request(create_request("s0", prompt_len=10))
    scheduler.add_request(create_request("s1", prompt_len=10), fork_of="s0")
    scheduler.abort_requests(["s0"])
    assert scheduled_counts(step(scheduler)) == {"s1": 10}


# ---- on a tiny model: caching never changes greedy output ----------------------------------


def shared_prefix_prompts() -> list[list[int]]:
    rng = random.Random(5)
    system = [rng.randrange(2, 320) for _ in range(24)]  # 6 blocks of 4
    prompts = []
    for cut in (24, 24, 21, 16, 13, 8, 24, 3):  # block-aligned and not
        prompts.append(system[:cut] + [rng.randrange(2, 320) for _ in range(rng.randint(1, 6))])
    prompts.append(system[:24])  # a prompt that is exactly the cached prefix
    return prompts


def greedy_runs(options: dict, n: int = 1) -> tuple[list[list[list[int]]], object]:
    core, _ = tiny_core(**options)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = []
    for prompt in shared_prefix_prompts():  # one after another, so later ones can hit
        for i in range(n):
            core.add_request(
                f"{len(results)}-{i}", prompt, params, fork_of=f"{len(results)}-0" if i else None
            )
        outputs: dict[str, list] = {}
        while core.has_unfinished():
            for output in core.step():
                outputs.setdefault(output.request_id, []).append(output)
            core.scheduler.check_invariants()
        results.append([tokens_of(outputs[f"{len(results)}-{i}"]) for i in range(n)])
    return results, core


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_blocks": 14, "max_model_len": 48},
        {"max_num_batched_tokens": 5},
    ],
)
def test_greedy_output_is_the_same_with_caching_on_and_off(options):
    on, core = greedy_runs({**options, "enable_prefix_caching": True})
    off, _ = greedy_runs({**options, "enable_prefix_caching": False})
    assert on == off
    assert core.scheduler.block_manager.enable_caching
    stats = core.take_stats()
    assert stats.prefix_cache_hits > 0


def test_concurrent_shared_prefixes_under_preemption_match_no_caching():
    prompts = shared_prefix_prompts() * 2
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    on_core, _ = tiny_core(num_blocks=20, max_model_len=48, enable_prefix_caching=True)
    off_core, _ = tiny_core(num_blocks=20, max_model_len=48, enable_prefix_caching=False)
    on = run_all(on_core, prompts, params)
    off = run_all(off_core, prompts, params)
    assert {k: tokens_of(v) for k, v in on.items()} == {k: tokens_of(v) for k, v in off.items()}
    assert on_core.scheduler.num_preemptions > 0
    assert on_core.scheduler.block_manager.num_used_blocks == 0


def test_n_greedy_samples_all_equal_the_single_sample():
    single, _ = greedy_runs({"enable_prefix_caching": False})
    forked, core = greedy_runs({"enable_prefix_caching": True}, n=3)
    for one, three in zip(single, forked, strict=True):
        assert three == one * 3
    assert core.scheduler.block_manager.num_used_blocks == 0
