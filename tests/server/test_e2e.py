"""A real `conveyor serve` process on the default model, driven by the official OpenAI SDK."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel

from tests.server_utils import server_process

pytestmark = [pytest.mark.e2e, pytest.mark.default_model]
MODEL = "SmolLM2-135M-Instruct"


def start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    """`python -m server` on a free port; returns once /health answers 200 (the first start
    fetches and converts the model)."""
    options = ["--dtype", "float32", "--kv-cache-memory", "256MiB"]
    return server_process(*options, *extra, timeout=600)


def stop_server(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGTERM)
    log = process.communicate(timeout=60)[0]
    assert process.returncode == 0, log
    # What was frozen out of the collector at start-up is given back: nothing is reported
    # leaked at exit (Triton's bindings listed each object still alive).
    assert "leaked" not in log, log[-2000:]
    return log


@pytest.fixture(scope="module")
def server():
    process, url = start_server("--shutdown-timeout", "5")
    yield url
    log = stop_server(process)
    assert "KV cache:" in log and "serving" in log


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not found")


def test_models_lists_the_default_model(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_answer_and_usage(server):
    reply = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=30,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_completion_n2_logprobs_seed(server):
    kwargs = dict(
        model=MODEL,
        prompt="The weather today is",
        max_tokens=8,
        n=2,
        logprobs=2,
        seed=123,
        temperature=1.0,
    )
    first = client(server).completions.create(**kwargs)
    second = client(server).completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    for choice in first.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert all(len(top) >= 1 for top in choice.logprobs.top_logprobs)
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)


class Capital(BaseModel):
    country: str
    capital: str
    population_millions: int


def test_sdk_parse_returns_the_pydantic_object(server):
    """The OpenAI SDK's `parse`: the schema of a pydantic model in `response_format`, the
    reply parsed back into that model."""
    reply = client(server).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=80,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Capital), reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_responses_answer_as_chat_does(server):
    """The Responses API (`client.responses`) on the real model and template: the answer chat
    gives for the same conversation, and `parse` into a pydantic model."""
    api = client(server)
    reply = api.responses.create(
        model=MODEL,
        instructions="Answer in one short sentence.",
        input="What is the capital of France?",
        temperature=0,
        max_output_tokens=30,
    )
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        temperature=0,
        max_tokens=30,
    )
    assert reply.status == "completed" and "Paris" in reply.output_text
    assert reply.output_text == chat.choices[0].message.content
    parsed = api.responses.parse(
        model=MODEL,
        input="Give the capital of France as JSON.",
        text_format=Capital,
        temperature=0,
        max_output_tokens=80,
    )
    assert isinstance(parsed.output_parsed, Capital), parsed.output_text


def test_json_object_returns_an_object(server):
    reply = client(server).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Reply with a JSON object with the keys city and country."}
        ],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=300,
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FIRST_CHOICE = {
    "named": {"type": "function", "function": {"name": "get_weather"}},
    "required": "required",
}


def ask(url: str, messages: list, tool_choice, stream: bool, **extra):
    """One chat turn with the weather tool; streamed through the SDK's stream helper, which
    assembles the deltas into a completion."""
    kwargs = dict(
        model=MODEL,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=40,
        **extra,
    )
    if not stream:
        return client(url).chat.completions.create(**kwargs)
    with client(url).chat.completions.stream(
        stream_options={"include_usage": True}, **kwargs
    ) as events:
        return events.get_final_completion()


def check_answer(reply) -> None:
    """A well-formed turn: calls (each to the tool, with arguments that fit) iff the finish
    reason says so, else text."""
    choice = reply.choices[0]
    calls = choice.message.tool_calls or []
    assert (choice.finish_reason == "tool_calls") == bool(calls), choice
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert calls or choice.message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("first", ["named", "required"])
def test_a_tool_loop_call_result_answer(server, first: str, stream: bool):
    """The default model's template has no tool section, so the tools are written into the
    prompt; a forced first turn calls the tool, the result goes back, the model answers."""
    reply = ask(server, QUESTION, FIRST_CHOICE[first], stream)
    check_answer(reply)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].message.content is None
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 14}'}
    turn = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        result,
    ]
    answer = ask(server, turn, "auto", stream)
    check_answer(answer)
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens
    # The first turn's prompt is a prefix of the second's: prefix caching reuses it.
    assert answer.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens // 2


def test_auto_decides_the_same_streamed_or_not(server):
    """Under auto the model may answer or call; the stream assembles the same message. The
    written tools are part of the prompt."""
    whole = ask(server, QUESTION, "auto", False)
    streamed = ask(server, QUESTION, "auto", True)
    bare = client(server).chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=1
    )
    for reply in (whole, streamed):
        check_answer(reply)
    message, again = whole.choices[0].message, streamed.choices[0].message
    assert (message.content, message.tool_calls and [c.function for c in message.tool_calls]) == (
        again.content,
        again.tool_calls and [c.function for c in again.tool_calls],
    )
    assert whole.usage.prompt_tokens > bare.usage.prompt_tokens + 50


def test_streamed_chat_with_usage(server):
    stream = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=1,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def test_streamed_completion_text_equals_non_streamed(server):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client(server).completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client(server).completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == whole


def test_32_concurrent_streams_complete_and_leave_the_cache_empty(server):
    async def one(api: AsyncOpenAI, i: int) -> tuple[int, int]:
        stream = await api.completions.create(
            model=MODEL,
            prompt=f"Request {i}: write a number",
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        tokens_seen = 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            tokens_seen += bool(chunk.choices)
        assert usage is not None
        return usage.completion_tokens, tokens_seen

    async def all_of_them():
        api = AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(api, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert all(completion == 24 for completion, _ in results)
    assert all(1 <= seen <= 24 for _, seen in results)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def test_sigterm_lets_running_requests_finish_and_exits_0():
    """Also with JSON logs: uvicorn's records and a line for the finished request."""
    process, url = start_server("--shutdown-timeout", "20", "--log-format", "json")
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(
                client(url).completions.create,
                model=MODEL,
                prompt="Count:",
                max_tokens=20,
                extra_body={"ignore_eos": True},
            )
            deadline = time.monotonic() + 30
            while metric(url, "vllm:num_requests_running") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            answer = running.result(timeout=60)
        assert answer.usage.completion_tokens == 20
        assert answer.choices[0].finish_reason == "length"
        log = process.communicate(timeout=60)[0]
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert any(r["logger"].startswith("uvicorn") for r in records)
    [request] = [r for r in records if r.get("event") == "request"]
    assert request["status"] == 200 and request["completion_tokens"] == 20
    assert request["response_id"] == answer.id and request["finish_reasons"] == ["length"]
    assert request["e2e_s"] >= request["ttft_s"] > 0


def test_sigterm_ends_what_outlasts_the_shutdown_timeout_with_a_503():
    process, url = start_server("--shutdown-timeout", "2")
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 2000, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(2) as pool:

            def stream_events() -> list[str]:
                with httpx.stream(
                    "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
                ) as reply:
                    return [line for line in reply.iter_lines() if line.startswith("data: ")]

            streaming = pool.submit(stream_events)
            whole = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
            deadline = time.monotonic() + 30
            while metric(url, "vllm:num_requests_running") < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=60)
            events, reply = streaming.result(timeout=60), whole.result(timeout=60)
        assert process.returncode == 0
        # The stream ends with an error event and [DONE], cut short of its 2000 tokens.
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "shut down" in error["message"] and error["code"] == "engine_unavailable"
        assert 0 < len(events) - 2 < 2000
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "engine_unavailable"
    finally:
        if process.poll() is None:
            process.kill()
