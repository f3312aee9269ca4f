"""/v1/files as OpenAI serves it: upload (multipart), list (paged), retrieve, content, delete."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse

from server.batches.files import FileRecord, FileStore, LazyFileStore
from server.errors import APIError
from server.openapi import errors

# What a client may upload; `batch_output` files are the server's own.
UPLOAD_PURPOSES = ("batch", "user_data")


def files_router(files: LazyFileStore, max_file_bytes: int) -> APIRouter:
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
        data = [record.to_openai() for record in records]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": more,
        }

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
