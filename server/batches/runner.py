"""Runs batches in the background, through the server's own routes (so a batch line is served
exactly as the same live request), a few lines at a time; resumes what a restart interrupted.
Its requests are marked background (`BACKGROUND_HEADER`): the scheduler runs them only in
capacity no live request wants, pausing them while live ones run.

Each finished line's result is committed with the batch's counts before the next is counted, so
after a crash the lines without a result run again and the output files, written at the end from
the committed results, hold every `custom_id` once.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import time
import uuid
from typing import Any

import httpx

from server.batches.files import FileStore
from server.batches.jobs import Batch, BatchStore
from server.batches.state import Lazy
from server.serving import BACKGROUND_HEADER

logger = logging.getLogger("conveyor.batches")
LINES_IN_FLIGHT = 8


class BatchRunner:
    def __init__(
        self, app: Any, files: Lazy[FileStore], jobs: Lazy[BatchStore], api_key: str | None = None
    ) -> None:
        self.app = app
        self.files = files
        self.lazy_jobs = jobs
        self.headers = {BACKGROUND_HEADER: "1"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        # Lines being served now, and the tokens of batch lines served (for the metrics).
        self.in_flight = 0
        self.tokens = {"prompt": 0, "generation": 0}
        self._wake = asyncio.Event()
        self._cancelling: set[str] = set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        self._cancelling.add(batch_id)
        self.wake()

    async def _loop(self) -> None:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://batch") as client:
            while True:
                self._wake.clear()
                for batch in await asyncio.to_thread(self._unfinished):
                    try:
                        await self._run(client, batch)
                    except Exception:
                        logger.exception("batch %s failed to run", batch.id)
                await self._wake.wait()

    @property
    def jobs(self) -> BatchStore:
        return self.lazy_jobs.get()

    def _unfinished(self) -> list[Batch]:
        store = self.lazy_jobs.existing()
        return store.unfinished() if store is not None else []

    async def _run(self, client: httpx.AsyncClient, batch: Batch) -> None:
        if batch.status == "validating":
            # Its lines were committed with it (left so by a version that moved it apart).
            await asyncio.to_thread(self.jobs.move, batch, "in_progress")
        if batch.status == "in_progress":
            pending = await asyncio.to_thread(self.jobs.pending_lines, batch.id)
            queue = list(pending)
            await asyncio.gather(
                *(self._worker(client, batch, queue) for _ in range(LINES_IN_FLIGHT))
            )
            if batch.id in self._cancelling or batch.status == "cancelling":
                await asyncio.to_thread(self.jobs.move, batch, "cancelling")
            elif time.time() > batch.body["expires_at"]:
                await asyncio.to_thread(self.jobs.move, batch, "expired")
            else:
                await asyncio.to_thread(self.jobs.move, batch, "finalizing")
        if batch.status in ("finalizing", "cancelling", "expired"):
            await asyncio.to_thread(self._finalize, batch)
        self._cancelling.discard(batch.id)

    async def _worker(
        self, client: httpx.AsyncClient, batch: Batch, queue: list[tuple[int, str, dict]]
    ) -> None:
        while queue and batch.id not in self._cancelling:
            if time.time() > batch.body["expires_at"]:
                return
            line, custom_id, body = queue.pop(0)
            self.in_flight += 1
            try:
                response = await client.post(
                    batch.body["endpoint"],
                    json=_as_run(batch.body["endpoint"], body),
                    headers=self.headers,
                )
            finally:
                self.in_flight -= 1
            result = _result(custom_id, response)
            ok = response.status_code == 200
            if ok:
                usage = result["response"]["body"].get("usage") or {}
                self.tokens["prompt"] += usage.get("prompt_tokens", usage.get("input_tokens", 0))
                self.tokens["generation"] += usage.get(
                    "completion_tokens", usage.get("output_tokens", 0)
                )
            await asyncio.to_thread(self.jobs.finish_line, batch, line, result, ok)

    def _finalize(self, batch: Batch) -> None:
        """The output and error files from the committed results; lines never run are errors
        (cancelled or expired); then the batch's final status."""
        ending = {"finalizing": "completed", "cancelling": "cancelled", "expired": "expired"}
        final = ending[batch.status]
        outputs: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for result in self.jobs.results(batch.id):
            (outputs if result["response"]["status_code"] == 200 else errors).append(result)
        reason = "batch_cancelled" if final == "cancelled" else "batch_expired"
        for _, custom_id, _ in self.jobs.pending_lines(batch.id):
            message = f"The batch was {final} before this request ran."
            errors.append(_entry(custom_id, None, {"code": reason, "message": message}))
        store = self.files.get()
        for key, entries in (("output_file_id", outputs), ("error_file_id", errors)):
            if entries:
                data = "".join(json.dumps(entry) + "\n" for entry in entries).encode()
                name = f"{batch.id}_{key.split('_')[0]}.jsonl"
                batch.body[key] = store.add(io.BytesIO(data), name, "batch_output").id
        self.jobs.move(batch, final)


def _as_run(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """A line's body as sent: a Responses line is not kept in the response store unless it
    asks to be (a large batch would push live conversations out of it)."""
    if endpoint == "/v1/responses":
        return {"store": False, **body}
    return body


def _result(custom_id: str, response: httpx.Response) -> dict[str, Any]:
    """A line's result as OpenAI writes it: the response (a refusal too, with its status and
    error body); `error` is for lines that got no response."""
    response_part = {
        "status_code": response.status_code,
        "request_id": response.headers.get("x-request-id", ""),
        "body": response.json(),
    }
    return _entry(custom_id, response_part, None)


def _entry(
    custom_id: str, response: dict[str, Any] | None, error: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
