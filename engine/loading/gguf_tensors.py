"""A GGUF file's tensors as the model transformers makes of it, read one at a time.

Each tensor is dequantized by GGUF's own code and passed through transformers' processing for its
architecture (a Llama's q and k rows unpermuted, Gemma's norms less one) under the name
transformers loads it as, so the weights equal those of transformers' own GGUF loading; and a
linear layer's weight stored in a type panels hold (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS) comes with its blocks, where they widen to exactly that weight. Only one
tensor is dequantized at a time: converting a file needs about the memory of the file, not of its
fp32 model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.loading import gguf_blocks
from engine.loading.gguf_blocks import BlockFormat


@dataclass(frozen=True, slots=True)
class ModelTensor:
    """One of the model's parameters as read from the file: `name` as transformers loads it,
    fp32; for a linear layer's weight stored in a panel type, its blocks and the layer's name."""

    name: str
    tensor: torch.Tensor
    blocks: tuple[str, BlockFormat, torch.Tensor] | None = None


def model_tensors(path: Path, model: Any) -> Iterator[ModelTensor]:
    """Every tensor of the GGUF file at `path` that `model` (the file's model as transformers
    builds it from the file's config; on the meta device is enough) loads."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(path)
    architecture = text_field(reader, "general.architecture")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    linears = linear_names(model, names, [t.name for t in reader.tensors])
    config = model.config.get_text_config()
    merged: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}  # MoE experts, joined
    for tensor in reader.tensors:
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=names,
            parsed_parameters=merged,
        )
        if result.name not in names:
            continue
        weight = torch.from_numpy(np.copy(result.weights)).float()
        blocks = None
        if tensor.name in linears:
            blocks = block_rows(tensor, architecture, config, weight)
        held = None if blocks is None else (linears[tensor.name], *blocks)
        yield ModelTensor(names[result.name], weight, held)
    for name, weight in merged["tensors"].items():
        yield ModelTensor(name, weight.float())


def linear_names(model: Any, names: dict[str, str], tensors: list[str]) -> dict[str, str]:
    """The linear layer of `model` each of a GGUF file's weights loads into, by the tensor's
    name (`names`: the parameter each tensor loads as); a file without `output.weight` ties the
    LM head to the token embedding."""
    layers = {
        tensor: hf_name.removesuffix(".weight")
        for tensor, hf_name in names.items()
        if tensor.endswith(".weight") and hf_name.endswith(".weight")
    }
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and "output.weight" not in tensors:
        layers["token_embd.weight"] = "lm_head"
    return {tensor: name for tensor, name in layers.items() if _is_linear(model, name)}


def _is_linear(model: Any, name: str) -> bool:
    try:
        return type(model.get_submodule(name)) is nn.Linear
    except AttributeError:
        return False


def _block_types() -> dict[Any, BlockFormat]:
    """The formats of GGUF's types that panels hold, by GGUF's type."""
    from gguf import GGMLQuantizationType as Type

    return {
        Type.Q4_0: gguf_blocks.Q4_1,
        Type.Q4_1: gguf_blocks.Q4_1,
        Type.Q8_0: gguf_blocks.Q8_0,
        Type.Q4_K: gguf_blocks.Q4_K,
        Type.Q6_K: gguf_blocks.Q6_K,
        Type.Q5_0: gguf_blocks.Q5_0,
        Type.Q5_1: gguf_blocks.Q5_1,
        Type.Q5_K: gguf_blocks.Q5_K,
        Type.Q3_K: gguf_blocks.Q3_K,
        Type.IQ4_NL: gguf_blocks.IQ4_NL,
        Type.IQ4_XS: gguf_blocks.IQ4_XS,
    }


def block_rows(
    tensor: Any, architecture: str, config: Any, weight: torch.Tensor
) -> tuple[BlockFormat, torch.Tensor] | None:
    """The GGUF tensor's blocks in a type panels hold, rows in the order the model holds them
    (Q4_0 as the Q4_1 blocks of the same weights), where they widen to exactly `weight`; else
    None."""
    from gguf import GGMLQuantizationType

    fmt = _block_types().get(tensor.tensor_type)
    if fmt is None or len(tensor.shape) != 2:
        return None
    rows = torch.from_numpy(tensor.data.copy()).reshape(int(tensor.shape[-1]), -1)
    if tensor.tensor_type == GGMLQuantizationType.Q4_0:
        as_q4_1 = gguf_blocks.q4_0_as_q4_1(rows)
        if as_q4_1 is None:
            return None
        rows = as_q4_1
    if architecture == "llama":
        rows = unpermute_rows(tensor.name, rows, config)
    return (fmt, rows) if gguf_blocks.holds(fmt, rows, weight) else None


def text_field(reader: Any, key: str) -> str:
    field = reader.fields.get(key)
    return "" if field is None else bytes(field.parts[field.data[0]]).decode()


def unpermute_rows(tensor: str, rows: torch.Tensor, config: Any) -> torch.Tensor:
    """GGUF stores a Llama's q and k rows interleaved for its rotary layout; undo it as loading
    does."""
    if ".attn_q." in tensor:
        heads = config.num_attention_heads
    elif ".attn_k." in tensor:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    else:
        return rows
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, -1).transpose(1, 2).reshape(rows.shape).contiguous()
