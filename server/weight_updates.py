"""New weights while serving, served with `--server-dev-mode`: SGLang's
`POST /update_weights_from_disk` (a checkpoint folder of the same model, loaded between two
steps: `engine/weight_reload.py`) and the version a trainer gives the weights (SGLang's
`GET /get_weight_version`, vLLM's `GET /weight_info` and `POST /update_weight_version`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from engine.core.errors import InvalidRequestError
from server.serving import EngineClient


class UpdateWeightsFromDisk(BaseModel):
    """SGLang's body; `load_format` is accepted as the folder's own format is read anyway."""

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    weight_version: str | None = None
    # End every request in flight first, rather than let them go on with the new weights.
    abort_all_requests: bool = False


class WeightVersion(BaseModel):
    new_version: str


def weight_updates_router(engine: EngineClient) -> APIRouter:
    router = APIRouter()

    @router.post(
        "/update_weights_from_disk",
        responses={400: {"description": "The folder cannot load or is not the model's shape"}},
    )
    async def update_weights_from_disk(body: UpdateWeightsFromDisk) -> JSONResponse:
        """Load the checkpoint in `model_path` and serve it from the next step on; the answer
        in SGLang's shape (`success`, `message`)."""
        aborted = len(engine.abort_requests(None)) if body.abort_all_requests else 0
        try:
            await engine.reload_weights(body.model_path, body.weight_version)
        except InvalidRequestError as exc:
            return JSONResponse({"success": False, "message": exc.message}, status_code=400)
        message = f"Serving the weights in {body.model_path}"
        if aborted:
            message += f" ({aborted} requests aborted first)"
        return JSONResponse({"success": True, "message": message + ".", "num_paused_requests": 0})

    @router.get("/get_weight_version")
    @router.get("/weight_info")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @router.post("/update_weight_version")
    async def update_weight_version(body: WeightVersion) -> dict[str, Any]:
        engine.weight_version = body.new_version
        return {"success": True, "new_version": body.new_version}

    return router
