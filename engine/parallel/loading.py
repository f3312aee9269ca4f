"""Loading one rank's share of a model without holding the whole model in memory.

From a local folder of safetensors files, the model is built with its parameters on the meta
device (no memory), cut to the rank's shapes (`sharding.shard_model`), and each parameter is then
read as the slice of its checkpoint tensor the rank keeps: a rank of N holds about 1/N of the
weights from the start, so N ranks on one host need about one model's worth of memory, not N.
Elsewhere (a hub id, another format) the whole model is loaded and cut.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.parallel.sharding import (
    ShardShape,
    column_share,
    padded_rows,
    row_share,
    shard_model,
)

logger = logging.getLogger(__name__)


def load_share(
    path: str, dtype: torch.dtype, rank: int, size: int, trust_remote_code: bool = False
) -> tuple[Any, ShardShape]:
    """Rank `rank`'s share of the model at `path` (a folder or hub id), on the CPU."""
    from transformers import AutoModelForCausalLM

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if files:
        try:
            return _share_from_files(path, files, dtype, rank, size, trust_remote_code)
        except KeyError as missing:
            logger.warning(
                "the checkpoint has no tensor %s; loading the whole model to cut this rank's "
                "share from it",
                missing,
            )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return model, shard_model(model, rank, size)


def _share_from_files(
    path: str,
    files: list[Path],
    dtype: torch.dtype,
    rank: int,
    size: int,
    trust_remote_code: bool,
) -> tuple[Any, ShardShape]:
    with parameters_on_meta():
        model = model_from_config(path, dtype, trust_remote_code)
    shape = shard_model(model, rank, size)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    _fill(model, _tensor_index(files), shape, dtype)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model.eval(), shape


def model_from_config(path: str, dtype: torch.dtype, trust_remote_code: bool) -> Any:
    """The model at `path` built from its config alone, parameters made as the caller's context
    makes them (on the meta device, or initialised on a device), with its generation config."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
        GenerationConfig,
    )

    from engine.loading.classifiers import is_classifier

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    image_text = getattr(config, "vision_config", None) is not None
    auto: Any = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
    if is_classifier(config):
        auto = AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold their parameters on the meta device (no memory, no
    initialisation); buffers, computed at construction (rotary frequencies), stay real."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a tied one is shared as it is
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _tensor_index(files: list[Path]) -> dict[str, Path]:
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            index.update(dict.fromkeys(handle.keys(), file))
    return index


def _fill(model: nn.Module, index: dict[str, Path], shape: ShardShape, dtype: torch.dtype) -> None:
    """Every parameter of the (meta, cut) `model` read as its share of the checkpoint tensors of
    its name. Raises KeyError naming a parameter the checkpoint lacks."""
    with _Checkpoint(index) as checkpoint:
        for name, _ in list(model.named_parameters()):
            tensor = _read_share(name, checkpoint, shape).to(dtype)
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


class _Checkpoint:
    """The checkpoint's tensors by name, each file opened once."""

    def __init__(self, index: dict[str, Path]) -> None:
        self.index = index
        self._files = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()

    def key(self, name: str) -> str:
        """The checkpoint's name for a parameter: the same, without the base model's prefix,
        or with Mixtral's `block_sparse_moe` for `mlp`."""
        for candidate in (name, name.replace(".mlp.", ".block_sparse_moe.")):
            for key in (candidate, candidate.removeprefix("model.")):
                if key in self.index:
                    return key
        raise KeyError(name)

    def slice(self, key: str) -> Any:
        from safetensors import safe_open

        file = self.index[key]
        if file not in self._handles:
            self._handles[file] = self._files.enter_context(safe_open(str(file), "pt"))
        return self._handles[file].get_slice(key)


# Each expert's own tensors, as checkpoints name them: (gate, up, down), Qwen's and Mixtral's.
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _read_share(name: str, checkpoint: _Checkpoint, shape: ShardShape) -> torch.Tensor:
    """The rank's share of the checkpoint tensor(s) behind parameter `name`."""
    owner, _, kind = name.rpartition(".")
    if owner.endswith(".experts") and kind in ("gate_up_proj", "down_proj"):
        return _expert_share(owner, kind, checkpoint, shape.expert_span)
    reader = checkpoint.slice(checkpoint.key(name))
    rows = row_share(owner, shape)
    if rows is not None:
        return padded_rows(lambda span: reader[span], reader.get_shape()[0], rows)
    columns = column_share(owner, shape)
    if columns is not None and kind == "weight":
        return reader[:, columns]
    return reader[:]


def _expert_share(owner: str, kind: str, checkpoint: _Checkpoint, channels: slice) -> torch.Tensor:
    """A layer's experts stacked as Hugging Face holds them (`[experts, 2 * inter, hidden]`,
    gate above up; `[experts, hidden, inter]`), each cut to the rank's channels, read from the
    checkpoint's tensors of each expert."""
    for gate, up, down in EXPERT_NAMES:
        try:
            checkpoint.key(f"{owner}.0.{gate}.weight")
        except KeyError:
            continue
        shares = []
        for expert in itertools.count():
            prefix = f"{owner}.{expert}"
            try:
                keys = [checkpoint.key(f"{prefix}.{part}.weight") for part in (gate, up, down)]
            except KeyError:
                break
            if kind == "down_proj":
                shares.append(checkpoint.slice(keys[2])[:, channels])
            else:
                shares.append(torch.cat([checkpoint.slice(k)[channels] for k in keys[:2]]))
        return torch.stack(shares)
    raise KeyError(f"{owner}.{kind}")
