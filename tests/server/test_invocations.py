"""SageMaker's routes as vLLM serves them: `/invocations` answers a chat, completion,
embedding or classification request as that API's own route does, told apart by its fields,
and `/ping` answers as `/health`."""

from __future__ import annotations

import pytest

from server.settings import ServerSettings
from tests.server.test_classify import TEXTS, classifier_client, classifier_dir  # noqa: F401
from tests.server.test_server_errors import assert_error
from tests.server_utils import app_client, blocks_in_use, sse_events

MESSAGES = [{"role": "user", "content": "Hi there"}]
GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}


def without_ids(body: dict) -> dict:
    """The answer less what differs between any two answers (its id and time, and the
    prompt's cached tokens: the second finds the first's)."""
    kept = {key: value for key, value in body.items() if key not in ("id", "created")}
    kept["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return kept


async def test_a_chat_or_completion_body_is_answered_as_its_own_route_answers():
    async with app_client() as (client, engine):
        for path, body in (
            ("/v1/chat/completions", {"messages": MESSAGES, **GREEDY}),
            ("/v1/completions", {"prompt": "Hello there", **GREEDY}),
        ):
            own = await client.post(path, json=body)
            invoked = await client.post("/invocations", json=body)
            assert invoked.status_code == 200, invoked.text
            assert without_ids(invoked.json()) == without_ids(own.json())
        streamed = await client.post(
            "/invocations", json={"messages": MESSAGES, **GREEDY, "stream": True}
        )
        events = sse_events(streamed.text)
        assert events[-1] == "[DONE]" and events[0]["object"] == "chat.completion.chunk"
        assert blocks_in_use(engine) == 0


async def test_an_input_body_is_an_embedding_under_the_pooling_runner():
    async with app_client(runner="pooling") as (client, _):
        body = {"input": ["Hello there", "Count: 1 2 3"]}
        own = (await client.post("/v1/embeddings", json=body)).json()
        invoked = (await client.post("/invocations", json=body)).json()
        assert invoked["object"] == "list" and len(invoked["data"]) == len(own["data"]) == 2
        # The second request reads the first's cached prefix, which may move the last float
        # bits on some CPUs' kernels.
        for mine, theirs in zip(invoked["data"], own["data"], strict=True):
            assert mine["index"] == theirs["index"]
            assert mine["embedding"] == pytest.approx(theirs["embedding"], abs=1e-5)
        refused = await client.post("/invocations", json={"messages": MESSAGES})
        assert_error(refused, 400, text="--runner pooling")


async def test_an_input_body_is_a_classification_for_a_classifier(classifier_dir):  # noqa: F811
    async with classifier_client(classifier_dir) as (client, _):
        own = (await client.post("/classify", json={"input": TEXTS})).json()
        invoked = (await client.post("/invocations", json={"input": TEXTS})).json()
        assert invoked["data"] == own["data"]


async def test_a_body_that_is_no_request_is_refused_by_what_is_wrong():
    async with app_client() as (client, engine):
        wrong = await client.post("/invocations", json={"messages": MESSAGES, "max_tokens": 0})
        assert_error(wrong, 400, param="max_tokens")
        assert_error(await client.post("/invocations", json={"model": "tiny"}), 400, text="chat")
        assert_error(await client.post("/invocations", json=[1, 2]), 400, text="JSON object")
        garbled = await client.post(
            "/invocations", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert_error(garbled, 400, text="not valid JSON")
        assert blocks_in_use(engine) == 0


async def test_ping_answers_as_health_and_stays_open_under_an_api_key():
    async with app_client(ServerSettings(served_model_name="tiny", api_key="k")) as (client, _):
        for method in ("GET", "POST"):
            response = await client.request(method, "/ping")
            assert response.status_code == 200 and response.json() == {"status": "ok"}
        body = {"prompt": "Hello", "max_tokens": 2}
        assert (await client.post("/invocations", json=body)).status_code == 401
        keyed = await client.post("/invocations", json=body, headers={"Authorization": "Bearer k"})
        assert keyed.status_code == 200
