"""A thought budget (`thinking_token_budget`): once the reply has spent its budget of tokens in
its thought, the closing tag's tokens are forced and the reply goes on from there. Checked on
the counter alone, and through the engine against transformers' greedy continuation of the
same tokens; and through chat, where the reasoning parser then splits the reply there."""

from __future__ import annotations

import copy

import pytest

from engine.core.sampling_params import SamplingParams, ThoughtBudget
from engine.core.thought_budget import ThoughtCounter
from server.settings import ServerSettings
from tests.helpers import reference_greedy, run_all, tiny_core, tiny_llama, tiny_tokenizer
from tests.server.test_reasoning import THINKING_TEMPLATE
from tests.server_utils import app_client

TAGS = ["<think>", "</think>"]


def counter(budget: int, inside: bool, closing: list[int] | None = None) -> ThoughtCounter:
    """Tokens are characters: 1 `<`, ... as `chr(id)`; the tags are `{` and `}`."""
    return ThoughtCounter(
        budget, ("{",), "}", closing or [ord("}")], inside, lambda ids: "".join(map(chr, ids))
    )


def feed(thought: ThoughtCounter, text: str) -> list[int | None]:
    """The forced token after each character of `text`."""
    output, forced = [], []
    for char in text:
        output.append(ord(char))
        thought.append(output)
        forced.append(thought.forced_token)
    return forced


def test_the_closing_tag_is_forced_once_the_budget_is_spent() -> None:
    thought = counter(3, inside=True)
    assert feed(thought, "abc}xyz") == [None, None, ord("}"), None, None, None, None]
    assert thought.done and thought.count == 3


def test_a_thought_opened_in_the_output_counts_from_its_tag() -> None:
    thought = counter(2, inside=False)
    assert feed(thought, "hi{ab}") == [None, None, None, None, ord("}"), None]


def test_a_thought_that_closes_itself_forces_nothing() -> None:
    thought = counter(5, inside=True)
    assert feed(thought, "ab}cdefgh") == [None] * 9
    assert thought.done


def test_a_budget_of_nothing_forces_at_once_and_a_tag_of_several_tokens_in_turn() -> None:
    thought = counter(0, inside=True, closing=[7, 8, 9])
    assert thought.forced_token == 7
    assert feed(thought, "\x07\x08\x09ab") == [8, 9, None, None, None]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(TAGS)
    return tiny_llama(vocab_size=len(tokenizer)), tokenizer


def test_the_engine_forces_the_tag_and_goes_on_greedily(model_and_tokenizer) -> None:
    """Greedy, budget 5, the thought open from the prompt: five of transformers' greedy
    tokens, `</think>`, then transformers' greedy continuation of all of that."""
    model, tokenizer = model_and_tokenizer
    [think, end] = tokenizer.convert_tokens_to_ids(TAGS)
    prompt = [5, 9, 33, 2, think]
    budget = ThoughtBudget(5, ("<think>",), "</think>", open_at_start=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, thought_budget=budget)
    core, _ = tiny_core(model, tokenizer=tokenizer)
    [outputs] = run_all(core, [prompt], params).values()
    tokens = [t for o in outputs for t in o.new_token_ids]
    first = reference_greedy(model, prompt, 5)
    assert end not in first  # the random model does not close its thought by itself
    rest = reference_greedy(model, [*prompt, *first, end], 6)
    assert tokens == [*first, end, *rest]


async def test_chat_caps_the_reasoning_the_parser_splits_off(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE  # the prompt opens the thought
    settings = ServerSettings(served_model_name="tiny", reasoning_parser="deepseek_r1")
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "thinking_token_budget": 6,
        "return_token_ids": True,
    }
    async with app_client(settings, model=model, tokenizer=tokenizer) as (client, _):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        [choice] = response.json()["choices"]
        [end] = tokenizer.convert_tokens_to_ids(TAGS[1:])
        assert choice["token_ids"].index(end) <= 6  # forced at the latest after six
        assert choice["message"]["reasoning"] is not None
        assert choice["message"]["content"]  # the answer goes on after the forced tag
        refused = await client.post(
            "/v1/chat/completions", json={**body, "thinking_token_budget": -1}
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "thinking_token_budget"


async def test_the_messages_api_budget_is_the_thinking_budget(model_and_tokenizer) -> None:
    """Anthropic's `thinking: {"type": "enabled", "budget_tokens": N}` caps the thought the
    same way: the reply's thinking block ends and a text block follows."""
    model, tokenizer = model_and_tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE
    settings = ServerSettings(served_model_name="tiny", reasoning_parser="deepseek_r1")
    body = {
        "model": "tiny",
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
        "ignore_eos": True,
    }
    async with app_client(settings, model=model, tokenizer=tokenizer) as (client, _):
        free = (await client.post("/v1/messages", json=body)).json()
        assert [block["type"] for block in free["content"]] == ["thinking"]
        capped = {**body, "thinking": {"type": "enabled", "budget_tokens": 4}}
        reply = (await client.post("/v1/messages", json=capped)).json()
        assert [block["type"] for block in reply["content"]] == ["thinking", "text"]


async def test_each_sample_of_a_request_counts_its_own_thought(model_and_tokenizer) -> None:
    """`n` samples, drawn at random: each is forced to close its thought at its own budget."""
    model, tokenizer = model_and_tokenizer
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE
    [end] = tokenizer.convert_tokens_to_ids(TAGS[1:])
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "n": 3,
        "seed": 3,
        "max_tokens": 10,
        "ignore_eos": True,
        "thinking_token_budget": 4,
        "return_token_ids": True,
    }
    async with app_client(model=model, tokenizer=tokenizer) as (client, _):
        choices = (await client.post("/v1/chat/completions", json=body)).json()["choices"]
    samples = [choice["token_ids"] for choice in choices]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1
    for tokens in samples:
        assert end in tokens[:5]  # closed by itself, or forced as its fifth token
