"""Sleep mode (vLLM's `--enable-sleep-mode`), for an RL trainer that shares the machine with
the server between rollouts.

Level 1 gives back the KV cache's memory and, on a GPU, moves the weights to host memory;
level 2 discards the weights as well. Waking restores the `weights`, the `kv_cache` or both:
weights moved to the host come back, and discarded ones are loaded again from the folder they
came from, unless new weights were loaded while asleep (`/update_weights_from_disk`), which
wakes the weights by itself. CUDA graphs a runner replayed are captured again once both parts
are awake. Every method runs on the step thread, while the engine loop is paused.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from torch import nn

from engine.core.errors import InvalidRequestError
from engine.kernels.cpu import malloc_tuning
from engine.models import CausalLM
from engine.weight_reload import ModelShape, WeightReloader

logger = logging.getLogger(__name__)

WEIGHTS, KV_CACHE = "weights", "kv_cache"
PARTS = (WEIGHTS, KV_CACHE)


class DiscardedModel:
    """Stands in for weights discarded by a level-2 sleep: nothing may step on it."""

    name = "discarded"

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("the weights were discarded by sleep mode; wake the engine up first")

    def greedy_tokens(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self(*args, **kwargs)


class SleepMode:
    """Which parts of a runner sleep, and how they wake."""

    def __init__(self, runner: Any, reloader: WeightReloader, enabled: bool) -> None:
        self.runner = runner
        self.reloader = reloader
        # `--enable-sleep-mode`: without it the engine never sleeps (the shape still serves
        # new weights' checks).
        self.enabled = enabled
        self.asleep: set[str] = set()
        self.level = 0
        # The shape of the model discarded at level 2, which the weights loaded back must have.
        self.discarded: ModelShape | None = None
        # Whether the runner replayed CUDA graphs before it slept.
        self._replayed = False

    def refusal(self, level: int) -> str | None:
        """Why the engine cannot sleep at `level`, or None."""
        if not self.enabled:
            return "start the server with --enable-sleep-mode"
        if level not in (1, 2):
            return f"level must be 1 or 2; got {level}"
        if level == 2 and not self.reloader.served_path:
            return "level 2 reloads the weights from their folder, and this model has none"
        return self.reloader.refusal() if level == 2 else None

    def sleep(self, level: int) -> None:
        runner = self.runner
        self._replayed |= runner.graphs is not None or runner.piecewise is not None
        runner.graphs = runner.piecewise = None
        runner.kv_cache.release()
        weights_home = WEIGHTS not in self.asleep
        if level == 2 and self.discarded is None:
            self.discarded = self._shape()
            runner.model = DiscardedModel()
        elif weights_home and self._on_gpu:
            _move(runner.model, torch.device("cpu"))
        self.asleep = set(PARTS)
        self.level = max(self.level, level)
        if self._on_gpu:
            torch.cuda.empty_cache()
        else:
            gc.collect()  # the model's cycles too, before the heap is trimmed
            malloc_tuning.give_back_freed_memory()
        logger.info("asleep at level %d", self.level)

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Restore the parts `tags` names (None: both)."""
        tags = tags or PARTS
        unknown = set(tags) - set(PARTS)
        if unknown:
            raise InvalidRequestError(
                f"tags must be among {', '.join(PARTS)}; got {', '.join(sorted(unknown))}.",
                param="tags",
            )
        if WEIGHTS in tags and WEIGHTS in self.asleep:
            self._wake_weights()
        if KV_CACHE in tags and KV_CACHE in self.asleep:
            self.runner.kv_cache.restore()
            self.asleep.discard(KV_CACHE)
        if not self.asleep:
            self._awake()

    def weights_loaded(self) -> None:
        """New weights took the model's place: asleep, the weights are awake now."""
        if WEIGHTS not in self.asleep:
            return
        self.discarded = None
        self.asleep.discard(WEIGHTS)
        if not self.asleep:
            self._awake()

    def shape(self) -> ModelShape:
        """The shape of the model served, awake or not."""
        return self.discarded if self.discarded is not None else self._shape()

    @property
    def _on_gpu(self) -> bool:
        return bool(self.runner.device.type == "cuda")

    def _shape(self) -> ModelShape:
        return ModelShape.of(self.runner.model)

    def _wake_weights(self) -> None:
        if self.discarded is not None:
            path = self.reloader.served_path
            model = self.reloader.load(path, self.discarded)
            self.reloader.install(self.runner, model, path)
            self.discarded = None
        elif self._on_gpu:
            _move(self.runner.model, self.runner.device)
        self.asleep.discard(WEIGHTS)

    def _awake(self) -> None:
        self.level = 0
        if self._replayed:
            self.runner.graphs, self.runner.piecewise = self.reloader.capture(self.runner.model)
            self._replayed = False
        logger.info("awake")


def _move(model: CausalLM, device: torch.device) -> None:
    if isinstance(model, nn.Module):
        model.to(device)
