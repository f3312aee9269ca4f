"""The routes an RL trainer drives a rollout server with around a weight update, served with
`--server-dev-mode` (vLLM's `VLLM_SERVER_DEV_MODE`): vLLM's `POST /pause`, `POST /resume`,
`GET /is_paused` and `POST /abort_requests`, and SGLang's `POST /pause_generation`,
`POST /continue_generation` and `POST /abort_request` (`engine/core/pausing.py`); new
weights come through `server/weight_updates.py`."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel

from engine.core.pausing import PauseInterruptedError
from server.errors import APIError
from server.openapi import errors
from server.serving import EngineClient


class AbortRequests(BaseModel):
    """vLLM's body: the ids to abort (a reply's `id` or an engine id); none: every request."""

    request_ids: list[str] | None = None


class SGLangPause(BaseModel):
    # `retract` and `in_place` both keep the requests where they are here.
    mode: Literal["abort", "retract", "in_place"] = "abort"


class SGLangAbort(BaseModel):
    rid: str = ""
    abort_all: bool = False


SGLANG_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}


def generation_control_router(engine: EngineClient) -> APIRouter:
    router = APIRouter()

    async def pause(mode: str, clear_cache: bool) -> None:
        try:
            await engine.pause(mode, clear_cache)
        except PauseInterruptedError as exc:
            raise APIError(409, exc.message, code=exc.code) from None

    @router.post("/pause", responses=errors(400, 409, 503))
    async def pause_generation(
        mode: str = Query("abort", description="abort, wait or keep the requests in flight"),
        wait_for_inflight_requests: bool = Query(False, description="old form of mode=wait"),
        clear_cache: bool = Query(True, description="forget the prefix cache once drained"),
    ) -> dict[str, Any]:
        """Stop generating until `/resume`: requests in flight are aborted (`abort`), finish
        (`wait`) or are frozen (`keep`); new ones wait for the resume. Returns once paused."""
        await pause("wait" if wait_for_inflight_requests else mode, clear_cache)
        return {"status": "paused"}

    @router.post("/resume")
    @router.post("/continue_generation")
    async def resume_generation() -> dict[str, Any]:
        await engine.resume()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": engine.is_paused}

    @router.post("/abort_requests")
    async def abort_requests(body: AbortRequests | None = None) -> dict[str, Any]:
        """Abort the requests named, or every request in flight, without pausing."""
        named = body.request_ids if body is not None and body.request_ids else None
        return {"status": "aborted", "aborted": len(engine.abort_requests(named))}

    @router.post("/pause_generation", responses=errors(400, 409, 503))
    async def sglang_pause(body: SGLangPause | None = None) -> dict[str, Any]:
        await pause(SGLANG_MODES[(body or SGLangPause()).mode], True)
        return {"status": "paused"}

    @router.post("/abort_request")
    async def sglang_abort(body: SGLangAbort) -> dict[str, Any]:
        if body.abort_all:
            aborted = engine.abort_requests(None)
        else:
            aborted = engine.abort_requests([body.rid] if body.rid else [])
        return {"status": "aborted", "aborted": len(aborted)}

    return router
