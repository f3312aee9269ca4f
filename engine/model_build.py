"""Our model built over loaded weights, ready to step: projections fused, weights moved into
huge pages on a CPU, layers compiled under `--compile`. The engine builds it so at start-up and
again over new weights (`engine/weight_reload.py`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.core.config import EngineConfig
from engine.kernels.cpu import huge_pages, malloc_tuning
from engine.models import CausalLM, build_causal_lm
from engine.parallel.sharding import Shard
from engine.worker.compilation import compile_layers

logger = logging.getLogger(__name__)


def prepared_model(
    source: Any, config: EngineConfig, device: torch.device, shard: Shard | None = None
) -> tuple[CausalLM, str]:
    """The model that steps, built over the transformers model `source`, and how its layers
    were compiled ("" when eager)."""
    model = build_causal_lm(source, config.model_impl, shard)
    if device.type == "cpu":
        weights_into_huge_pages(model, source)
        # What loading, packing and the move freed goes back to the kernel before steps keep
        # theirs: about as much as the weights themselves, which stayed resident otherwise.
        malloc_tuning.give_back_freed_memory()
        malloc_tuning.keep_freed_memory()
    # Compiled over the weights where they stay, before the profiling pass measures the steps.
    compiled = compile_layers(model) if config.compile else ""
    return model, compiled


def weights_into_huge_pages(model: CausalLM, source: nn.Module) -> None:
    """The weights a step reads, moved into huge pages (where the kernel allows), with the
    views the model it was built from (`source`) holds of them; what only `source` holds stays
    where it is."""
    if not isinstance(model, nn.Module):
        return
    weights = [*model.parameters(), *model.buffers()]
    held = {t.untyped_storage().data_ptr() for t in weights}
    views = [t for t in [*source.parameters(), *source.buffers()] if _storage_in(t, held)]
    moved = huge_pages.move_into_huge_pages(weights + views)
    if moved:
        logger.info("weights in huge pages: %.0f MiB", moved / 2**20)


def _storage_in(tensor: torch.Tensor, storages: set[int]) -> bool:
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in storages
