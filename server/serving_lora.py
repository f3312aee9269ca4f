"""Loading and unloading LoRA adapters while serving, as vLLM's routes do it
(`--allow-runtime-lora-updating`: a client then chooses folders the server reads)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from server.errors import APIError
from server.openapi import errors
from server.serving import EngineClient, ServedModel


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


def lora_router(engine: EngineClient, served: ServedModel) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter", responses=errors(400))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_name in served.names:
            raise APIError(400, f"`{body.lora_name}` is the base model's name.", param="lora_name")
        await engine.add_lora(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", responses=errors(400, 404))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if engine.remove_lora(body.lora_name) is None:
            raise APIError(
                404,
                f"The LoRA adapter `{body.lora_name}` cannot be found.",
                "not_found_error",
                param="lora_name",
            )
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router
