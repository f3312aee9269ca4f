"""POST /v1/completions through the app on a tiny engine."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import SamplingParams
from tests.helpers import chat_tokenizer, run_all, text_of, tiny_core
from tests.server_utils import app_client, blocks_in_use, shared_tiny_model, sse_events

TOKENIZER = chat_tokenizer()
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


async def complete(client, **body):
    response = await client.post("/v1/completions", json={**GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_completion_shape_and_usage():
    async with app_client() as (client, engine):
        body = await complete(client, prompt="Hello world", max_tokens=7)
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
        [choice] = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == "length"
        assert choice["logprobs"] is None
        prompt_tokens = len(TOKENIZER("Hello world")["input_ids"])
        assert body["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 7,
            "total_tokens": prompt_tokens + 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert blocks_in_use(engine) == 0


async def test_text_equals_the_engines_greedy_text():
    core, _ = tiny_core(shared_tiny_model(), tokenizer=TOKENIZER)
    prompt = TOKENIZER("Hello world")["input_ids"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12)
    expected = text_of(run_all(core, [prompt], params)["req-0"])
    async with app_client() as (client, _):
        body = await complete(client, prompt="Hello world", max_tokens=12, logprobs=0)
        assert body["choices"][0]["text"] == expected
        assert len(body["choices"][0]["logprobs"]["tokens"]) == 12


@pytest.mark.parametrize(
    "prompt",
    [
        ["Hello world", "The quick brown"],
        [[40, 41, 42], [50, 51]],
    ],
)
async def test_several_prompts_and_n_give_indexed_choices(prompt):
    async with app_client() as (client, _):
        body = await complete(client, prompt=prompt, max_tokens=3, n=2, temperature=1.0, seed=3)
        assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
        assert body["usage"]["completion_tokens"] == 12
        if isinstance(prompt[0], list):
            assert body["usage"]["prompt_tokens"] == 5


async def test_token_id_prompt():
    async with app_client() as (client, _):
        body = await complete(client, prompt=[40, 41, 42, 43], max_tokens=2)
        assert body["usage"]["prompt_tokens"] == 4


async def test_stop_string_split_across_tokens():
    async with app_client() as (client, engine):
        full = (await complete(client, prompt="Hello world", max_tokens=24))["choices"][0]["text"]
        stop = full[6:11]
        body = await complete(client, prompt="Hello world", max_tokens=24, stop=[stop, "zzz"])
        choice = body["choices"][0]
        assert choice["text"] == full[: full.index(stop)]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
        kept = await complete(
            client, prompt="Hello world", max_tokens=24, stop=stop, include_stop_str_in_output=True
        )
        assert kept["choices"][0]["text"] == full[: full.index(stop) + len(stop)]
        assert blocks_in_use(engine) == 0


async def test_echo_with_prompt_logprobs():
    async with app_client() as (client, _):
        body = await complete(client, prompt="Hello world", max_tokens=3, echo=True, logprobs=2)
        choice = body["choices"][0]
        assert choice["text"].startswith("Hello world")
        logprobs = choice["logprobs"]
        prompt_len = len(TOKENIZER("Hello world")["input_ids"])
        assert len(logprobs["tokens"]) == prompt_len + 3
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
        assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:])
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
        plain = await complete(client, prompt="Hello world", max_tokens=3, echo=True)
        assert plain["choices"][0]["text"] == choice["text"]


async def test_echo_logprobs_of_a_cached_prompt_for_each_choice():
    """The prompt is in the prefix cache and two choices share it: each choice still scores
    every prompt token, as the first request did."""
    prompt = list(range(40, 80))
    async with app_client() as (client, engine):
        first = await complete(client, prompt=prompt, max_tokens=2, echo=True, logprobs=1)
        expected = first["choices"][0]["logprobs"]["token_logprobs"][: len(prompt)]
        again = await complete(client, prompt=prompt, max_tokens=2, echo=True, logprobs=1, n=2)
        for choice in again["choices"]:
            scored = choice["logprobs"]["token_logprobs"]
            assert len(scored) == len(prompt) + 2 and scored[0] is None
            assert scored[1 : len(prompt)] == pytest.approx(expected[1:], abs=1e-4)
        assert blocks_in_use(engine) == 0


async def test_logprobs_alternatives_include_the_chosen_token():
    async with app_client() as (client, _):
        body = await complete(client, prompt="Hello", max_tokens=4, logprobs=3)
        logprobs = body["choices"][0]["logprobs"]
        for token, logprob, top in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        ):
            assert token in top and top[token] == pytest.approx(logprob)
            assert max(top.values()) == pytest.approx(logprob)  # greedy picks the best
            assert 1 <= len(top) <= 4  # distinct token texts among the 3 best and the chosen


async def test_max_tokens_beyond_the_context_is_refused_as_openai_and_vllm_do():
    """Prompt plus `max_tokens` past the context is a 400 naming the field (OpenAI's message);
    an output that exactly fills the context runs, and an explicit null runs to its end."""
    async with app_client(max_model_len=32) as (client, engine):
        prompt = list(range(40, 60))
        over = await client.post(
            "/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 13}
        )
        assert over.status_code == 400
        error = over.json()["error"]
        assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
        assert error["message"].startswith("This model's maximum context length is 32 tokens.")
        assert "(20 in the prompt, 13 in the completion)" in error["message"]
        # Left out, a completion asks for 16: too many here too, as in vLLM.
        omitted = await client.post("/v1/completions", json={**GREEDY, "prompt": prompt})
        assert omitted.status_code == 400 and omitted.json()["error"]["param"] == "max_tokens"
        full = await complete(client, prompt=prompt, max_tokens=12)
        assert full["usage"]["completion_tokens"] == 12
        assert full["choices"][0]["finish_reason"] == "length"
        unbounded = await complete(client, prompt=prompt, max_tokens=None)
        assert unbounded["usage"]["completion_tokens"] == 12
        assert unbounded["choices"][0]["finish_reason"] == "length"
        assert blocks_in_use(engine) == 0


async def test_chat_messages_and_responses_refuse_an_output_past_the_context():
    """Each surface names its own field; chat with no limit runs to the end of the context."""
    messages = [{"role": "user", "content": "hi " * 8}]
    async with app_client(max_model_len=64, tokenizer=TOKENIZER) as (client, engine):
        base = {**GREEDY, "messages": messages}
        fits = await client.post("/v1/chat/completions", json=base)
        assert fits.status_code == 200, fits.text
        usage = fits.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
        room = 64 - usage["prompt_tokens"]
        for field in ("max_tokens", "max_completion_tokens"):
            over = await client.post("/v1/chat/completions", json={**base, field: room + 1})
            assert over.status_code == 400 and over.json()["error"]["param"] == field
            assert "in the messages" in over.json()["error"]["message"]
            exact = await client.post("/v1/chat/completions", json={**base, field: room})
            assert exact.status_code == 200, exact.text
        anthropic = {"model": "tiny", "messages": messages, "max_tokens": 1000}
        refused = await client.post("/v1/messages", json=anthropic)
        assert refused.status_code == 400, refused.text
        assert "maximum context length" in refused.text and "1000 in the completion" in refused.text
        response = {"model": "tiny", "input": "hi " * 8, "max_output_tokens": 1000}
        refused = await client.post("/v1/responses", json=response)
        assert refused.status_code == 400, refused.text
        assert "max_output_tokens" in refused.text
        assert blocks_in_use(engine) == 0


async def test_seed_gives_the_same_sample():
    async with app_client() as (client, _):
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": 7}
        first = await complete(client, **body)
        second = await complete(client, **body)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]


async def test_sampling_fields_vllm_accepts():
    async with app_client() as (client, _):
        body = await complete(
            client,
            prompt="Hello",
            max_tokens=6,
            temperature=0.8,
            top_p=0.9,
            top_k=20,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={"40": 2.0},
            min_tokens=2,
            stop_token_ids=[3],
            skip_special_tokens=False,
            priority=1,
            user="me",
            unknown_field="ignored",
        )
        assert body["usage"]["completion_tokens"] >= 2


async def test_logit_bias_forces_a_token():
    async with app_client() as (client, _):
        body = await complete(
            client, prompt="Hello", max_tokens=3, logit_bias={"77": 100}, logprobs=0
        )
        assert body["choices"][0]["logprobs"]["tokens"] == [TOKENIZER.decode([77])] * 3


async def stream(client, **body) -> list:
    async with client.stream(
        "POST", "/v1/completions", json={**GREEDY, **body, "stream": True}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events((await response.aread()).decode())


async def test_streaming_framing_text_and_usage():
    async with app_client() as (client, engine):
        whole = await complete(client, prompt="Hello world", max_tokens=10)
        events = await stream(
            client, prompt="Hello world", max_tokens=10, stream_options={"include_usage": True}
        )
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        text_chunks, usage_chunk = chunks[:-1], chunks[-1]
        assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
        assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
        assert all("usage" not in c for c in text_chunks)
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
        assert usage_chunk["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
        assert blocks_in_use(engine) == 0


async def test_continuous_usage_puts_the_usage_so_far_in_every_chunk():
    """vLLM's `continuous_usage_stats` (with `include_usage`): each chunk counts the tokens
    written so far; without `include_usage` it changes nothing, as in vLLM."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    async with app_client() as (client, _):
        for route, body in (
            ("/v1/completions", {"prompt": "Hello world"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ):
            full = {**GREEDY, **body, "max_tokens": 6, "stream": True, "stream_options": options}
            events = sse_events((await client.post(route, json=full)).text)[:-1]
            counts = [e["usage"]["completion_tokens"] for e in events]
            assert counts == sorted(counts) and counts[-1] == 6 and counts[-2] == 6
            assert len({e["usage"]["prompt_tokens"] for e in events}) == 1
            assert all(
                e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + n
                for e, n in zip(events, counts, strict=True)
            )
            plain = {**full, "stream_options": {"continuous_usage_stats": True}}
            events = sse_events((await client.post(route, json=plain)).text)[:-1]
            assert all("usage" not in e for e in events)


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
async def test_no_usage_chunk_unless_asked(options):
    async with app_client() as (client, _):
        extra = {} if options is None else {"stream_options": options}
        events = await stream(client, prompt="Hello", max_tokens=4, **extra)
        assert all("usage" not in e for e in events[:-1])
        assert all(e["choices"] for e in events[:-1])


async def test_streaming_n_choices_each_finish():
    async with app_client() as (client, _):
        events = await stream(
            client, prompt=["Hello", "The quick"], max_tokens=5, n=2, temperature=1.0, seed=1
        )
        finished = {}
        for event in events[:-1]:
            for choice in event["choices"]:
                assert choice["index"] not in finished, "chunk after finish"
                if choice["finish_reason"] is not None:
                    finished[choice["index"]] = choice["finish_reason"]
        assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}


async def test_streaming_echo_sends_the_prompt_first():
    async with app_client() as (client, _):
        events = await stream(client, prompt="Hello world", max_tokens=3, echo=True)
        assert events[0]["choices"][0]["text"].startswith("Hello world")


async def test_echo_of_a_token_id_prompt_is_its_decoded_text():
    async with app_client() as (client, _):
        ids = TOKENIZER("Hello world")["input_ids"]
        body = await complete(client, prompt=ids, max_tokens=2, echo=True)
        assert body["choices"][0]["text"].startswith("Hello world")


async def test_without_a_tokenizer_only_token_ids_are_served():
    async with app_client(tokenizer=None, with_tokenizer=False) as (client, _):
        text = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert text.status_code == 400 and "token ids" in text.json()["error"]["message"]
        ids = await complete(client, prompt=[40, 41, 42], max_tokens=2)
        assert ids["usage"]["completion_tokens"] == 2 and ids["choices"][0]["text"] == ""
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 400
