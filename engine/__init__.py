"""Conveyor's engine: continuous batching over a paged KV cache running Hugging Face models."""

from __future__ import annotations

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.errors import (
    ConveyorError,
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
)
from engine.core.outputs import RequestOutput, TokenLogprob
from engine.core.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "ConveyorError",
    "EngineConfig",
    "EngineDeadError",
    "InvalidRequestError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestFailedError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "TokenLogprob",
]
