"""A GGUF file's tensors as the model transformers makes of it, read one at a time.

Each tensor is dequantized by GGUF's own code and passed through transformers' processing for its
architecture (a Llama's q and k rows unpermuted, Gemma's norms less one) under the name
transformers loads it as, so the weights equal those of transformers' own GGUF loading; and a
linear layer's weight stored in a type panels hold (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS, MXFP4) comes with its blocks, where they widen to exactly that weight. Only
one tensor is dequantized at a time: converting a file needs about the memory of the file, not of
its fp32 model.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.loading import gguf_blocks, gguf_parts
from engine.loading.expert_blocks import expert_layer
from engine.loading.gguf_blocks import BlockFormat, Blocks

# The parts of a layer's experts GGUF stores (`ffn_gate_exps`, ...) and the linear layers of
# `ExpertLinears` they make: gate and up rows joined, one layer per expert.
EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(?P<part>gate|up|down)_exps\.weight$")


@dataclass(frozen=True, slots=True)
class ModelTensor:
    """One of the model's parameters as read from the file: `name` as transformers loads it,
    fp32; the blocks of the linear layers it makes, by layer name (a layer's weight, or each
    expert of a layer's experts), where a type panels hold stores it; `whole` where those
    blocks stand for all of it (it need not be kept in fp32 too)."""

    name: str
    tensor: torch.Tensor
    blocks: Blocks = field(default_factory=dict)
    whole: bool = False


def model_tensors(path: Path, model: Any) -> Iterator[ModelTensor]:
    """Every tensor of the GGUF file at `path` (every part of a split file's, `gguf_parts`)
    that `model` (the file's model as transformers builds it from the file's config; on the
    meta device is enough) loads. A layer's experts,
    which transformers' processing joins from several of the file's tensors, come once all
    of those are read."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    readers = [GGUFReader(part) for part in gguf_parts.parts(path)]
    tensors = [tensor for reader in readers for tensor in reader.tensors]
    architecture = metadata(readers[0], "general.architecture") or ""
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    linears = linear_names(model, names, [t.name for t in tensors])
    config = model.config.get_text_config()
    merged: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}  # MoE experts, joined
    unread = Counter(_target(names, t.name) for t in tensors)
    experts = ExpertBlocks()
    for tensor in tensors:
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=names,
            parsed_parameters=merged,
        )
        target = _target(names, tensor.name)
        unread[target] -= 1
        if EXPERT_TENSOR.match(tensor.name) and target is not None:
            experts.add(target, tensor)
        elif result.name in names:
            weight = torch.from_numpy(np.copy(result.weights)).float()
            held = (
                block_rows(tensor, architecture, config, weight) if tensor.name in linears else None
            )
            if held is None:
                yield ModelTensor(names[result.name], weight)
            else:
                layer = linears[tensor.name]
                name = names[result.name]
                yield ModelTensor(name, weight, {layer: held}, name == f"{layer}.weight")
        for name in [n for n in merged["tensors"] if unread[n] == 0]:
            weight = merged["tensors"].pop(name).float()
            blocks = experts.checked(name, weight)
            yield ModelTensor(name, weight, blocks, bool(blocks))


def _target(names: dict[str, str], tensor: str) -> str | None:
    """The parameter a GGUF tensor loads into (experts' tensors are mapped without `.weight`)."""
    return names.get(tensor) or names.get(tensor.removesuffix(".weight"))


class ExpertBlocks:
    """Each expert's blocks of a layer's experts, gathered from the file's gate, up and down
    tensors (gate rows above up rows, as Hugging Face joins them), then kept where all of them
    widen to exactly the joined weights."""

    def __init__(self) -> None:
        self._gates: dict[str, tuple[BlockFormat, torch.Tensor]] = {}
        self._found: dict[str, list[tuple[BlockFormat, torch.Tensor]] | None] = {}

    def add(self, target: str, tensor: Any) -> None:
        """A layer's `ffn_gate_exps`, `ffn_up_exps` or `ffn_down_exps` tensor, loading into the
        experts' parameter `target`."""
        held = expert_rows(tensor)
        part = EXPERT_TENSOR.match(tensor.name)["part"]  # type: ignore[index]
        if part == "gate":
            if held is not None:
                self._gates[target] = held
            else:
                self._found[target] = None
            return
        if part == "up":
            gate = self._gates.pop(target, None)
            if held is None or gate is None or gate[0] is not held[0]:
                self._found[target] = None
                return
            held = (held[0], torch.cat([gate[1], held[1]], dim=1))
        if held is None or self._found.get(target, []) is None:
            self._found[target] = None
            return
        fmt, rows = held
        self._found[target] = [(fmt, rows[expert]) for expert in range(rows.shape[0])]

    def checked(self, target: str, weight: torch.Tensor) -> Blocks:
        """The blocks of each expert of the parameter `target`, by `ExpertLinears`' layer
        names, where all of them give exactly `weight` (`[experts, out, in]`); else none."""
        found = self._found.pop(target, None)
        if not found or len(found) != weight.shape[0]:
            return {}
        if not all(gguf_blocks.holds(fmt, rows, weight[e]) for e, (fmt, rows) in enumerate(found)):
            return {}
        owner, _, kind = target.rpartition(".")
        part = kind.removesuffix("_proj")  # gate_up or down
        return {expert_layer(owner, part, expert): held for expert, held in enumerate(found)}


def expert_rows(tensor: Any) -> tuple[BlockFormat, torch.Tensor] | None:
    """A 3-D experts' tensor's blocks, `[experts, out, row bytes]`, where panels hold its
    type (Q4_0 as Q4_1); else None."""
    if len(tensor.shape) != 3:
        return None
    held = panel_rows(tensor)
    if held is None:
        return None
    fmt, rows = held
    return fmt, rows.reshape(int(tensor.shape[-1]), int(tensor.shape[-2]), -1)


def panel_rows(tensor: Any) -> tuple[BlockFormat, torch.Tensor] | None:
    """The GGUF tensor's rows of blocks (`[rows, row bytes]`, an experts' tensor's experts one
    above the other) in the format panels hold its type in (Q4_0 as Q4_1); None where they hold
    none."""
    from gguf import GGMLQuantizationType

    fmt = _block_types().get(tensor.tensor_type)
    if fmt is None:
        return None
    rows = torch.from_numpy(np.asarray(tensor.data).copy())
    rows = rows.reshape(rows.shape[:-1].numel(), -1)
    if tensor.tensor_type == GGMLQuantizationType.Q4_0:
        as_q4_1 = gguf_blocks.q4_0_as_q4_1(rows)
        if as_q4_1 is None:
            return None
        rows = as_q4_1
    return fmt, rows


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
        Type.MXFP4: gguf_blocks.MXFP4,
    }


def block_rows(
    tensor: Any, architecture: str, config: Any, weight: torch.Tensor
) -> tuple[BlockFormat, torch.Tensor] | None:
    """The GGUF tensor's blocks in a type panels hold, rows in the order the model holds them
    (Q4_0 as the Q4_1 blocks of the same weights), where they widen to exactly `weight`; else
    None."""
    held = panel_rows(tensor) if len(tensor.shape) == 2 else None
    if held is None:
        return None
    fmt, rows = held
    if architecture == "llama":
        rows = unpermute_rows(tensor.name, rows, config)
    return (fmt, rows) if gguf_blocks.holds(fmt, rows, weight) else None


def metadata(reader: Any, key: str) -> Any:
    """The value (a number, a string) the GGUF file's metadata `key` holds; None where the
    file has none."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


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
