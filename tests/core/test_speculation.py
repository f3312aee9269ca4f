"""N-gram speculation: drafts from the sequence itself, verified in one step of decode rows,
change no greedy token (transformers' `generate` stays the oracle) and no sampled distribution,
and leave the KV cache as they found it."""

from __future__ import annotations

import json
import logging
import random

import jsonschema
import pytest

from engine.core.config import EngineConfig
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.core.speculation import Drafter, NgramIndex, SpeculativeConfig, speculates
from tests.helpers import (
    reference_greedy,
    run_all,
    text_of,
    tiny_core,
    tiny_llama,
    tiny_tokenizer,
    tokens_of,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def brute_force_draft(tokens: list[int], shortest: int, longest: int, count: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix that occurred before, searched
    position by position."""
    length = len(tokens)
    for n in range(min(longest, length - 1), shortest - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + count]
    return []


def test_an_index_grown_token_by_token_drafts_as_a_search_of_the_whole_sequence():
    rng = random.Random(0)
    for trial in range(40):
        shortest, longest = rng.choice([(1, 1), (1, 3), (2, 4), (3, 5)])
        index = NgramIndex(shortest, longest)
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        for _ in range(60):
            count = rng.randrange(1, 6)
            assert index.draft(tokens, count) == brute_force_draft(
                tokens, shortest, longest, count
            ), (trial, tokens)
            tokens.extend(rng.randrange(4) for _ in range(rng.randrange(1, 4)))


def test_the_longest_match_wins_and_a_sequence_never_matches_itself():
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8
    tokens = [5, 1, 2, 9, 7, 2, 8, 1, 2]
    # "1 2" ended at 3 (followed by 9 7 2); "2" alone last ended at 6 (followed by 8).
    assert index.draft(tokens, 3) == [9, 7, 2]
    assert NgramIndex(1, 1).draft(tokens, 2) == [8, 1]
    assert NgramIndex(1, 3).draft([4, 5, 6], 2) == []
    assert NgramIndex(1, 3).draft([4], 2) == []


def test_the_config_reads_vllm_s_fields_and_refuses_the_rest():
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3}) == (
        SpeculativeConfig(3, 5, 5)
    )
    assert SpeculativeConfig.of({"num_speculative_tokens": 2, "prompt_lookup_max": 4}) == (
        SpeculativeConfig(2, 4, 4)
    )
    assert SpeculativeConfig.of(
        {"num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 6}
    ) == SpeculativeConfig(2, 2, 6)
    assert (
        SpeculativeConfig.of(
            {"num_speculative_tokens": 2, "disable_by_batch_size": 8}
        ).disable_by_batch_size
        == 8
    )
    for fields, message in [
        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not served"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "draft": "x"}, "unknown speculative config fields for "),
        ({"num_speculative_tokens": "2"}, "must be an integer"),
        ({"num_speculative_tokens": 0}, "in [1, 32]"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "at least 1"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "min"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            SpeculativeConfig.of(fields)


def test_what_speculation_cannot_run_with_is_refused_before_anything_loads():
    spec = SpeculativeConfig(2)
    with pytest.raises(ValueError, match="not --runner pooling"):
        EngineConfig(runner="pooling", speculative=spec)
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineConfig(async_scheduling=True, speculative=spec)
    assert not EngineConfig(speculative=spec).overlaps("cuda")


def _request(**params: object) -> Request:
    return Request("r", [1, 2, 3, 1, 2], SamplingParams(**params), 0.0, 100)


def test_requests_whose_tokens_follow_their_rows_and_the_tokens_before_draft():
    for params in [
        {"temperature": 0.7, "top_p": 0.9, "logit_bias": {3: 1.0}, "logprobs": 2},
        {"repetition_penalty": 1.2, "presence_penalty": 0.5, "min_tokens": 4},
    ]:
        assert speculates(_request(**params)), params
    waiting = _request()
    waiting.num_pending_tokens = 1  # its newest token is still on the device
    assert not speculates(waiting)
    drafter = Drafter(SpeculativeConfig(4, 1, 2))
    request = _request(max_tokens=10)
    drafter.draft(request)
    assert request.draft_token_ids == [3, 1, 2]
    # The drafts leave room for the token after them within max_tokens.
    request = _request(max_tokens=2)
    drafter.draft(request)
    assert request.draft_token_ids == [3]
    request = _request(max_tokens=1)
    drafter.draft(request)
    assert request.draft_token_ids == []


def test_a_request_drafts_one_more_than_it_last_kept():
    drafter = Drafter(SpeculativeConfig(4, 1, 1))
    request = _request(max_tokens=50)
    request.prompt_token_ids[:] = request.all_token_ids[:] = [1, 2, 3, 4, 5, 6, 1]
    drafter.draft(request)
    assert request.draft_token_ids == [2, 3, 4, 5]
    drafter.kept("r", 0)
    drafter.draft(request)
    assert request.draft_token_ids == [2]
    drafter.kept("r", 1)
    drafter.draft(request)
    assert request.draft_token_ids == [2, 3]
    drafter.kept("r", 2)
    drafter.kept("r", 3)
    drafter.kept("r", 4)
    drafter.draft(request)
    assert request.draft_token_ids == [2, 3, 4, 5]
    drafter.release(["r"])
    drafter.kept("s", 1)
    drafter.draft(request)
    assert len(request.draft_token_ids) == 4


class ScriptedDrafter(Drafter):
    """Drafts from each request's known greedy continuation, every `wrong`-th draft token
    replaced by another: the engine must keep exactly the right ones. `limit`: drafts while no
    more requests run (the tests pass 64: every step drafts, whatever the machine's speed);
    None leaves it to the timed gate (`draft_gate.py`)."""

    def __init__(
        self, continuations: dict[str, list[int]], wrong: int, count: int, limit: int | None = None
    ) -> None:
        super().__init__(SpeculativeConfig(count, 1, 1, disable_by_batch_size=limit))
        self.continuations = continuations
        self.wrong = wrong
        self.calls = 0

    def draft(self, request: Request) -> None:
        truth = self.continuations[request.request_id]
        done = request.num_output_tokens
        drafts = truth[done : done + self.config.num_speculative_tokens]
        drafts = drafts[: max(0, request.max_output_tokens - done - 1)]
        for position in range(len(drafts)):
            self.calls += 1
            if self.wrong and self.calls % self.wrong == 0:
                drafts[position] = (drafts[position] + 1) % 320
        request.draft_token_ids = drafts if not request.is_finished else []


def _prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, 320) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


@pytest.mark.parametrize("wrong", [0, 3, 1])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_blocks": 30, "max_model_len": 64},  # preemptions
        {"max_num_batched_tokens": 9},  # chunked prompts; drafts cut to the budget
        {"attention_backend": "torch"},
    ],
    ids=["plain", "preempted", "tight-budget", "torch-attention"],
)
def test_greedy_tokens_equal_generate_whatever_the_drafts(wrong: int, options: dict):
    model = tiny_llama()
    prompts = _prompts()
    truths = {f"req-{i}": reference_greedy(model, p, 24) for i, p in enumerate(prompts)}
    core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(4, 1, 1), **options)
    core.drafter = ScriptedDrafter(truths, wrong, 4, limit=64)
    outputs = run_all(core, prompts, GREEDY)
    for request_id, truth in truths.items():
        assert tokens_of(outputs[request_id]) == truth, request_id
    drafts = core.take_stats().drafts
    assert drafts.num_drafts > 0
    if wrong == 0:
        assert drafts.num_accepted_tokens == drafts.num_draft_tokens
    elif wrong == 1:
        assert drafts.num_accepted_tokens == 0
    else:
        assert 0 < drafts.num_accepted_tokens < drafts.num_draft_tokens
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_n_gram_drafts_are_kept_where_the_model_repeats_itself():
    """The tiny model falls into loops; drafts from the loop so far are kept."""
    model = tiny_llama()
    rng = random.Random(0)
    base = [[rng.randrange(2, 320) for _ in range(n)] for n in (5, 9, 14, 3, 20)]
    prompts = [p * 3 for p in base] + base
    core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(3, 1, 3))
    outputs = run_all(core, prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 24)
    drafts = core.take_stats().drafts
    assert drafts.num_accepted_tokens > 0
    assert sum(drafts.accepted_per_position) == drafts.num_accepted_tokens


def test_a_failing_drafter_costs_the_drafts_not_the_requests(caplog):
    """A drafter that raises (a bug in it, whatever the method) leaves the step's requests to
    decode without drafts; the first failure is logged with its trace."""
    model = tiny_llama()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 320) for _ in range(5)] * 3 for _ in range(4)]
    core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(3, 1, 3))
    calls = 0
    draft_all = core.drafter.draft_all

    def every_other_fails(requests: list[Request]) -> None:
        nonlocal calls
        calls += 1
        draft_all(requests)  # drafts made, then the failure: none may be run
        if calls % 2:
            raise RuntimeError("drafter broke")

    core.drafter.draft_all = every_other_fails  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="engine.core.engine_core"):
        outputs = run_all(core, prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 24)
    assert calls > 2 and core.take_stats().drafts.num_drafts > 0  # the other steps drafted
    assert [r.message for r in caplog.records] == [
        "drafting failed; the requests decode without drafts"
    ]
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def _finished(outputs: dict) -> dict:
    return {
        request_id: (tokens_of(parts), text_of(parts), parts[-1].finish_reason)
        for request_id, parts in outputs.items()
    }


def test_stops_inside_kept_drafts_end_the_sequence_where_one_token_a_step_would():
    """A stop string, a stop token or max_tokens reached inside a step's kept drafts ends
    the output there, tokens and text, as without speculation."""
    model = tiny_llama()
    prompts = _prompts(4)
    plain, _ = tiny_core(tiny_llama())
    free = _finished(run_all(plain, prompts, GREEDY))
    params = []
    for i in range(len(prompts)):
        tokens, text, _ = free[f"req-{i}"]
        if i == 0:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop=[text[10:14]]))
        elif i == 1:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[7]]))
        elif i == 2:
            params.append(SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
        else:
            params.append(
                SamplingParams(
                    temperature=0, max_tokens=24, stop=[text[5:8]], include_stop_str_in_output=True
                )
            )
    truths = {f"req-{i}": reference_greedy(model, p, 24) for i, p in enumerate(prompts)}
    expected = _finished(run_all(tiny_core(tiny_llama())[0], prompts, params))
    core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(6, 1, 1))
    core.drafter = ScriptedDrafter(truths, 0, 6, limit=64)
    assert _finished(run_all(core, prompts, params)) == expected
    assert expected["req-0"][2] == "stop" and expected["req-2"][2] == "length"
    assert len(expected["req-2"][0]) == 9


def test_sampled_requests_with_a_seed_repeat_themselves_and_hold_no_blocks():
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(3, 1, 2))
        runs.append(_finished(run_all(core, prompts, params)))
        manager = core.scheduler.block_manager
        assert manager.num_free_blocks == manager.num_blocks
    assert runs[0] == runs[1]
    assert all(len(tokens) == 20 for tokens, _, _ in runs[0].values())


@pytest.mark.parametrize(
    "extra",
    [{}, {"repetition_penalty": 1.3, "min_tokens": 30}, {"top_k": 20, "min_p": 0.05}],
    ids=["plain", "penalties", "top-k"],
)
def test_seeded_replies_are_the_same_with_drafts_as_without(extra: dict):
    """Each token of a seeded request is drawn with noise keyed by its position, in a verify
    step's rows as in a step of its own: drafts of its own reply are all kept, wrong ones
    refused where they go wrong, and the reply is the same either way (so a seeded reply does
    not depend on when the gate drafts)."""
    prompts = _prompts(4)
    params = SamplingParams(
        temperature=0.9, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True, **extra
    )
    plain = run_all(tiny_core(tiny_llama())[0], prompts, params)
    truths = {request_id: tokens_of(parts) for request_id, parts in plain.items()}
    for wrong in [0, 3, None]:
        core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(4, 1, 2))
        if wrong is not None:
            core.drafter = ScriptedDrafter(truths, wrong, 4, limit=64)
        outputs = run_all(core, prompts, params)
        assert {key: tokens_of(parts) for key, parts in outputs.items()} == truths, wrong
        drafts = core.take_stats().drafts
        if wrong == 0:
            assert drafts.num_drafts > 0
            assert drafts.num_accepted_tokens == drafts.num_draft_tokens


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size():
    model = tiny_llama()
    prompts = _prompts(3)
    truths = {f"req-{i}": reference_greedy(model, p, 24) for i, p in enumerate(prompts)}
    spec = SpeculativeConfig(4, 1, 1, disable_by_batch_size=2)
    core, _ = tiny_core(tiny_llama(), speculative=spec)
    core.drafter = ScriptedDrafter(truths, 0, 4, limit=2)
    lengths = [4, 24, 24]
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True)
        core.add_request(f"req-{i}", prompt, params)
    verified_with: list[int] = []
    tokens: dict[str, list[int]] = {f"req-{i}": [] for i in range(3)}
    while core.has_unfinished():
        running = core.scheduler.num_running
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
        if core.take_stats().drafts.num_drafts:
            verified_with.append(running)
    assert verified_with and max(verified_with) <= 2
    for request_id, truth in truths.items():
        assert tokens[request_id] == truth[: len(tokens[request_id])]
    assert [len(t) for t in tokens.values()] == lengths


def test_logprobs_of_kept_drafts_are_those_of_one_token_a_step():
    model = tiny_llama()
    prompts = _prompts(4)
    truths = {f"req-{i}": reference_greedy(model, p, 24) for i, p in enumerate(prompts)}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = run_all(tiny_core(tiny_llama())[0], prompts, params)
    core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(4, 1, 1))
    core.drafter = ScriptedDrafter(truths, 3, 4, limit=64)
    speculated = run_all(core, prompts, params)
    assert core.take_stats().drafts.num_accepted_tokens > 0
    for request_id in truths:
        want = [entry for part in plain[request_id] for entry in part.logprobs or []]
        got = [entry for part in speculated[request_id] for entry in part.logprobs or []]
        assert len(got) == len(want) == 24
        for a, b in zip(got, want, strict=True):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


SCHEMA = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
    },
    "required": ["tags", "name", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_formats_rule_each_draft_as_a_sampled_token(temperature: float):
    """Under a JSON schema every kept draft fits the format, and greedy replies are those of
    one token a step; drafts the format refuses (every second one wrong, unchecked) are
    refused at their row."""
    structured = StructuredOutputs("json", json.dumps(SCHEMA))
    params = SamplingParams(temperature=temperature, max_tokens=80, seed=5, structured=structured)
    prompts = _prompts(4)
    plain = run_all(tiny_core(tiny_llama())[0], prompts, params)
    truths = {request_id: tokens_of(parts) for request_id, parts in plain.items()}
    for drafter in ["scripted", "n-gram"]:
        core, _ = tiny_core(tiny_llama(), speculative=SpeculativeConfig(4, 1, 2))
        if drafter == "scripted":
            core.drafter = ScriptedDrafter(truths, 2, 4, limit=64)
        outputs = run_all(core, prompts, params)
        drafts = core.take_stats().drafts
        assert drafts.num_drafts > 0, drafter
        for request_id, parts in outputs.items():
            jsonschema.validate(json.loads(text_of(parts)), SCHEMA)
            if temperature == 0:
                assert _finished({request_id: parts}) == _finished(
                    {request_id: plain[request_id]}
                ), (drafter, request_id)
        if drafter == "scripted" and temperature == 0:
            assert 0 < drafts.num_accepted_tokens < drafts.num_draft_tokens


def _pairs_written(prompts: list[list[int]]) -> list[str]:
    """A two-token word the tiny model writes greedily from each prompt a few tokens in (its
    own two tokens again when encoded), where its first token is likely a draft: as a bad word
    it bans its second token right after its first, in that draft's row."""
    tokenizer = tiny_tokenizer()
    free = run_all(tiny_core(tiny_llama())[0], prompts, GREEDY)
    words = []
    for parts in free.values():
        tokens = tokens_of(parts)
        for start in range(2, 9):
            pair = tokens[start : start + 2]
            word = tokenizer.decode(pair)
            if tokenizer.encode(word, add_special_tokens=False) == pair:
                words.append(word)
                break
    return words


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 0.8, "presence_penalty": 0.4},
        # Half the vocabulary ends a reply, once 14 tokens are written.
        {"min_tokens": 14, "stop_token_ids": list(range(2, 160))},
        {"bad_words": "written pairs"},
    ],
    ids=["repetition", "frequency-presence", "min-tokens", "bad-words"],
)
def test_what_reads_the_tokens_before_a_row_reads_the_drafts_before_it(fields: dict):
    """Penalties count, bad words and `min_tokens` go by the kept drafts before each row: the
    greedy tokens are those of one token a step."""
    prompts = _prompts(4)
    if fields.get("bad_words"):
        fields = {"bad_words": _pairs_written(prompts)}
        assert len(fields["bad_words"]) >= 2
    params = SamplingParams(temperature=0, max_tokens=20, **fields)
    plain = run_all(tiny_core(tiny_llama())[0], prompts, params)
    truths = {request_id: tokens_of(parts) for request_id, parts in plain.items()}
    for wrong in (0, 3):  # all drafts right, then every third wrong
        spec = SpeculativeConfig(4, 1, 1, disable_by_batch_size=64)
        core, _ = tiny_core(tiny_llama(), speculative=spec)
        core.drafter = ScriptedDrafter(truths, wrong, 4, limit=64)
        speculated = run_all(core, prompts, params)
        assert _finished(speculated) == _finished(plain), wrong
        assert core.take_stats().drafts.num_accepted_tokens > 0
