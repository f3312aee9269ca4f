"""/v1/batches through the unmodified OpenAI SDK: a batch validated up front, run in the
background through the same routes as live requests, its output and error files holding every
custom_id once; cancelled, listed, and resumed after the server stops mid-run."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from server.settings import ServerSettings
from tests.server_utils import live_server

BODY = {"model": "tiny", "max_tokens": 4, "temperature": 0}


def line(custom_id: str, prompt: str, url: str = "/v1/completions", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {**BODY, "prompt": prompt, **body},
    }


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(item) + "\n" for item in lines).encode()


def sdk(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def submit(client: AsyncOpenAI, lines: list[dict], endpoint: str = "/v1/completions"):
    upload = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return await client.batches.create(
        input_file_id=upload.id, endpoint=endpoint, completion_window="24h"
    )


async def until_done(client: AsyncOpenAI, batch_id: str, timeout: float = 60):
    for _ in range(int(timeout / 0.05)):
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not finish")


async def file_lines(client: AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = (await client.files.content(file_id)).content
    return [json.loads(item) for item in content.decode().splitlines()]


async def test_a_batch_runs_every_line_as_the_same_request_alone(tmp_path):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    lines = [line(f"req-{i}", f"Story {i}:") for i in range(6)]
    lines.append(line("refused", "Hi", stop=["x"] * 100))  # past the stop-string limit: a 400
    async with live_server(settings) as server, httpx.AsyncClient() as http:
        client = sdk(server.url)
        created = await submit(client, lines)
        assert created.status == "in_progress" and created.request_counts.total == 7
        batch = await until_done(client, created.id)
        assert batch.status == "completed"
        assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 1)
        assert batch.completed_at >= batch.in_progress_at >= batch.created_at
        outputs = await file_lines(client, batch.output_file_id)
        errors = await file_lines(client, batch.error_file_id)
        metrics = (await http.get(f"{server.url}/metrics")).text
        assert 'conveyor:batches{status="completed"} 1.0' in metrics
        assert 'conveyor:batch_lines{state="completed"} 6.0' in metrics
        assert 'conveyor:batch_lines{state="failed"} 1.0' in metrics
        assert 'conveyor:batch_tokens_total{kind="generation"} 24.0' in metrics
        assert sorted(o["custom_id"] for o in outputs) == [f"req-{i}" for i in range(6)]
        [refused] = errors
        assert refused["custom_id"] == "refused" and refused["response"]["status_code"] == 400
        for output in outputs:
            assert output["response"]["status_code"] == 200
            prompt = f"Story {output['custom_id'].split('-')[1]}:"
            alone = await http.post(f"{server.url}/v1/completions", json={**BODY, "prompt": prompt})
            texts = [c["text"] for c in output["response"]["body"]["choices"]]
            assert texts == [c["text"] for c in alone.json()["choices"]]


async def test_a_responses_batch_answers_as_the_requests_alone(tmp_path):
    """Lines for /v1/responses: each answer the one the same request gets alone, kept out of
    the response store unless the line asks, and counted in the batch's tokens."""
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    body = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}
    lines = [
        {
            "custom_id": f"r-{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {**body, "input": f"Story {i}:"},
        }
        for i in range(3)
    ]
    lines[2]["body"]["store"] = True
    async with live_server(settings) as server, httpx.AsyncClient() as http:
        client = sdk(server.url)
        batch = await until_done(client, (await submit(client, lines, "/v1/responses")).id)
        assert batch.status == "completed" and batch.request_counts.completed == 3
        outputs = {
            o["custom_id"]: o["response"]["body"]
            for o in await file_lines(client, batch.output_file_id)
        }
        for i in range(3):
            alone = await http.post(
                f"{server.url}/v1/responses", json={**body, "input": f"Story {i}:", "store": False}
            )
            assert outputs[f"r-{i}"]["output"][0]["content"] == alone.json()["output"][0]["content"]
            stored = await http.get(f"{server.url}/v1/responses/{outputs[f'r-{i}']['id']}")
            assert stored.status_code == (200 if i == 2 else 404)
        metrics = (await http.get(f"{server.url}/metrics")).text
        assert 'conveyor:batch_tokens_total{kind="generation"} 12.0' in metrics


async def test_an_embeddings_batch_answers_as_the_requests_alone(tmp_path):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    lines = [
        {
            "custom_id": f"e-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": f"Story {i}"},
        }
        for i in range(3)
    ]
    async with live_server(settings, runner="pooling") as server, httpx.AsyncClient() as http:
        client = sdk(server.url)
        batch = await until_done(client, (await submit(client, lines, "/v1/embeddings")).id)
        assert batch.status == "completed" and batch.request_counts.completed == 3
        for output in await file_lines(client, batch.output_file_id):
            text = f"Story {output['custom_id'].split('-')[1]}"
            alone = await http.post(f"{server.url}/v1/embeddings", json={"input": text})
            # The same vector up to the last bits (batched beside others, or read from the cache).
            [ours], [theirs] = output["response"]["body"]["data"], alone.json()["data"]
            assert ours["embedding"] == pytest.approx(theirs["embedding"], abs=1e-5)


async def test_score_and_rerank_batches_answer_as_the_requests_alone(tmp_path):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    bodies = {
        "/v1/score": {"text_1": "Story 1", "text_2": ["Story 2", "A tale"]},
        "/v1/rerank": {"query": "Story 1", "documents": ["Story 2", "A tale", "Story 1"]},
    }
    async with live_server(settings, runner="pooling") as server, httpx.AsyncClient() as http:
        client = sdk(server.url)
        for url, body in bodies.items():
            lines = [{"custom_id": "x", "method": "POST", "url": url, "body": body}]
            batch = await until_done(client, (await submit(client, lines, url)).id)
            assert batch.status == "completed", batch
            [output] = await file_lines(client, batch.output_file_id)
            alone = (await http.post(f"{server.url}{url}", json=body)).json()
            ours = output["response"]["body"]
            key, value = ("data", "score") if url == "/v1/score" else ("results", "relevance_score")
            assert [r[value] for r in ours[key]] == pytest.approx(
                [r[value] for r in alone[key]], abs=1e-5
            )


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (
            {"custom_id": "z", "method": "POST", "url": "/v1/completions", "body": {}},
            "invalid_request",
        ),
        (line("a", "again"), "duplicate_custom_id"),
        (line("b", "Hi", url="/v1/chat/completions"), "mismatched_url"),
        (line("c", "Hi", max_tokens=-1), "invalid_request"),
        ({**line("d", "Hi"), "method": "GET"}, "invalid_method"),
    ],
    ids=["no prompt", "duplicate", "url", "max_tokens", "method"],
)
async def test_a_bad_line_fails_the_batch_up_front(tmp_path, bad, code):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    async with live_server(settings) as server:
        client = sdk(server.url)
        batch = await submit(client, [line("a", "Hi"), bad])
        assert batch.status == "failed" and batch.failed_at is not None
        [error] = batch.errors.data
        assert (error.code, error.line) == (code, 2)
        assert batch.request_counts.total == 0


async def test_unknown_file_and_batch_are_errors(tmp_path):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    async with live_server(settings) as server:
        client = sdk(server.url)
        with pytest.raises(openai.BadRequestError):
            await client.batches.create(
                input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
            )
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")


async def test_cancel_keeps_what_finished_and_reports_the_rest(tmp_path):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    lines = [line(f"r{i}", f"Count {i}:", max_tokens=48, ignore_eos=True) for i in range(60)]
    async with live_server(settings) as server:
        client = sdk(server.url)
        created = await submit(client, lines)
        await asyncio.sleep(0.3)
        cancelling = await client.batches.cancel(created.id)
        assert cancelling.status in ("cancelling", "cancelled")
        batch = await until_done(client, created.id)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        outputs = await file_lines(client, batch.output_file_id)
        errors = await file_lines(client, batch.error_file_id)
        ids = [o["custom_id"] for o in outputs] + [e["custom_id"] for e in errors]
        assert sorted(ids) == sorted(item["custom_id"] for item in lines)
        assert errors and all(e["error"]["code"] == "batch_cancelled" for e in errors)
        with pytest.raises(openai.BadRequestError):
            await client.batches.cancel(created.id)


async def test_listing_pages_newest_first(tmp_path):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    async with live_server(settings) as server:
        client = sdk(server.url)
        ids = [(await submit(client, [line("a", "Hi")])).id for _ in range(3)]
        page = await client.batches.list(limit=2)
        assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
        assert [b.id async for b in client.batches.list(limit=2)] == ids[::-1]


async def test_a_batch_stopped_mid_run_resumes_with_each_line_once(tmp_path):
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    lines = [line(f"r{i}", f"Count {i}:", max_tokens=24, ignore_eos=True) for i in range(40)]
    async with live_server(settings) as server:
        created = await submit(sdk(server.url), lines)
        for _ in range(200):
            batch = await sdk(server.url).batches.retrieve(created.id)
            if batch.request_counts.completed >= 5:
                break
            await asyncio.sleep(0.05)
    assert batch.status == "in_progress" and batch.request_counts.completed < 40
    async with live_server(settings) as server:
        client = sdk(server.url)
        batch = await until_done(client, created.id)
        assert batch.status == "completed" and batch.request_counts.completed == 40
        outputs = await file_lines(client, batch.output_file_id)
        assert sorted(o["custom_id"] for o in outputs) == sorted(i["custom_id"] for i in lines)


async def test_a_batch_is_stored_ready_to_run_in_one_commit(tmp_path):
    """Created straight into `in_progress` with its lines; one left `validating` (as a crash
    between two commits used to leave it) is run when the server starts."""
    from server.batches.jobs import BatchStore, new_batch

    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    async with live_server(settings) as server:
        created = await submit(sdk(server.url), [line("a", "Hi")])
        assert created.status == "in_progress" and created.in_progress_at is not None
        await until_done(sdk(server.url), created.id)
    store = BatchStore(tmp_path)
    stranded = new_batch("file-none", "/v1/completions", None)
    request = line("s", "Hello")
    store.create(stranded, [(request["custom_id"], request["body"])])
    assert store.get(stranded.id).status == "validating"
    async with live_server(settings) as server:
        batch = await until_done(sdk(server.url), stranded.id)
        assert batch.status == "completed" and batch.request_counts.completed == 1


async def test_a_batch_past_its_window_expires_with_its_lines_reported(tmp_path, monkeypatch):
    from server.batches import jobs

    monkeypatch.setattr(jobs, "WINDOW_SECONDS", -1)  # created already past its window
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    async with live_server(settings) as server:
        client = sdk(server.url)
        created = await submit(client, [line("a", "Hi"), line("b", "Yo")])
        batch = await until_done(client, created.id)
        assert batch.status == "expired" and batch.expired_at is not None
        assert batch.output_file_id is None
        errors = await file_lines(client, batch.error_file_id)
        assert sorted(e["custom_id"] for e in errors) == ["a", "b"]
        assert all(e["error"]["code"] == "batch_expired" for e in errors)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_live_requests_go_before_batch_lines(tmp_path, policy):
    """One sequence at a time and six long batch lines queued: a live request pauses the one
    running and is answered while at most one line has finished, under either policy."""
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path)
    lines = [line(f"r{i}", f"Count {i}:", max_tokens=40, ignore_eos=True) for i in range(6)]
    options = {"max_num_seqs": 1, "scheduling_policy": policy}
    async with live_server(settings, **options) as server, httpx.AsyncClient() as http:
        client = sdk(server.url)
        created = await submit(client, lines)
        scheduler = server.engine.core.scheduler
        while len(scheduler.waiting) + len(scheduler.running) < 6:  # every line queued
            await asyncio.sleep(0.01)
        live = await http.post(f"{server.url}/v1/completions", json={**BODY, "prompt": "Hi"})
        assert live.status_code == 200
        assert (await client.batches.retrieve(created.id)).request_counts.completed <= 1
        batch = await until_done(client, created.id)
        assert batch.request_counts.completed == 6
        outputs = await file_lines(client, batch.output_file_id)
        for output in outputs:  # paused and resumed, each line's answer is its own
            prompt = f"Count {output['custom_id'][1:]}:"
            alone = await http.post(
                f"{server.url}/v1/completions",
                json={**BODY, "prompt": prompt, "max_tokens": 40, "ignore_eos": True},
            )
            assert (
                output["response"]["body"]["choices"][0]["text"]
                == (alone.json()["choices"][0]["text"])
            )
