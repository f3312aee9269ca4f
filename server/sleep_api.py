"""vLLM's sleep-mode routes, served with `--server-dev-mode`: `POST /sleep?level=1|2`,
`POST /wake_up?tags=weights&tags=kv_cache` and `GET /is_sleeping`
(`engine/worker/sleep_mode.py`; the engine refuses them without `--enable-sleep-mode`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from server.openapi import errors
from server.serving import EngineClient

Tags = Annotated[list[str] | None, Query(description="weights, kv_cache (default: both)")]


def sleep_router(engine: EngineClient) -> APIRouter:
    router = APIRouter()

    @router.post("/sleep", responses=errors(400))
    async def sleep(level: int = Query(1, description="1: the KV cache; 2: the weights too")):
        """Abort the requests in flight and give the memory back; requests that arrive wait
        for the wake-up."""
        await engine.sleep(level)
        return Response(status_code=200)

    @router.post("/wake_up", responses=errors(400))
    async def wake_up(tags: Tags = None):
        await engine.wake_up(tuple(tags) if tags else None)
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": engine.is_sleeping}

    return router
