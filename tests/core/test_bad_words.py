"""vLLM's `bad_words`: a word's last token is ruled out where the output so far ends with the
rest of it; greedy tokens match transformers' own `bad_words_ids`, overlapped steps give the
same tokens as steps in turn, and the server takes the field like vLLM."""

from __future__ import annotations

from engine.core.bad_words import bad_word_ids, banned_tokens, needs_history
from engine.core.sampling_params import SamplingParams
from tests.core.test_async_scheduling import overlapped_like_in_turn
from tests.helpers import (
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tiny_tokenizer,
    tokens_of,
)
from tests.server_utils import app_client

PROMPTS = [[5, 9, 33, 2, 17], list(range(40, 70)), [7] * 13]


def test_a_word_is_banned_where_its_last_token_would_complete_it():
    sequences = ((4,), (7, 8), (1, 2, 3))
    assert banned_tokens(sequences, []) == [4]
    assert banned_tokens(sequences, [9, 7]) == [4, 8]
    assert banned_tokens(sequences, [1, 2]) == [4, 3]
    assert banned_tokens(sequences, [2, 1]) == [4]
    assert needs_history(sequences) and not needs_history(((4,), (5,)))


def test_each_word_as_it_stands_and_after_a_space():
    tokenizer = tiny_tokenizer()
    [bare, spaced] = bad_word_ids(tokenizer, ["quick"])
    assert tokenizer.decode(list(bare)) == "quick"
    assert tokenizer.decode(list(spaced)) == " quick"
    # A word given with its space is the same word; repeats are kept once.
    assert bad_word_ids(tokenizer, [" quick", "quick"]) == (bare, spaced)


def test_greedy_tokens_match_transformers_bad_words_ids():
    """Words taken from the free greedy output (one token, and two): the banned output is
    transformers' with the same token sequences banned."""
    model = tiny_llama()
    tokenizer = tiny_tokenizer()
    core, _ = tiny_core(model, tokenizer=tokenizer)
    free = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for i, prompt in enumerate(PROMPTS):
        written = tokens_of(free[f"req-{i}"])
        words = [tokenizer.decode(written[2:3]), tokenizer.decode(written[5:7])]
        words = [w for w in words if w.strip()]
        sequences = bad_word_ids(tokenizer, words)
        # transformers also reads the prompt: keep to words no prompt token could start.
        assert all(prompt[-1] != s[0] for s in sequences if len(s) > 1)
        params = SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, bad_words=tuple(words)
        )
        core, _ = tiny_core(model, tokenizer=tokenizer)
        got = tokens_of(run_all(core, [prompt], params)["req-0"])
        banned = [list(s) for s in sequences]
        assert got == reference_greedy(model, prompt, 12, bad_words_ids=banned)
        assert got != written
        for sequence in sequences:
            n = len(sequence)
            assert all(tuple(got[j : j + n]) != sequence for j in range(len(got) - n + 1))


def test_overlapped_steps_ban_as_steps_in_turn_do():
    tokenizer = tiny_tokenizer()
    sampled = {"temperature": 0.9, "seed": 3, "max_tokens": 24, "ignore_eos": True}
    requests = [
        ("words", PROMPTS[0], SamplingParams(bad_words=("fox", "the quick"), **sampled), None),
        ("one", PROMPTS[1], SamplingParams(bad_words=("a",), **sampled), None),
        ("free", PROMPTS[2], SamplingParams(**sampled), None),
    ]
    overlapped, _, _ = overlapped_like_in_turn(requests, tokenizer=tokenizer)
    # A word of several tokens needs each newest token on the host first: its steps (the
    # whole batch's) are waited for; one-token words are banned without it.
    assert not overlapped
    overlapped, _, _ = overlapped_like_in_turn(requests[1:], tokenizer=tokenizer)
    assert overlapped == {"one", "free"}


async def test_the_server_takes_bad_words_like_vllm():
    async with app_client() as (client, _):
        body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4, "temperature": 0}
        words = {**body, "bad_words": ["fox", "dog"]}
        assert (await client.post("/v1/completions", json=words)).status_code == 200
        rendered = await client.post("/v1/completions/render", json=words)
        assert rendered.json()[0]["sampling_params"]["bad_words"] == ["fox", "dog"]
        for bad, param in (([" "], "bad_words"), (["x"] * 65, "bad_words")):
            refused = await client.post("/v1/completions", json={**body, "bad_words": bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
