"""`conveyor batch run INPUT OUTPUT`: a batch file run offline through the same code as
/v1/batches (validation, the runner, durable results), like `vllm run-batch`.

The batch's state lives in a directory beside the output (`OUTPUT.state` unless given), so a
run that is interrupted resumes where it stopped when started again with the same arguments,
and every `custom_id` appears once in the output. The output holds every line's result, answered
or refused, in input order.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx

from server import json_text
from server.batches.jobs import Batch
from server.batches.runner import BatchRunner
from server.batches.validation import ENDPOINTS

FINAL = ("completed", "failed", "cancelled", "expired")


async def run_file(app: Any, engine: Any, input_path: Path, output_path: Path) -> int:
    """Run (or resume) the batch of `input_path` and write `output_path`; 0 when every line
    was answered, 1 when the file fails validation (the errors are printed)."""
    runner: BatchRunner = app.state.batches
    await engine.start()
    runner.start()
    try:
        batch = await _batch_for(app, runner, input_path)
        while batch.status not in FINAL:
            await asyncio.sleep(0.1)
            stored = runner.jobs.get(batch.id)
            assert stored is not None, "a batch is never removed from its store"
            batch = stored
    finally:
        await runner.stop()
        await engine.shutdown()
    if batch.status == "failed":
        for error in batch.body["errors"]["data"]:
            print(f"line {error['line']}: {error['code']}: {error['message']}")
        return 1
    _write(output_path, runner.jobs.results(batch.id))
    return 0


async def _batch_for(app: Any, runner: BatchRunner, input_path: Path) -> Batch:
    """The batch an earlier run of this input left, else a new one."""
    source = str(input_path.resolve())
    store = runner.lazy_jobs.existing()
    if store is not None:
        batches, _ = await asyncio.to_thread(store.page, 1_000, None)
        for batch in batches:
            if (batch.body.get("metadata") or {}).get("input") == source:
                runner.wake()
                return batch
    endpoint = _endpoint(input_path)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch") as client:
        with input_path.open("rb") as data:
            files = {"file": (input_path.name, data)}
            uploaded = await client.post("/v1/files", files=files, data={"purpose": "batch"})
        uploaded.raise_for_status()
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
            "metadata": {"input": source},
        }
        created = await client.post("/v1/batches", json=body)
        created.raise_for_status()
    return Batch(created.json())


def _endpoint(input_path: Path) -> str:
    """The `url` of the file's first line (every line must share it)."""
    with input_path.open("rb") as source:
        for raw in source:
            if raw.strip():
                try:
                    url = json_text.loads(raw).get("url")
                except (ValueError, AttributeError):
                    break
                if url in ENDPOINTS:
                    return url
                break
    return "/v1/completions"  # validation then reports what is wrong with the file


def _write(output_path: Path, results: list[dict[str, Any]]) -> None:
    partial = output_path.with_name(output_path.name + ".partial")
    with partial.open("w") as out:
        for result in results:
            out.write(json.dumps(result) + "\n")
        out.flush()
        os.fsync(out.fileno())
    partial.replace(output_path)
