"""What routers in front of many replicas ask a replica, beyond the OpenAI routes and /health:
its load (vllm-router's and SGLang's router's `/get_load`, vLLM's `/load`), its model and cache
(`/get_server_info`, `/get_model_info`) and a prefix-cache flush (SGLang's `/flush_cache`,
vLLM's `/reset_prefix_cache`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.openapi import errors
from server.serving import EngineClient, ServedModel
from server.version import conveyor_version


def fleet_router(engine: EngineClient, served: ServedModel) -> APIRouter:
    router = APIRouter()
    info = served.info

    @router.get("/get_load")
    async def get_load() -> dict[str, int]:
        """Requests in this replica's engine, running or waiting: what power-of-two and
        cache-aware policies balance on."""
        return {"load": engine.num_unfinished}

    @router.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": engine.num_unfinished}

    @router.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": info.model_path or served.name,
            "tokenizer_path": info.model_path or served.name,
            "served_model_name": served.name,
            "is_generation": True,
        }

    @router.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return {
            "model_path": info.model_path or served.name,
            "served_model_name": served.name,
            "max_model_len": info.max_model_len,
            "dtype": info.dtype,
            "device": info.device,
            "block_size": info.block_size,
            "kv_block_size": info.block_size,
            "num_gpu_blocks": info.num_blocks,
            "kv_cache_dtype": info.kv_cache_dtype or info.dtype,
            "enable_prefix_caching": info.enable_prefix_caching,
            "tensor_parallel_size": info.tensor_parallel_size,
            "async_scheduling": info.async_scheduling,
            "version": conveyor_version(),
        }

    @router.post("/flush_cache", responses=errors(503))
    @router.post("/reset_prefix_cache", responses=errors(503))
    async def reset_prefix_cache() -> dict[str, Any]:
        """Forget the cached prefixes no request holds (running requests keep theirs)."""
        return {"status": "ok", "forgotten_blocks": await engine.reset_prefix_cache()}

    return router
