"""Beam search (`use_beam_search`): with end-of-sequence tokens ignored the beams equal
transformers' `generate(num_beams=n)`; with them, the beams equal vLLM's algorithm run here
on transformers' logits (finished beams set aside, ranked by logprob over length to the power
`length_penalty`); chat and streams take it; what it cannot honour is refused."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch

from tests.helpers import tiny_llama, transformers_attention
from tests.server_utils import (
    app_client,
    blocks_in_use,
    live_server,
    shared_tiny_model,
    sse_events,
    until,
)

PROMPT = [5, 9, 33, 2, 17, 40]


def completions_body(**fields) -> dict:
    return {
        "model": "tiny",
        "prompt": PROMPT,
        "use_beam_search": True,
        "return_token_ids": True,
        **fields,
    }


async def test_without_eos_the_beams_are_transformers_beams() -> None:
    model = shared_tiny_model()
    with transformers_attention(model):
        expected = model.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            num_beams=3,
            num_return_sequences=3,
            do_sample=False,
            max_new_tokens=7,
            eos_token_id=None,
            pad_token_id=0,
            length_penalty=1.0,
        )[:, len(PROMPT) :].tolist()
    async with app_client() as (client, engine):
        body = completions_body(n=3, max_tokens=7, ignore_eos=True)
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [c["token_ids"] for c in choices] == expected
        assert all(c["finish_reason"] == "length" for c in choices)
        assert response.json()["usage"]["completion_tokens"] == 21
        assert blocks_in_use(engine) == 0


def reference_beams(model, prompt, width, max_tokens, penalty, eos):
    """vLLM's beam search, every round run, on transformers' logits."""
    live: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float, bool]] = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, logprob in live:
            with torch.no_grad(), transformers_attention(model):
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if token in eos:
                    finished.append((tokens, logprob + value, True))
                else:
                    candidates.append(([*tokens, token], logprob + value))
        candidates.sort(key=lambda c: c[1], reverse=True)
        live = candidates[:width]
    every = finished + [(tokens, logprob, False) for tokens, logprob in live]
    every.sort(key=lambda b: b[1] / (len(prompt) + len(b[0])) ** penalty, reverse=True)
    return [(tokens, ended) for tokens, _, ended in every[:width]]


@pytest.fixture(scope="module")
def eos_model():
    """The tiny model with a second end-of-sequence token: the one it ranks second after the
    prompt, so that beams end early."""
    model = copy.deepcopy(tiny_llama())
    with torch.no_grad(), transformers_attention(model):
        logits = model(torch.tensor([PROMPT])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    model.generation_config.eos_token_id = [0, second]
    return model, {0, second}


@pytest.mark.parametrize("penalty", [1.0, 0.0, -0.5])
async def test_finished_beams_follow_vllms_algorithm(eos_model, penalty: float) -> None:
    model, eos = eos_model
    expected = reference_beams(model, PROMPT, 3, 10, penalty, eos)
    assert any(ended for _, ended in expected)  # the test sees beams end
    async with app_client(model=model) as (client, engine):
        body = completions_body(n=3, max_tokens=10, length_penalty=penalty)
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [(c["token_ids"], c["finish_reason"] == "stop") for c in choices] == expected
        for choice, (tokens, ended) in zip(choices, expected, strict=True):
            assert choice["text"] == engine.tokenizer.decode(tokens, skip_special_tokens=True)
            assert (choice["stop_reason"] in eos) if ended else choice["stop_reason"] is None
        assert blocks_in_use(engine) == 0


async def test_chat_takes_beam_search_streamed_or_not() -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "use_beam_search": True,
        "n": 2,
        "max_tokens": 5,
        "ignore_eos": True,
    }
    async with app_client() as (client, engine):
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        contents = [c["message"]["content"] for c in whole["choices"]]
        assert len(contents) == 2 and contents[0] != contents[1]
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [e for e in sse_events(streamed.text) if e != "[DONE]"]
        joined = ["", ""]
        for event in events:
            for choice in event["choices"]:
                joined[choice["index"]] += choice["delta"].get("content") or ""
        assert joined == contents
        assert blocks_in_use(engine) == 0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 11}, "n"),  # 22 tokens a step, over --max-logprobs 20
    ],
)
async def test_what_beam_search_cannot_honour_is_refused(fields: dict, param: str) -> None:
    async with app_client() as (client, engine):
        response = await client.post("/v1/completions", json=completions_body(**fields))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert blocks_in_use(engine) == 0 and (await client.get("/health")).status_code == 200


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
async def test_beam_search_is_refused_where_logprobs_are_logits(mode: str) -> None:
    async with app_client(logprobs_mode=mode) as (client, _):
        response = await client.post("/v1/completions", json=completions_body())
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "use_beam_search"
    assert f"--logprobs-mode {mode}" in response.json()["error"]["message"]


async def test_a_client_that_leaves_mid_search_stops_it(monkeypatch) -> None:
    """The search ends with the client: no more rounds are sent, no request stays queued or
    running, and every block returns."""
    body = completions_body(n=4, max_tokens=400, ignore_eos=True)
    async with live_server() as server, httpx.AsyncClient() as client:
        engine = server.engine
        sent = []
        submit = engine.submit
        monkeypatch.setattr(engine, "submit", lambda *a, **k: sent.append(1) or submit(*a, **k))
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
        seen = [-1]

        def settled() -> bool:  # no request sent since the last look
            settled, seen[0] = seen[0] == len(sent), len(sent)
            return settled and not engine.core.has_unfinished()

        await until(settled, timeout=30, what="a search that sends no more rounds")
        assert 0 < len(sent) < 400 * 4  # it stopped before its last round
        assert blocks_in_use(engine) == 0
