"""vLLM's extra request fields: `chat_template_kwargs`, `truncate_prompt_tokens` and
`allowed_token_ids`."""

from __future__ import annotations

import copy
import math

import pytest

from server.app import build_app
from server.cli import build_parser, server_settings
from server.settings import ServerSettings
from server.tokenization import TokenText
from tests.helpers import CHAT_TEMPLATE, chat_tokenizer, tiny_tokenizer
from tests.server.test_server_errors import assert_error
from tests.server_utils import app_client, blocks_in_use, sse_events, tiny_engine

MESSAGES = [{"role": "user", "content": "Hi there"}]
# Qwen3's switch: with enable_thinking false the template writes an empty thought.
THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
)


def thinking_tokenizer():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


async def rendered_chat(client, **body) -> list[int]:
    response = await client.post("/v1/chat/completions/render", json={"messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    return response.json()["token_ids"]


async def test_chat_template_kwargs_reach_the_template():
    tokenizer = thinking_tokenizer()
    async with app_client(tokenizer=tokenizer) as (client, engine):
        plain = await rendered_chat(client)
        thinking = await rendered_chat(client, chat_template_kwargs={"enable_thinking": True})
        quiet = await rendered_chat(client, chat_template_kwargs={"enable_thinking": False})
        assert thinking == plain
        written = tokenizer("<think></think>", add_special_tokens=False)["input_ids"]
        assert quiet == plain + written
        tokenized = await client.post(
            "/tokenize",
            json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
        )
        assert tokenized.json()["tokens"] == quiet
        answer = await client.post(
            "/v1/chat/completions",
            json={
                "messages": MESSAGES,
                "max_tokens": 3,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        assert answer.json()["usage"]["prompt_tokens"] == len(quiet)
        assert blocks_in_use(engine) == 0


async def test_chat_template_kwargs_cannot_replace_the_call_s_own_arguments():
    async with app_client(tokenizer=thinking_tokenizer()) as (client, _):
        for key in ("tokenize", "chat_template", "tools", "add_generation_prompt"):
            body = {"messages": MESSAGES, "chat_template_kwargs": {key: "x"}}
            for path in ("/v1/chat/completions", "/tokenize"):
                error = assert_error(await client.post(path, json=body), 400)
                assert error["param"] == "chat_template_kwargs" and key in error["message"]


async def test_truncate_prompt_tokens_keeps_the_last_tokens():
    prompt = list(range(5, 45))
    async with app_client(max_model_len=64) as (client, engine):
        body = {"max_tokens": 6, "temperature": 0}
        whole = await client.post("/v1/completions", json={"prompt": prompt[-10:], **body})
        cut = await client.post(
            "/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 10, **body}
        )
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["prompt_tokens"] == 10
        assert cut.json()["choices"][0]["text"] == whole.json()["choices"][0]["text"]
        [rendered] = (
            await client.post(
                "/v1/completions/render", json={"prompt": prompt, "truncate_prompt_tokens": 10}
            )
        ).json()
        assert rendered["token_ids"] == prompt[-10:]
        # -1: as many as leave room for the output asked for (one token without a limit); a
        # prompt longer than the context then runs.
        long = list(range(5, 105))
        fitted = await client.post(
            "/v1/completions", json={"prompt": long, "truncate_prompt_tokens": -1, **body}
        )
        assert fitted.status_code == 200, fitted.text
        assert fitted.json()["usage"]["prompt_tokens"] == 58
        assert fitted.json()["usage"]["completion_tokens"] == 6
        unbounded = {**body, "max_tokens": None, "truncate_prompt_tokens": -1}
        rest = await client.post("/v1/completions", json={"prompt": long, **unbounded})
        assert rest.json()["usage"]["prompt_tokens"] == 63
        assert rest.json()["choices"][0]["finish_reason"] == "length"
        assert blocks_in_use(engine) == 0


async def test_a_truncated_text_prompt_echoes_what_was_kept():
    tokenizer = tiny_tokenizer()
    text = "one two three four five six seven eight"
    ids = tokenizer(text)["input_ids"]
    async with app_client() as (client, _):
        response = await client.post(
            "/v1/completions",
            json={"prompt": text, "truncate_prompt_tokens": 3, "echo": True, "max_tokens": 1},
        )
        answer = response.json()["choices"][0]["text"]
        assert answer.startswith(tokenizer.decode(ids[-3:])) and not answer.startswith(text)
        kept = await client.post(
            "/v1/completions",
            json={"prompt": text, "truncate_prompt_tokens": 99, "echo": True, "max_tokens": 1},
        )
        assert kept.json()["choices"][0]["text"].startswith(text)


async def test_chat_prompts_truncate_too():
    async with app_client(tokenizer=thinking_tokenizer()) as (client, _):
        full = await rendered_chat(client)
        assert await rendered_chat(client, truncate_prompt_tokens=4) == full[-4:]


async def test_a_truncation_beyond_the_context_or_of_nothing_is_refused():
    async with app_client(max_model_len=64) as (client, engine):
        for keep in (65, 0, -2):
            response = await client.post(
                "/v1/completions", json={"prompt": [5, 6], "truncate_prompt_tokens": keep}
            )
            assert_error(response, 400, "truncate_prompt_tokens")
        assert blocks_in_use(engine) == 0


async def test_allowed_token_ids_are_the_only_tokens_drawn():
    tokenizer = tiny_tokenizer()
    allowed = [40, 41, 77, 120]
    texts = {TokenText(tokenizer)(token) for token in allowed}
    assert len(texts) == len(allowed)
    async with app_client() as (client, engine):
        response = await client.post(
            "/v1/completions",
            json={
                "prompt": "Hello",
                "max_tokens": 24,
                "temperature": 1.5,
                "seed": 3,
                "n": 2,
                "logprobs": 0,
                "ignore_eos": True,
                "allowed_token_ids": allowed,
            },
        )
        assert response.status_code == 200, response.text
        drawn = [t for c in response.json()["choices"] for t in c["logprobs"]["tokens"]]
        assert len(drawn) == 48 and set(drawn) <= texts and len(set(drawn)) > 1
        [rendered] = (
            await client.post(
                "/v1/completions/render", json={"prompt": "Hi", "allowed_token_ids": allowed}
            )
        ).json()
        assert rendered["sampling_params"]["allowed_token_ids"] == allowed
        assert blocks_in_use(engine) == 0


async def test_allowed_token_ids_outside_the_vocabulary_or_none_are_refused():
    async with app_client() as (client, engine):
        for allowed in ([5, 10**6], [], [-1]):
            response = await client.post(
                "/v1/completions", json={"prompt": "Hi", "allowed_token_ids": allowed}
            )
            error = assert_error(response, 400)
            assert error["param"].startswith("allowed_token_ids")  # [-1]: "allowed_token_ids.0"
        assert blocks_in_use(engine) == 0 and not engine.core.has_unfinished()


async def test_return_tokens_as_token_ids_names_each_token_by_its_id():
    token_text = TokenText(tiny_tokenizer())
    body = {"prompt": "Hello", "max_tokens": 8, "logprobs": 2, "temperature": 0}
    async with app_client() as (client, _):
        plain = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        named = (
            await client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True})
        ).json()["choices"][0]
        ids = [int(label.removeprefix("token_id:")) for label in named["logprobs"]["tokens"]]
        assert [token_text(i) for i in ids] == plain["logprobs"]["tokens"]
        assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
        for top in named["logprobs"]["top_logprobs"]:
            assert top and all(label.startswith("token_id:") for label in top)
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "messages": MESSAGES,
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 2,
                "return_tokens_as_token_ids": True,
            },
        )
        for entry in chat.json()["choices"][0]["logprobs"]["content"]:
            entries = [entry, *entry["top_logprobs"]]
            assert all(e["token"].startswith("token_id:") for e in entries)
            assert all(e["bytes"] == list(e["token"].encode()) for e in entries)


async def test_prompt_logprobs_score_every_prompt_token_as_echo_does():
    prompt = list(range(5, 15))
    async with app_client() as (client, engine):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        scored = await client.post("/v1/completions", json={**body, "prompt_logprobs": 2, "n": 2})
        echoed = await client.post("/v1/completions", json={**body, "echo": True, "logprobs": 1})
        assert scored.status_code == 200, scored.text
        echo_logprobs = echoed.json()["choices"][0]["logprobs"]
        for choice in scored.json()["choices"]:
            shown = choice["prompt_logprobs"]
            assert len(shown) == len(prompt) and shown[0] is None
            for position, token, expected in zip(
                shown[1:], prompt[1:], echo_logprobs["token_logprobs"][1:10], strict=True
            ):
                own = position[str(token)]
                assert own["logprob"] == pytest.approx(expected, abs=1e-5)
                rivals = sorted(position.values(), key=lambda entry: entry["rank"])
                assert rivals[0]["rank"] == 1 and len(position) <= 3
                assert rivals[0]["logprob"] == max(e["logprob"] for e in position.values())
                assert {e["decoded_token"] for e in position.values()} >= {own["decoded_token"]}
        # Echo keeps its own count of rivals when prompt_logprobs asks for more.
        both = await client.post(
            "/v1/completions",
            json={**body, "echo": True, "logprobs": 1, "prompt_logprobs": 4},
        )
        choice = both.json()["choices"][0]
        assert choice["logprobs"]["top_logprobs"][1:10] == echo_logprobs["top_logprobs"][1:10]
        assert max(len(p) for p in choice["prompt_logprobs"][1:]) == 5
        assert blocks_in_use(engine) == 0


async def test_chat_prompt_logprobs_cover_the_templated_prompt():
    async with app_client() as (client, _):
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                  "prompt_logprobs": 0},
        )  # fmt: skip
        body = response.json()
        shown = body["prompt_logprobs"]
        assert len(shown) == body["usage"]["prompt_tokens"] and shown[0] is None
        assert all(len(position) == 1 for position in shown[1:])


async def test_prompt_logprobs_cannot_stream():
    async with app_client() as (client, engine):
        response = await client.post(
            "/v1/completions", json={"prompt": "Hi", "stream": True, "prompt_logprobs": 1}
        )
        assert_error(response, 400, "prompt_logprobs")
        assert blocks_in_use(engine) == 0


def bos_tokenizer():
    """The chat tokenizer with a BOS written before every encoded text."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = chat_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)]
    )
    return tokenizer, bos


async def test_add_special_tokens_as_vllm_defaults_it():
    tokenizer, bos = bos_tokenizer()
    async with app_client(tokenizer=tokenizer) as (client, _):
        [with_bos] = (await client.post("/v1/completions/render", json={"prompt": "Hi"})).json()
        [without] = (
            await client.post(
                "/v1/completions/render", json={"prompt": "Hi", "add_special_tokens": False}
            )
        ).json()
        assert with_bos["token_ids"] == [bos, *without["token_ids"]]
        chat = await rendered_chat(client)
        assert chat[0] != bos  # the template writes what it wants
        assert await rendered_chat(client, add_special_tokens=True) == [bos, *chat]
        tokenized = await client.post(
            "/tokenize", json={"messages": MESSAGES, "add_special_tokens": True}
        )
        assert tokenized.json()["tokens"] == [bos, *chat]


# gpt-oss's templates read how hard to think from `reasoning_effort`.
EFFORT_TEMPLATE = CHAT_TEMPLATE + (
    "{% if reasoning_effort is defined %}[effort={{ reasoning_effort }}]{% endif %}"
)


async def test_reasoning_effort_reaches_the_template_from_every_api():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = EFFORT_TEMPLATE

    def written(effort: str) -> list[int]:
        return tokenizer(f"[effort={effort}]", add_special_tokens=False)["input_ids"]

    async with app_client(tokenizer=tokenizer) as (client, engine):
        plain = await rendered_chat(client)
        assert await rendered_chat(client, reasoning_effort="high") == plain + written("high")
        # chat_template_kwargs, the more specific, wins.
        both = await rendered_chat(
            client, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}
        )
        assert both == plain + written("low")
        response = await client.post(
            "/v1/responses",
            json={"input": "Hi there", "reasoning": {"effort": "low"}, "max_output_tokens": 2},
        )
        responses_plain = await client.post(
            "/v1/responses", json={"input": "Hi there", "max_output_tokens": 2}
        )
        grown = response.json()["usage"]["input_tokens"]
        assert grown == responses_plain.json()["usage"]["input_tokens"] + len(written("low"))
        counted = await client.post(
            "/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "Hi"}]}
        )
        message = await client.post(
            "/v1/messages",
            json={
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hi"}],
                "output_config": {"effort": "max"},
            },
        )
        usage = message.json()["usage"]
        seen = usage["input_tokens"] + usage["cache_read_input_tokens"]
        assert seen == counted.json()["input_tokens"] + len(written("xhigh"))
        for path, body, param in [
            ("/v1/chat/completions/render", {"messages": MESSAGES, "reasoning_effort": "x"}, None),
            ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "x"}}, "reasoning.effort"),
        ]:
            refused = await client.post(path, json=body)
            assert refused.status_code == 400, refused.text
            if param is not None:
                assert refused.json()["error"]["param"] == param
        assert blocks_in_use(engine) == 0


async def test_the_most_logprobs_a_request_may_ask_for_is_the_server_s():
    """vLLM's `--max-logprobs`: 20 by default, as OpenAI's chat limit; more is a 400 naming the
    field and the limit, whatever the route; a server started with a higher limit returns
    that many, and -1 lets a request ask for the whole vocabulary."""
    completion = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    chat = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True}
    async with app_client() as (client, engine):
        for route, body, field in (
            ("/v1/completions", {**completion, "logprobs": 21}, "logprobs"),
            ("/v1/completions", {**completion, "prompt_logprobs": 21}, "prompt_logprobs"),
            ("/v1/chat/completions", {**chat, "top_logprobs": 21}, "top_logprobs"),
        ):
            reply = await client.post(route, json=body)
            assert_error(reply, 400, field, "greater than max allowed: 20")
        assert blocks_in_use(engine) == 0
    named = {**completion, "return_tokens_as_token_ids": True}  # one key per token id
    async with app_client(max_logprobs=50) as (client, _):
        reply = await client.post("/v1/completions", json={**named, "logprobs": 30})
        assert reply.status_code == 200, reply.text
        tops = reply.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert [len(top) for top in tops] == [30, 30]
    async with app_client(max_logprobs=-1) as (client, engine):
        vocabulary = engine.core.vocab_size
        reply = await client.post("/v1/completions", json={**named, "logprobs": vocabulary})
        assert reply.status_code == 200, reply.text
        tops = reply.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert [len(top) for top in tops] == [vocabulary, vocabulary]


async def test_chat_echo_starts_a_continued_message_with_that_message():
    """vLLM's `echo`: with `continue_final_message`, the reply's content is the last (assistant)
    message and its continuation, whole or streamed; a reply in a new turn echoes nothing."""
    prefix = "The answer is"
    continued = [*MESSAGES, {"role": "assistant", "content": prefix}]
    body = {
        "messages": continued,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with app_client(tokenizer=chat_tokenizer()) as (client, engine):
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        echoed = (await client.post("/v1/chat/completions", json={**body, "echo": True})).json()
        continuation = plain["choices"][0]["message"]["content"]
        assert echoed["choices"][0]["message"]["content"] == prefix + continuation
        usage = ("prompt_tokens", "completion_tokens")
        assert [echoed["usage"][k] for k in usage] == [plain["usage"][k] for k in usage]
        streamed = await client.post(
            "/v1/chat/completions", json={**body, "echo": True, "stream": True}
        )
        deltas = [e["choices"][0]["delta"] for e in sse_events(streamed.text) if e != "[DONE]"]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("content") or "" for d in deltas) == prefix + continuation
        new_turn = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "echo": True}
        fresh = (await client.post("/v1/chat/completions", json=new_turn)).json()
        unechoed = {**new_turn, "echo": False}
        alone = (await client.post("/v1/chat/completions", json=unechoed)).json()
        assert fresh["choices"][0]["message"] == alone["choices"][0]["message"]
        assert blocks_in_use(engine) == 0


async def test_server_wide_template_kwargs_sit_under_each_request_s_own():
    """vLLM's `--default-chat-template-kwargs`: every chat request (and a chat /tokenize) renders
    with them, a request's own `chat_template_kwargs` win; one that names the template call's own
    arguments stops the start."""
    argv = ["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}']
    settings = server_settings(build_parser().parse_args(argv))
    assert settings.default_chat_template_kwargs == {"enable_thinking": False}
    async with app_client(tokenizer=thinking_tokenizer()) as (client, _):
        plain = await rendered_chat(client)
        quiet = await rendered_chat(client, chat_template_kwargs={"enable_thinking": False})
    async with app_client(settings, tokenizer=thinking_tokenizer()) as (client, _):
        assert await rendered_chat(client) == quiet
        assert await rendered_chat(client, chat_template_kwargs={"enable_thinking": True}) == plain
        tokenized = await client.post("/tokenize", json={"messages": MESSAGES})
        assert tokenized.json()["tokens"] == quiet
    clashing = ServerSettings(served_model_name="tiny", default_chat_template_kwargs={"tools": []})
    with pytest.raises(ValueError, match="--default-chat-template-kwargs cannot set tools"):
        build_app(tiny_engine(tokenizer=thinking_tokenizer()), clashing)


async def test_processed_logprobs_show_the_tokens_top_k_rules_out_at_minus_9999():
    """`--logprobs-mode processed_logprobs`: a completion's top logprobs past its top-k are
    -9999 (JSON has no -inf), and those within it make up the whole distribution. (Tokens as
    ids: two byte tokens may both read as one replacement character, one key.)"""
    async with app_client(logprobs_mode="processed_logprobs") as (client, _):
        body = {
            "prompt": "Hello",
            "max_tokens": 3,
            "top_k": 2,
            "temperature": 1.0,
            "seed": 3,
            "return_tokens_as_token_ids": True,
        }
        reply = await client.post("/v1/completions", json={**body, "logprobs": 4})
    assert reply.status_code == 200, reply.text
    for top in reply.json()["choices"][0]["logprobs"]["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        assert values[2:] == [-9999.0] * (len(values) - 2)
        assert sum(math.exp(v) for v in values[:2]) == pytest.approx(1.0, abs=1e-4)


# A template that grounds its answer in documents, as Command R's and Granite's do.
DOCUMENTS_TEMPLATE = (
    "{% for d in documents or [] %}<doc {{ d.title }}>{{ d.text }}</doc>\n{% endfor %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
)
DOCUMENTS = [{"title": "Oslo", "text": "Rain all week."}, {"title": "Rome", "text": "Sun."}]


async def test_documents_reach_a_grounded_template():
    """vLLM's `documents`: the template writes them (chat, its render and /tokenize alike)."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = DOCUMENTS_TEMPLATE
    messages = [{"role": "user", "content": "Weather?"}]
    async with app_client(tokenizer=tokenizer) as (client, engine):
        counted = await client.post(
            "/tokenize", json={"model": "tiny", "messages": messages, "documents": DOCUMENTS}
        )
        assert counted.status_code == 200, counted.text
        text = tokenizer.decode(counted.json()["tokens"])
        assert text.startswith("<doc Oslo>Rain all week.</doc>\n<doc Rome>Sun.</doc>\n<|user|>")
        body = {"model": "tiny", "messages": messages, "documents": DOCUMENTS, "max_tokens": 2}
        rendered = await client.post("/v1/chat/completions/render", json=body)
        assert rendered.json()["token_ids"] == counted.json()["tokens"]
        plain = await client.post("/v1/chat/completions", json={**body, "documents": None})
        grounded = await client.post("/v1/chat/completions", json=body)
        assert grounded.json()["usage"]["prompt_tokens"] == counted.json()["count"]
        assert plain.json()["usage"]["prompt_tokens"] < counted.json()["count"]
        bad = await client.post("/v1/chat/completions", json={**body, "documents": [{"a": 1}]})
        assert_error(bad, 400, "documents.0.a")
        assert blocks_in_use(engine) == 0
