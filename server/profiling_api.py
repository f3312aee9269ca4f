"""vLLM's profiling routes, served with `--profiler-config`: `POST /start_profile` starts a
profile of the engine's steps, `POST /stop_profile` stops it and writes its trace and summary
(`engine/core/profiling.py`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from engine.core.profiling import ProfilerStateError
from server.errors import APIError
from server.openapi import errors
from server.serving import EngineClient


def profiling_router(engine: EngineClient) -> APIRouter:
    router = APIRouter()

    @router.post("/start_profile", responses=errors(400))
    async def start_profile() -> dict[str, Any]:
        """Profile the steps from now (or after the configured `delay_iterations`) until
        `/stop_profile`, or for the configured `max_iterations` steps."""
        try:
            await engine.start_profile()
        except ProfilerStateError as exc:
            raise APIError(400, str(exc), code="profiler_running") from None
        return {"status": "started"}

    @router.post("/stop_profile", responses=errors(400))
    async def stop_profile() -> dict[str, Any]:
        """Stop the profile and save it: the files written (none where it had not begun)."""
        try:
            files = await engine.stop_profile()
        except ProfilerStateError as exc:
            raise APIError(400, str(exc), code="profiler_not_running") from None
        return {"status": "stopped", "files": files}

    return router
