"""Suffix decoding's drafts: both sources (a request's own tokens, the shared tree of outputs)
draft what a search of every occurrence drafts, as sequences grow and outputs leave; the cache
keeps and evicts outputs as vLLM's settings say; and through the engine, greedy tokens stay
transformers' while repeated replies draft from earlier ones."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.core.engine_core import EngineCore
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import Drafter, SpeculativeConfig
from engine.core.suffix_decoding import (
    DraftRule,
    ResponseTree,
    SequenceSource,
    SuffixCache,
    SuffixSettings,
)
from tests.helpers import reference_greedy, tiny_core, tiny_llama


def searched_draft(
    sequences: list[list[int]], context: list[int], rule: DraftRule, most: int
) -> tuple[list[int], float]:
    """The draft and its score, by counting every occurrence of every string in `sequences`."""

    def occurrences(string: tuple[int, ...]) -> int:
        n = len(string)
        return sum(
            1
            for seq in sequences
            for end in range(n, len(seq) + 1)
            if tuple(seq[end - n : end]) == string
        )

    best: tuple[list[int], float] = ([], 0.0)
    context = context[-rule.depth :]
    for match_len in range(1, len(context)):
        string = tuple(context[len(context) - match_len :])
        total = occurrences(string)
        if total == 0:
            break
        tokens: list[int] = []
        score, prob = 0.0, 1.0
        while len(tokens) < rule.limit(match_len, most):
            nexts = Counter(
                seq[end]
                for seq in sequences
                for end in range(len(string), len(seq))
                if tuple(seq[end - len(string) : end]) == string
            )
            if not nexts:
                break
            token = min(nexts, key=lambda t: (-nexts[t], t))
            prob *= nexts[token] / total
            if prob < rule.min_prob:
                break
            tokens.append(token)
            score += prob
            string, total = (*string, token), nexts[token]
        if score >= best[1]:
            best = (tokens, score)
    return best


def _rules(rng: random.Random) -> DraftRule:
    return DraftRule(
        depth=rng.choice([2, 3, 5, 8]),
        factor=rng.choice([0.5, 1.0, 2.0, 4.0]),
        min_prob=rng.choice([0.0, 0.1, 0.3, 0.6]),
    )


def test_a_sequence_drafts_from_itself_as_a_search_of_every_occurrence():
    rng = random.Random(0)
    for trial in range(60):
        rule = _rules(rng)
        source = SequenceSource()
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
        for _ in range(25):
            most = rng.randrange(1, 8)
            draft = source.draft(tokens, rule, most)
            expected, score = searched_draft([tokens], tokens, rule, most)
            assert draft.tokens == expected, (trial, rule, tokens)
            assert draft.score == pytest.approx(score)
            tokens.extend(rng.randrange(3) for _ in range(rng.randrange(1, 3)))


def test_a_long_sequence_that_repeats_itself_counts_the_latest_occurrences():
    """Past RECENT_OCCURRENCES of its last token, a sequence counts the latest ones: a
    40000-token loop drafts its period as a short one does."""
    loop = [7, 8, 9, 10, 11]
    rule = DraftRule(depth=24, factor=1.0, min_prob=0.1)
    long, short = SequenceSource(), SequenceSource()
    assert long.draft(loop * 8000, rule, 12).tokens == short.draft(loop * 20, rule, 12).tokens
    assert short.draft(loop * 20, rule, 12).tokens == (loop * 3)[:12]


def test_the_tree_of_outputs_drafts_as_a_search_of_them_as_they_grow_and_leave():
    rng = random.Random(1)
    for trial in range(40):
        rule = _rules(rng)
        tree = ResponseTree(rule.depth)
        live: dict[int, list[int]] = {}
        for step in range(40):
            action = rng.random()
            if action < 0.6 or not live:
                seq = rng.randrange(5)
                grown = [rng.randrange(3) for _ in range(rng.randrange(0, 4))]
                tree.extend(seq, grown)
                live.setdefault(seq, []).extend(grown)
            elif action < 0.75:
                seq = rng.choice(list(live))
                tree.remove(seq)
                del live[seq]
            context = [rng.randrange(3) for _ in range(rng.randrange(1, 10))]
            most = rng.randrange(1, 8)
            draft = tree.draft(context, rule, most)
            expected, score = searched_draft(list(live.values()), context, rule, most)
            assert draft.tokens == expected, (trial, step, rule, live, context)
            assert draft.score == pytest.approx(score)
        for seq in list(live):
            tree.remove(seq)
        assert tree.nodes == 1  # only the root is left: every removal freed its nodes


def test_a_request_s_nodes_followed_token_by_token_are_those_found_afresh():
    """The cache follows each running request's matches in the tree from draft to draft; as
    other outputs grow and old ones leave, they stay those a search from the root finds."""
    rng = random.Random(2)
    for trial in range(20):
        cache = SuffixCache(SuffixSettings(depth=rng.choice([3, 5, 8]), max_cached_requests=3))
        running: dict[str, list[int]] = {}
        prompts: dict[str, list[int]] = {}
        for step in range(120):
            action = rng.random()
            if action < 0.15 or not running:
                request_id = f"r{step}"
                prompts[request_id] = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
                running[request_id] = []
                cache.observe(request_id, [])
            elif action < 0.25:
                request_id = rng.choice(list(running))
                cache.stop(request_id)
                del running[request_id]
                continue
            request_id = rng.choice(list(running))
            running[request_id] += [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
            cache.observe(request_id, running[request_id])
            tokens = prompts[request_id] + running[request_id]
            cache.draft(request_id, tokens, 4)
            followed = cache._cursors[request_id][2] if cache.cached_requests else None
            if followed is not None:
                assert followed == cache.tree.matches(tokens), (trial, step)


def test_a_request_drafts_from_an_earlier_output_and_caches_as_configured():
    cache = SuffixCache(SuffixSettings(depth=8, max_cached_requests=2))
    cache.observe("a", [])
    cache.observe("a", [7, 8, 9, 10, 11])
    cache.stop("a")
    # "b" never saw 7 8 9 itself: its own tokens draft nothing, a's output drafts the rest.
    prompt = [1, 2, 7, 8, 9]
    cache.observe("b", [])
    assert cache.draft("b", prompt, 4) == [10, 11]
    cache.stop("b")
    cache.observe("c", [])
    cache.observe("d", [])
    assert cache.cached_requests == ["c", "d"]  # a left first, then b
    assert cache.draft("d", prompt, 4) == []

    alone = SuffixCache(SuffixSettings(depth=8, max_cached_requests=0))
    alone.observe("a", [7, 8, 9, 10, 11])
    alone.stop("a")
    alone.observe("b", [])
    assert alone.cached_requests == []
    assert alone.draft("b", prompt, 4) == []
    # A request's own earlier tokens still draft.
    alone.observe("c", [])
    assert alone.draft("c", [7, 8, 9, 3, 7, 8], 4) == [9, 3]


def test_the_oldest_outputs_leave_at_the_node_ceiling_and_a_reused_id_starts_over():
    cache = SuffixCache(SuffixSettings(depth=4, max_cached_requests=-1), max_nodes=40)
    for number in range(10):
        cache.observe(f"r{number}", [])
        cache.observe(f"r{number}", [number * 10 + i for i in range(6)])
        cache.stop(f"r{number}")
    assert cache.tree.nodes <= 40
    assert 0 < len(cache.cached_requests) < 10
    assert cache.cached_requests[-1] == "r9"
    cache.observe("r9", [])  # the id again: its earlier output leaves the tree
    assert cache.draft("r9", [90, 91], 3) == []


def test_the_config_reads_vllm_s_suffix_fields():
    config = SpeculativeConfig.of({"method": "suffix"})
    assert config.num_speculative_tokens == 24
    assert config.suffix == SuffixSettings()
    config = SpeculativeConfig.of(
        {
            "method": "suffix",
            "num_speculative_tokens": 8,
            "suffix_decoding_max_tree_depth": 32,
            "suffix_decoding_max_cached_requests": 0,
            "suffix_decoding_max_spec_factor": 2,
            "suffix_decoding_min_token_prob": 0.25,
        }
    )
    assert config.num_speculative_tokens == 8
    assert config.suffix == SuffixSettings(32, 0, 2.0, 0.25)
    assert "suffix decoding" in config.describe()
    for fields, message in [
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "at least 1"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -2}, "-1"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, r"\[0, 1\]"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": "2"}, "must be a number"),
        ({"method": "suffix", "prompt_lookup_max": 3}, "unknown speculative config fields"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8},
            "unknown",
        ),
        ({"method": "suffix", "num_speculative_tokens": 33}, r"\[1, 32\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.of(fields)


def test_the_drafter_feeds_every_output_and_keeps_it_after_the_request_ends():
    drafter = Drafter(SpeculativeConfig.of({"method": "suffix", "num_speculative_tokens": 4}))
    assert drafter.suffix is not None
    first = Request("a", [1, 2], SamplingParams(max_tokens=20), 0.0, 100)
    for token in [5, 6, 7, 8, 9]:
        first.append_output(token)
    drafter.draft_step([first], running=1000)  # no drafts at this size: outputs count all the same
    drafter.release(["a"])
    assert drafter.suffix.cached_requests == ["a"]
    second = Request("b", [3, 5, 6, 7], SamplingParams(max_tokens=20), 0.0, 100)
    drafter.draft(second)
    assert second.draft_token_ids == [8, 9]


def _run(core: EngineCore, request_id: str, prompt: list[int]) -> list[int]:
    core.add_request(request_id, prompt, GREEDY)
    tokens: list[int] = []
    while core.has_unfinished():
        for output in core.step():
            tokens += output.new_token_ids
    return tokens


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "fields",
    [{}, {"suffix_decoding_max_spec_factor": 4.0, "suffix_decoding_min_token_prob": 0.0}],
    ids=["vllm-defaults", "eager"],
)
def test_greedy_tokens_equal_generate_and_a_repeated_request_drafts_from_the_first(fields):
    config = SpeculativeConfig.of(
        {"method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": 8, **fields}
    )
    model = tiny_llama()
    core, _ = tiny_core(tiny_llama(), speculative=config)
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 320) for _ in range(12)] for _ in range(3)]
    for number, prompt in enumerate(prompts):
        first = _run(core, f"first-{number}", prompt)
        assert first == reference_greedy(model, prompt, 24)
        before = core.take_stats().drafts
        assert _run(core, f"again-{number}", prompt) == first
        again = core.take_stats().drafts
        # The second reply repeats the first, which the shared tree holds: most of it is
        # drafted and kept.
        assert again.num_accepted_tokens >= 12, (before, again)
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
