"""`conveyor batch run`: a batch file run offline through the same validation and runner, its
output holding every line's result in input order; run again, it resumes an interrupted batch
or rewrites a finished one's output without redoing it."""

from __future__ import annotations

import asyncio
import json

from openai import AsyncOpenAI

from server.app import build_app
from server.batches.offline import run_file
from server.settings import ServerSettings
from tests.server_utils import live_server, tiny_engine


def lines(count: int, **body) -> list[dict]:
    return [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"Item {i}:", "max_tokens": 4, **body},
        }
        for i in range(count)
    ]


def write(path, items: list[dict]) -> None:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))


async def run(tmp_path, input_path, output_path) -> int:
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path / "state")
    engine = tiny_engine()
    return await run_file(build_app(engine, settings), engine, input_path, output_path)


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_every_line_answered_or_refused_in_input_order(tmp_path):
    items = lines(5, temperature=0)
    items[2]["body"]["stop"] = ["x"] * 100  # past the stop-string limit: refused with a 400
    write(tmp_path / "in.jsonl", items)
    assert await run(tmp_path, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 0
    results = read(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(5)]
    assert [r["response"]["status_code"] for r in results] == [200, 200, 400, 200, 200]
    first = (tmp_path / "out.jsonl").read_text()
    assert await run(tmp_path, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 0
    assert (tmp_path / "out.jsonl").read_text() == first  # the same results, not run again


async def test_a_bad_file_is_reported_and_nothing_runs(tmp_path, capsys):
    items = lines(2)
    items[1]["custom_id"] = "c0"
    write(tmp_path / "in.jsonl", items)
    assert await run(tmp_path, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 1
    assert "line 2: duplicate_custom_id" in capsys.readouterr().out
    assert not (tmp_path / "out.jsonl").exists()


async def test_an_interrupted_run_resumes_with_each_line_once(tmp_path):
    items = lines(30, max_tokens=24, ignore_eos=True)
    write(tmp_path / "in.jsonl", items)
    source = str((tmp_path / "in.jsonl").resolve())
    settings = ServerSettings(served_model_name="tiny", state_dir=tmp_path / "state")
    async with live_server(settings) as server:  # a run stopped part-way
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        upload = await client.files.create(
            file=("in.jsonl", (tmp_path / "in.jsonl").read_bytes()), purpose="batch"
        )
        batch = await client.batches.create(
            input_file_id=upload.id,
            endpoint="/v1/completions",
            completion_window="24h",
            metadata={"input": source},
        )
        while (await client.batches.retrieve(batch.id)).request_counts.completed < 3:
            await asyncio.sleep(0.05)
    assert await run(tmp_path, tmp_path / "in.jsonl", tmp_path / "out.jsonl") == 0
    results = read(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in results] == [f"c{i}" for i in range(30)]
    assert all(r["response"]["status_code"] == 200 for r in results)
