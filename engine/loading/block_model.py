"""A converted checkpoint (a GGUF file's, a quantized checkpoint's) loaded with its quantized
linear layers held as their blocks from the start.

The model is built with its parameters on the meta device; each layer whose blocks are kept
beside the checkpoint becomes a block layer (`PanelLinear.of_blocks`) before anything is read,
and only the other parameters (embeddings, norms, biases, layers without blocks) are then read
from the checkpoint. A layer's fp32 weight is never in memory: a 4-bit model loads in about the
memory of its blocks, not four to eight times more. The blocks were checked at conversion to
widen to exactly the layer's weights (`gguf_blocks.holds`), so outputs equal the fp32 model's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

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

logger = logging.getLogger(__name__)

Blocks = dict[str, tuple[gguf_blocks.BlockFormat, torch.Tensor]]


def load_with_blocks(
    path: str, int8_activations: bool = False, trust_remote_code: bool = False
) -> Any | None:
    """The fp32 model in the converted folder `path`, its layers with blocks held as them; None
    where a parameter's name is not found in the checkpoint's safetensors (a layout this
    reading does not know: the caller loads the model whole instead)."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    with parameters_on_meta():
        model = model_from_config(path, torch.float32, trust_remote_code)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    blocks = gguf_blocks.load(folder / gguf_blocks.BLOCKS_FILE)
    try:
        with CheckpointTensors(tensor_index(files)) as checkpoint:
            held = hold_blocks(model, blocks, checkpoint, int8_activations)
            fill(model, checkpoint, torch.float32)
    except KeyError as missing:
        logger.info("the checkpoint has no tensor %s; loading it whole", missing)
        return None
    if tied and isinstance(model.get_output_embeddings(), nn.Linear):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    logger.info("%d linear layers hold quantized blocks, read without fp32 weights", len(held))
    if int8_activations:
        rounded = sum(layer.int8_activations for layer in held)
        logger.info("%d of them multiply against activations rounded to 8-bit blocks", rounded)
    return model.eval()


def hold_blocks(
    model: nn.Module, blocks: Blocks, checkpoint: CheckpointTensors, int8_activations: bool
) -> list[PanelLinear]:
    """Put a block layer in place of each (meta) `nn.Linear` of `model` named in `blocks`, its
    bias read from `checkpoint`; return the layers put in place. Each layer's rows are taken out
    of `blocks` as its panels are made, so the two are not held whole at once."""
    held = []
    for name in list(blocks):
        fmt, rows = blocks.pop(name)
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            continue
        if type(linear) is not nn.Linear:
            continue
        bias = None if linear.bias is None else checkpoint.tensor(f"{name}.bias").float()
        layer = PanelLinear.of_blocks(fmt, rows, bias, int8_activations)
        if (layer.out_features, layer.in_features) != tuple(linear.weight.shape):
            raise ValueError(f"{name}: blocks of shape {tuple(rows.shape)} do not fit the layer")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        held.append(layer)
    return held
