"""New weights of the served model without a restart, as an RL trainer hands a rollout server
each checkpoint it writes (SGLang's `/update_weights_from_disk`).

The checkpoint folder is loaded and built exactly as at start-up (same dtype, linear forms,
kernels and compilation) beside the model being served, then takes its place between two steps;
on a GPU its CUDA graphs are captured again. What start-up sized for the old weights must fit
the new: the same model class, the same KV cache shape per token and the same tensors (names,
shapes and dtypes). The prefix cache is forgotten after the swap, since its blocks hold the old
weights' keys and values; requests already running keep theirs (pause first to avoid that).
While the new weights load, the device holds both copies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.core.config import EngineConfig
from engine.core.errors import InvalidRequestError
from engine.kv.kv_cache import KVCacheSpec
from engine.loading.model_loader import checkpoint_config, load_weights
from engine.loading.overrides import overlay_folder
from engine.model_build import prepared_model
from engine.models import CausalLM

logger = logging.getLogger(__name__)

# What a runner steps with besides the model: its decode and piecewise CUDA graphs.
Graphs = tuple[Any, Any]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What new weights must match: the model's class, and every parameter and buffer by name
    with its shape and dtype."""

    kind: type
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]

    @classmethod
    def of(cls, model: CausalLM) -> ModelShape:
        if not isinstance(model, nn.Module):
            return cls(type(model), {})
        named = [*model.named_parameters(), *model.named_buffers()]
        return cls(type(model), {name: (tuple(t.shape), t.dtype) for name, t in named})


@dataclass(slots=True)
class WeightReloader:
    """Loads a checkpoint as the served model was loaded, and puts it in the runner's hands."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    # The served model's KV cache shape, which the new weights must keep.
    kv_spec: KVCacheSpec
    # Captures CUDA graphs over a model (none where steps run eagerly).
    capture: Callable[[CausalLM], Graphs]
    # The folder the weights being served came from ("" for a model built in memory).
    served_path: str = ""

    def refusal(self) -> str | None:
        """Why this engine cannot take new weights, or None."""
        if self.config.tensor_parallel_size > 1:
            return "new weights load on one device only (not under --tensor-parallel-size)"
        if self.config.enable_lora:
            return "new weights cannot load under --enable-lora (the adapters wrap the layers)"
        if self.config.load_format == "dummy":
            return "the model was started with --load-format dummy"
        return None

    def load(self, path: str, served: ModelShape) -> CausalLM:
        """The model at the folder `path`, built to step in place of a model of the `served`
        shape; raises `InvalidRequestError` where it cannot load or would not fit."""
        if not Path(path).is_dir():
            raise InvalidRequestError(f"{path} is not a checkpoint folder.", param="model_path")
        folder = self._overridden(path)
        self._check_kv_shape(folder)
        try:
            source, _, _ = load_weights(
                folder,
                self.dtype,
                self.device,
                self.config.trust_remote_code,
                self.config.int8_activations,
                keep_blocks=self.config.keep_blocks,
            )
        except Exception as exc:  # a broken file's own error, whatever its library's type
            raise InvalidRequestError(
                f"Cannot load weights from {path}: {type(exc).__name__}: {exc}",
                param="model_path",
            ) from exc
        model, _ = prepared_model(source, self.config, self.device)
        _check_same_tensors(path, model, served)
        return model

    def install(self, runner: Any, model: CausalLM, path: str) -> None:
        """`model`, loaded from `path`, steps from now on, with graphs of its own where the
        runner replayed some."""
        replays = runner.graphs is not None or runner.piecewise is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no launched step still reads the old weights
        runner.graphs = runner.piecewise = None
        runner.model = model
        self.served_path = path
        if replays:
            torch.cuda.empty_cache()
            runner.graphs, runner.piecewise = self.capture(model)
        logger.info("serving new weights")

    def _overridden(self, path: str) -> str:
        """The folder to load: under `--hf-overrides`, the overlay of `path` with them, so that
        new weights run with the config the served ones ran with."""
        overrides = self.config.hf_overrides
        if not overrides or not (Path(path) / "config.json").is_file():
            return path
        return str(overlay_folder(Path(path).resolve(), overrides))

    def _check_kv_shape(self, path: str) -> None:
        config = checkpoint_config(path, self.config.trust_remote_code)
        if config is None:
            raise InvalidRequestError(f"{path} holds no config.json.", param="model_path")
        spec = self.kv_spec
        theirs = KVCacheSpec.from_hf_config(config.get_text_config(), spec.dtype, spec.block_size)
        if theirs != spec:
            raise InvalidRequestError(
                f"The weights in {path} do not fit the KV cache sized at start-up: "
                f"{_shape(theirs)} per token, where the served model has {_shape(spec)}.",
                param="model_path",
            )


def _shape(spec: KVCacheSpec) -> str:
    return f"{spec.num_layers} layers x {spec.num_kv_heads} KV heads x {spec.head_dim}"


def _check_same_tensors(path: str, model: CausalLM, served: ModelShape) -> None:
    shape = ModelShape.of(model)
    if shape.kind is not served.kind:
        raise InvalidRequestError(
            f"The weights in {path} build a {shape.kind.__name__}, where the served model "
            f"is a {served.kind.__name__}.",
            param="model_path",
        )
    ours, theirs = served.tensors, shape.tensors
    names = ours.keys() | theirs.keys()
    differ = sorted(name for name in names if ours.get(name) != theirs.get(name))
    if differ:
        raise InvalidRequestError(
            f"The weights in {path} are not the served model's shape: "
            f"{', '.join(differ[:3])}{' and more' if len(differ) > 3 else ''} differ.",
            param="model_path",
        )
