"""Loading one rank's share of a model without holding the whole model in memory.

From a local folder of safetensors files, the model is built with its parameters on the meta
device (no memory), cut to the rank's shapes (`sharding.shard_model`), and each parameter is then
read as the slice of its checkpoint tensor the rank keeps: a rank of N holds about 1/N of the
weights from the start, so N ranks on one host need about one model's worth of memory, not N.
Elsewhere (a hub id, another format) the whole model is loaded and cut.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
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
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(
        config, dtype=dtype, trust_remote_code=trust_remote_code
    )
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
    """Every parameter of the (meta, cut) `model` read as its share of the checkpoint tensor of
    the same name. Raises KeyError naming a parameter the checkpoint lacks."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, _ in model.named_parameters():
        key = _checkpoint_key(name, index)
        by_file.setdefault(index[key], []).append((name, key))
    for file, names in by_file.items():
        with safe_open(str(file), "pt") as handle:
            for name, key in names:
                tensor = _share(name, handle.get_slice(key), shape).to(dtype)
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def _checkpoint_key(name: str, index: dict[str, Path]) -> str:
    """The checkpoint's name for a parameter: the same, or without the base model's prefix."""
    for key in (name, name.removeprefix("model.")):
        if key in index:
            return key
    raise KeyError(name)


def _share(name: str, reader: Any, shape: ShardShape) -> torch.Tensor:
    """The rank's share of one checkpoint tensor, read from `reader` (a safetensors slice)."""
    owner, _, kind = name.rpartition(".")
    rows = row_share(owner, shape)
    if rows is not None:
        return padded_rows(lambda span: reader[span], reader.get_shape()[0], rows)
    columns = column_share(owner, shape)
    if columns is not None and kind == "weight":
        return reader[:, columns]
    return reader[:]
