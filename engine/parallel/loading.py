"""Loading one rank's share of a model without holding the whole model in memory.

From a local folder of safetensors files, the model is built with its parameters on the meta
device (no memory), cut to the rank's shapes (`sharding.shard_model`), and each parameter is then
read as the slice of its checkpoint tensor the rank keeps: a rank of N holds about 1/N of the
weights from the start, so N ranks on one host need about one model's worth of memory, not N.
A converted checkpoint's layers kept only as blocks are read as their blocks dequantized.
Elsewhere (a hub id, another format, an MXFP4 checkpoint's experts) the whole model is loaded,
dequantized where its checkpoint is quantized, and cut.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from engine.loading.block_model import load_whole, read_blocks
from engine.loading.checkpoint_tensors import (
    CheckpointTensors,
    fill,
    model_from_config,
    parameters_on_meta,
    stacked_experts,
    tensor_index,
)
from engine.loading.quantized_checkpoint import load_options
from engine.parallel.sharding import (
    EXPERT_TENSORS,
    TRANSPOSED_EXPERTS,
    ShardShape,
    column_share,
    experts_share,
    fused_row_share,
    padded_rows,
    parameter_share,
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
    model = load_whole(AutoModelForCausalLM, path, dtype, trust_remote_code, load_options(path))
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
    transposed = {n for n, m in model.named_modules() if type(m).__name__ in TRANSPOSED_EXPERTS}
    with CheckpointTensors(tensor_index(files), read_blocks(path)) as checkpoint:
        fill(
            model,
            checkpoint,
            dtype,
            lambda name, tensors: _read_share(name, tensors, shape, transposed),
        )
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model.eval(), shape


def _read_share(
    name: str, checkpoint: CheckpointTensors, shape: ShardShape, transposed: set[str]
) -> torch.Tensor:
    """The rank's share of the checkpoint tensor(s) behind parameter `name`; `transposed`: the
    names of the layers' experts held as gpt-oss holds them."""
    owner, _, kind = name.rpartition(".")
    if owner.endswith(".experts") and kind in EXPERT_TENSORS:
        try:
            whole = checkpoint.slice(checkpoint.key(name))[:]
        except KeyError:  # each expert's own tensors
            if owner in transposed:
                raise
            return stacked_experts(owner, kind, checkpoint, shape.expert_span)
        return experts_share(kind, whole, shape, owner in transposed)
    reader = checkpoint.slice(checkpoint.key(name))
    heads = parameter_share(name, shape)
    if heads is not None:
        return reader[heads]
    parts = fused_row_share(owner, shape)
    if parts is not None:
        return torch.cat([reader[rows] for rows in parts])
    rows = row_share(owner, shape)
    if rows is not None:
        return padded_rows(lambda span: reader[span], reader.get_shape()[0], rows)
    columns = column_share(owner, shape)
    if columns is not None and kind == "weight":
        return reader[:, columns]
    return reader[:]
