"""A batch survives its server being killed: a real `conveyor serve` on the default model,
SIGKILLed twice mid-batch and restarted on the same state directory, finishes the batch with
every custom_id exactly once and each answer equal to the same request sent alone (greedy)."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from openai import OpenAI

from tests.server.test_e2e import MODEL, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.default_model]
LINES = 300


def request(i: int) -> dict:
    return {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 6, "temperature": 0}


def completed(api: OpenAI, batch_id: str) -> int:
    return api.batches.retrieve(batch_id).request_counts.completed


def kill_after(process, api: OpenAI, batch_id: str, lines: int) -> None:
    """SIGKILL the server once `lines` lines have finished."""
    deadline = time.monotonic() + 300
    while completed(api, batch_id) < lines:
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def test_a_batch_killed_twice_finishes_with_every_line_once(tmp_path):
    state = ["--state-dir", str(tmp_path / "state")]
    body = "".join(
        json.dumps(
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": request(i)}
        )
        + "\n"
        for i in range(LINES)
    ).encode()
    process, url = start_server(*state)
    api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    upload = api.files.create(file=("in.jsonl", body), purpose="batch")
    batch = api.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    kill_after(process, api, batch.id, 60)
    process, url = start_server(*state)
    api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    kill_after(process, api, batch.id, 150)
    process, url = start_server(*state)
    try:
        api = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 300
        while (done := api.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, done
            assert done.status in ("in_progress", "finalizing"), done  # on its way to completed
            time.sleep(0.1)
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        assert done.error_file_id is None
        outputs = [
            json.loads(line) for line in api.files.content(done.output_file_id).text.splitlines()
        ]
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"c{i}" for i in range(LINES))
        by_id = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in outputs}
        for i in range(0, LINES, 30):
            alone = httpx.post(f"{url}/v1/completions", json=request(i), timeout=60).json()
            assert by_id[f"c{i}"] == alone["choices"][0]["text"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
