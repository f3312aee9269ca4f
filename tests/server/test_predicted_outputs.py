"""OpenAI's Predicted Outputs on /v1/chat/completions: a `prediction` leaves the reply as it
is, writes it in fewer steps where they agree, and the usage says how many of its tokens were
kept and refused, streamed or not, through the OpenAI SDK too."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from tests.server_utils import app_client, live_server, sse_events

BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hello there, how are you?"}],
    "temperature": 0,
    "max_tokens": 30,
    "ignore_eos": True,
}


async def _reply(client, **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json={**BODY, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def _details(reply: dict[str, Any]) -> tuple[int, int]:
    details = reply["usage"]["completion_tokens_details"]
    return details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]


async def test_a_prediction_leaves_the_reply_and_counts_its_tokens_kept_and_refused():
    async with app_client() as (client, _):
        plain = await _reply(client)
        text = plain["choices"][0]["message"]["content"]
        assert "completion_tokens_details" not in plain["usage"]
        exact = await _reply(client, prediction={"type": "content", "content": text})
        edited = text[: len(text) // 2] + " something else entirely " + text[len(text) // 2 :]
        parts = [{"type": "text", "text": edited[:7]}, {"type": "text", "text": edited[7:]}]
        changed = await _reply(client, prediction={"type": "content", "content": parts})
    for reply in (exact, changed):
        assert reply["choices"] == plain["choices"]
        assert reply["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    # The prediction's tokens are its text's own; this random model writes some words in
    # other pieces than the tokenizer would (tests/core/test_prediction.py counts exactly).
    exact_kept, exact_refused = _details(exact)
    kept, refused = _details(changed)
    assert exact_kept > kept > 0 and refused > exact_refused


async def test_a_streamed_reply_ends_with_the_prediction_s_usage():
    async with app_client() as (client, _):
        plain = await _reply(client)
        text = plain["choices"][0]["message"]["content"]
        response = await client.post(
            "/v1/chat/completions",
            json={
                **BODY,
                "prediction": {"type": "content", "content": text},
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    events = sse_events(response.text)[:-1]
    streamed = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
    )
    assert streamed == text
    assert _details(events[-1]) == _details(await _exact(text))


async def _exact(text: str) -> dict[str, Any]:
    async with app_client() as (client, _):
        return await _reply(client, prediction={"type": "content", "content": text})


async def test_the_openai_sdk_reads_the_prediction_s_usage():
    async with live_server() as server:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        extra = {"ignore_eos": True}
        plain = await client.chat.completions.create(
            model="tiny",
            messages=BODY["messages"],
            temperature=0,
            max_tokens=30,
            extra_body=extra,
        )
        text = plain.choices[0].message.content or ""
        predicted = await client.chat.completions.create(
            model="tiny",
            messages=BODY["messages"],
            temperature=0,
            max_tokens=30,
            prediction={"type": "content", "content": text},
            extra_body=extra,
        )
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details if predicted.usage else None
    assert details is not None and details.accepted_prediction_tokens
    assert details.rejected_prediction_tokens is not None


async def test_a_prediction_of_another_type_or_longer_than_the_context_is_refused():
    async with app_client(max_model_len=64) as (client, engine):
        for prediction, param in [
            ({"type": "text", "content": "x"}, "prediction"),
            ({"type": "content", "content": 3}, "prediction"),
            ({"type": "content", "content": "word " * 5000}, "prediction"),
        ]:
            response = await client.post(
                "/v1/chat/completions", json={**BODY, "prediction": prediction}
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"].startswith(param), error
        assert (await client.get("/health")).status_code == 200
        assert engine.core.scheduler.block_manager.num_used_blocks == 0
