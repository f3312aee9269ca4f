"""A converted checkpoint (a GGUF file's, a quantized checkpoint's) loaded with its quantized
linear layers held as their blocks from the start.

A conversion keeps a quantized layer as its blocks only (`gguf_blocks`), not as an fp32 weight
too. The model is built with its parameters on the meta device; on a CPU whose panel kernel
runs in fp32, each layer with blocks becomes a block layer (`PanelLinear.of_blocks`) before
anything is read, and its weight never exists in fp32: a 4-bit model loads in about the memory
of its blocks. In any other form (16-bit weights, a GPU) each such weight is its blocks
dequantized, read one layer at a time. The other parameters (embeddings, norms, biases, layers
without blocks) are read from the checkpoint. Blocks were checked at conversion to widen to
exactly the layer's weights, so outputs equal the fp32 model's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from engine.kernels.cpu.linear import PanelLinear
from engine.loading import gguf_blocks
from engine.loading.checkpoint_tensors import (
    CheckpointTensors,
    fill,
    model_from_config,
    parameters_on_meta,
    tensor_index,
)
from engine.loading.expert_blocks import EXPERT_LAYER
from engine.loading.gguf_blocks import Blocks
from engine.loading.mxfp4_experts import HeldExperts
from engine.models.experts import unfuse_experts

logger = logging.getLogger(__name__)


def has_blocks(path: str) -> bool:
    """Whether the checkpoint folder `path` keeps blocks beside its weights."""
    return bool(gguf_blocks.block_files(Path(path)))


def read_blocks(path: str) -> Blocks:
    """The blocks kept beside the checkpoint in folder `path`, by layer name (none: empty)."""
    return gguf_blocks.load(Path(path))


def load_converted(
    path: str,
    dtype: torch.dtype,
    hold: bool,
    int8_activations: bool = False,
    trust_remote_code: bool = False,
    experts: HeldExperts | None = None,
) -> Any | None:
    """The model in the converted folder `path` in `dtype`, its layers with blocks held as them
    where `hold` (fp32 on a CPU whose panel kernel runs), else given their dequantized weights;
    None where a parameter's name is not found in the checkpoint (a layout this reading does
    not know: the caller loads the model whole, `fill_from_blocks`). `experts`: the blocks (and
    biases) of an MXFP4 checkpoint's experts, held in place of blocks kept beside it."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    with parameters_on_meta():
        model = model_from_config(path, dtype, trust_remote_code)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    blocks = read_blocks(path) if experts is None else dict(experts.blocks)
    biases = {} if experts is None else experts.biases
    if hold and any(EXPERT_LAYER.search(name) for name in blocks):
        unfuse_experts(model)  # one linear layer per expert, each to hold its blocks
    try:
        with CheckpointTensors(tensor_index(files), blocks) as checkpoint:
            held = hold_blocks(model, blocks, checkpoint, int8_activations, biases) if hold else []
            fill(model, checkpoint, dtype)
    except KeyError as missing:
        logger.info("the checkpoint has no tensor %s; loading it whole", missing)
        return None
    if tied and isinstance(model.get_output_embeddings(), nn.Linear):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if hold:
        logger.info("%d linear layers hold quantized blocks, read without fp32 weights", len(held))
    if int8_activations:
        rounded = sum(layer.int8_activations for layer in held)
        logger.info("%d of them multiply against activations rounded to 8-bit blocks", rounded)
    return model.eval()


def hold_blocks(
    model: nn.Module,
    blocks: Blocks,
    checkpoint: CheckpointTensors,
    int8_activations: bool,
    biases: dict[str, torch.Tensor] | None = None,
) -> list[PanelLinear]:
    """Put a block layer in place of each (meta) `nn.Linear` of `model` named in `blocks`, its
    bias taken from `biases` or read from `checkpoint`; return the layers put in place. Each
    layer's rows are taken out of `blocks` as its panels are made, so the two are not held whole
    at once."""
    held = []
    rounded = {
        name for name in blocks if int8_activations and gguf_blocks.rounds_inputs(name, blocks)
    }
    for name in list(blocks):
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            continue
        if type(linear) is not nn.Linear:
            continue
        fmt, rows = blocks.pop(name)
        bias = None
        if linear.bias is not None:
            found = (biases or {}).get(name)
            bias = (found if found is not None else checkpoint.tensor(f"{name}.bias")).float()
        layer = PanelLinear.of_blocks(fmt, rows, bias, name in rounded)
        if (layer.out_features, layer.in_features) != tuple(linear.weight.shape):
            raise ValueError(f"{name}: blocks of shape {tuple(rows.shape)} do not fit the layer")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        held.append(layer)
    return held


def load_whole(
    auto: Any,
    path: str,
    dtype: torch.dtype,
    trust_remote_code: bool,
    options: dict[str, Any] | None = None,
) -> Any:
    """The model at `path` loaded whole by transformers' auto class `auto` (with `options`
    beside the dtype); a converted checkpoint's layers kept only as blocks (which that load
    does not find) get their blocks dequantized."""
    loaded: Any = auto.from_pretrained(
        path,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        **(options or {}),
    )
    model, info = loaded
    missing = list(info.get("missing_keys", ()))
    if missing and has_blocks(path):
        _fill_from_blocks(model, missing, read_blocks(path))
    return model


def _fill_from_blocks(model: nn.Module, missing: list[str], blocks: Blocks) -> None:
    """Give each weight in `missing` whose layer keeps blocks its blocks dequantized."""
    with CheckpointTensors({}, blocks) as checkpoint:
        for name in missing:
            try:
                reader = checkpoint.slice(checkpoint.key(name))
            except KeyError:
                continue
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            dtype = cast(torch.Tensor, getattr(module, attr)).dtype
            setattr(module, attr, nn.Parameter(reader[:].to(dtype), requires_grad=False))
