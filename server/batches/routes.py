"""/v1/files and /v1/batches as OpenAI serves them: files uploaded (multipart), listed (paged),
retrieved, read and deleted; batches created (validated up front), retrieved, listed and
cancelled, run in the background by `BatchRunner`."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict

from server.batches.files import FileRecord, FileStore
from server.batches.jobs import Batch, BatchStore, new_batch
from server.batches.runner import BatchRunner
from server.batches.state import Lazy
from server.batches.validation import read_batch
from server.errors import APIError
from server.openapi import errors

# What a client may upload; `batch_output` files are the server's own.
UPLOAD_PURPOSES = ("batch", "user_data")


def files_router(files: Lazy[FileStore], max_file_bytes: int) -> APIRouter:
    router = APIRouter()

    def store() -> FileStore:
        return files.get()

    @router.post("/v1/files", responses=errors(400))
    async def upload(
        file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
    ) -> dict[str, Any]:
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(
                400,
                f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}.",
                param="purpose",
            )
        if file.size is not None and file.size > max_file_bytes:
            raise APIError(
                400, f"The file is larger than the limit of {max_file_bytes} bytes.", param="file"
            )
        record = await asyncio.to_thread(store().add, file.file, file.filename or "file", purpose)
        return record.to_openai()

    @router.get("/v1/files", responses=errors(400))
    async def list_files(
        purpose: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        records, more = await asyncio.to_thread(
            store().list, purpose, limit, after, order == "desc"
        )
        return _page([record.to_openai() for record in records], more)

    @router.get("/v1/files/{file_id}", responses=errors(404))
    async def retrieve(file_id: str) -> dict[str, Any]:
        return (await _existing(store(), file_id)).to_openai()

    @router.get(
        "/v1/files/{file_id}/content",
        response_class=FileResponse,
        responses={200: {"content": {"application/octet-stream": {}}}, **errors(404)},
    )
    async def content(file_id: str) -> FileResponse:
        record = await _existing(store(), file_id)
        return FileResponse(
            store().path(record.id), media_type="application/octet-stream", filename=record.filename
        )

    @router.delete("/v1/files/{file_id}", responses=errors(404))
    async def delete(file_id: str) -> dict[str, Any]:
        if not await asyncio.to_thread(store().delete, file_id):
            raise _missing(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return router


async def _existing(store: FileStore, file_id: str) -> FileRecord:
    record = await asyncio.to_thread(store.get, file_id)
    if record is None:
        raise _missing(file_id)
    return record


def _missing(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id")


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input_file_id: str
    endpoint: Literal[
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
    ]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None


def batches_router(
    files: Lazy[FileStore], jobs: Lazy[BatchStore], runner: BatchRunner
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches", responses=errors(400))
    async def create(body: CreateBatch) -> dict[str, Any]:
        record = await asyncio.to_thread(files.get().get, body.input_file_id)
        if record is None:
            raise APIError(400, f"No such File object: {body.input_file_id}", param="input_file_id")
        batch = new_batch(record.id, body.endpoint, body.metadata)
        path = files.get().path(record.id)
        lines, problems = await asyncio.to_thread(read_batch, path, body.endpoint)
        store = jobs.get()
        if problems:
            batch.body["errors"] = {"object": "list", "data": problems}
            await asyncio.to_thread(store.create, batch, [], "failed")
        else:
            await asyncio.to_thread(store.create, batch, lines, "in_progress")
            runner.wake()
        return batch.body

    @router.get("/v1/batches/{batch_id}", responses=errors(404))
    async def retrieve(batch_id: str) -> dict[str, Any]:
        return (await _batch(jobs, batch_id)).body

    @router.get("/v1/batches", responses=errors(400))
    async def list_batches(
        after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20
    ) -> dict[str, Any]:
        batches, more = await asyncio.to_thread(jobs.get().page, limit, after)
        return _page([batch.body for batch in batches], more)

    @router.post("/v1/batches/{batch_id}/cancel", responses=errors(400, 404))
    async def cancel(batch_id: str) -> dict[str, Any]:
        batch = await _batch(jobs, batch_id)
        if batch.status not in ("validating", "in_progress", "cancelling"):
            raise APIError(400, f"Cannot cancel a batch with status {batch.status}.")
        if batch.status != "cancelling":
            await asyncio.to_thread(jobs.get().move, batch, "cancelling")
        runner.cancel(batch.id)
        return batch.body

    return router


async def _batch(jobs: Lazy[BatchStore], batch_id: str) -> Batch:
    batch = await asyncio.to_thread(jobs.get().get, batch_id)
    if batch is None:
        raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id")
    return batch


def _page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's list object: a page of items, its first and last ids, and whether more follow."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
