"""vLLM's `return_token_ids`: the prompt's token ids and each choice's generated ones beside the
text, in whole answers and streamed (the prompt's in a choice's first chunk, each chunk's new
tokens in it), for completions and chat."""

from __future__ import annotations

from collections import defaultdict

from tests.server_utils import app_client, blocks_in_use, sse_events

PROMPTS = ["Hello there", "Count: 1 2 3"]
MESSAGES = [{"role": "user", "content": "Hi there"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


async def test_completions_give_each_choice_its_prompt_and_generated_token_ids():
    async with app_client() as (client, engine):
        body = {"prompt": PROMPTS, "n": 2, "return_token_ids": True, **GREEDY}
        answer = (await client.post("/v1/completions", json=body)).json()
        for i, prompt in enumerate(PROMPTS):
            rendered = await client.post("/v1/completions/render", json={"prompt": prompt})
            [expected] = [p["token_ids"] for p in rendered.json()]
            for choice in answer["choices"][2 * i : 2 * i + 2]:
                assert choice["prompt_token_ids"] == expected
                assert len(choice["token_ids"]) == GREEDY["max_tokens"]
                text = engine.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
                assert text == choice["text"]
        generated = sum(len(c["token_ids"]) for c in answer["choices"])
        assert generated == answer["usage"]["completion_tokens"]
        plain = (await client.post("/v1/completions", json={"prompt": PROMPTS, **GREEDY})).json()
        assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
        assert blocks_in_use(engine) == 0


async def test_streamed_completions_carry_each_chunk_s_new_token_ids():
    async with app_client() as (client, _):
        body = {"prompt": PROMPTS, "return_token_ids": True, **GREEDY}
        whole = (await client.post("/v1/completions", json=body)).json()["choices"]
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        chunks = [e for e in sse_events(streamed.text) if e != "[DONE]"]
        tokens: dict[int, list[int]] = defaultdict(list)
        prompts: dict[int, list[list[int]]] = defaultdict(list)
        for chunk in chunks:
            for choice in chunk["choices"]:
                tokens[choice["index"]] += choice["token_ids"]
                if "prompt_token_ids" in choice:
                    prompts[choice["index"]].append(choice["prompt_token_ids"])
        for choice in whole:
            assert tokens[choice["index"]] == choice["token_ids"]
            assert prompts[choice["index"]] == [choice["prompt_token_ids"]]  # the first only


async def test_chat_gives_the_prompt_s_token_ids_and_each_choice_s_generated_ones():
    async with app_client() as (client, engine):
        rendered = await client.post("/v1/chat/completions/render", json={"messages": MESSAGES})
        expected = rendered.json()["token_ids"]
        body = {"messages": MESSAGES, "n": 2, "return_token_ids": True, **GREEDY}
        answer = (await client.post("/v1/chat/completions", json=body)).json()
        assert answer["prompt_token_ids"] == expected
        for choice in answer["choices"]:
            assert len(choice["token_ids"]) == GREEDY["max_tokens"]
            text = engine.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
            assert text == choice["message"]["content"]
        plain = (await client.post("/v1/chat/completions", json={"messages": MESSAGES})).json()
        assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


async def test_streamed_chat_gives_the_prompt_s_ids_first_and_then_each_chunk_s_new_ones():
    async with app_client() as (client, _):
        body = {"messages": MESSAGES, "return_token_ids": True, **GREEDY}
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [e for e in sse_events(streamed.text) if e != "[DONE]"]
        assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
        tokens = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids", [])]
        assert tokens == whole["choices"][0]["token_ids"]
