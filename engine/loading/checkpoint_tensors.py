"""A model's parameters read one at a time from a checkpoint's safetensors files.

The model is built from its config with its parameters on the meta device (no memory), and each
parameter is then read from the checkpoint tensor(s) of its name, whole or as one rank's share
of them (`parallel.loading`): no moment holds the model twice, and a caller can first put other
layers in place of some (`block_model`: quantized layers held as their blocks), whose weights
are then never read. A converted checkpoint's layers kept only as blocks read as their blocks
dequantized.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.loading import gguf_blocks
from engine.loading.expert_blocks import expert_layer
from engine.loading.gguf_blocks import BlockFormat, Blocks


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


# The names transformers gives tensors as it loads them, and the checkpoints' own (Granite's
# MoE models' experts, held stacked as here, and router).
RENAMED = {
    ".block_sparse_moe.experts.gate_up_proj": ".block_sparse_moe.input_linear.weight",
    ".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight",
    ".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight",
}


def _renamed(name: str) -> list[str]:
    """The checkpoint's other names for the parameter `name`."""
    return [
        name.removesuffix(ours) + theirs for ours, theirs in RENAMED.items() if name.endswith(ours)
    ]


def tensor_index(files: list[Path]) -> dict[str, Path]:
    """The file holding each tensor of the safetensors `files`."""
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            index.update(dict.fromkeys(handle.keys(), file))
    return index


class CheckpointTensors:
    """The checkpoint's tensors by name, each file opened once. A converted checkpoint keeps no
    fp32 weight for a layer held as blocks: such a weight reads as its blocks dequantized
    (`blocks`, by layer name)."""

    def __init__(self, index: dict[str, Path], blocks: Blocks | None = None) -> None:
        self.index = index
        self.blocks = {} if blocks is None else blocks
        self._files = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.close()

    def key(self, name: str) -> str:
        """The checkpoint's name for a parameter: the same, without the base model's prefix or
        with Nemotron-H's (`backbone.`) for it, with Mixtral's `block_sparse_moe` for `mlp`, or
        as Granite's MoE checkpoints name it."""
        candidates = (name, name.replace(".mlp.", ".block_sparse_moe."), *_renamed(name))
        for candidate in candidates:
            bare = candidate.removeprefix("model.")
            for key in (candidate, bare, f"backbone.{bare}"):
                if key in self.index or self._from_blocks(key) is not None:
                    return key
        raise KeyError(name)

    def _from_blocks(self, key: str) -> DequantizedRows | None:
        """A reader of the weight `key` the checkpoint keeps only as blocks: a layer's, or a
        layer's experts' (`gate_up_proj`, `down_proj`) from each expert's layer's blocks."""
        if key in self.index:
            return None
        layer = key.removesuffix(".weight")
        if layer != key and layer in self.blocks:
            return DequantizedRows([self.blocks[layer]])
        owner, _, kind = key.rpartition(".")
        if kind not in ("gate_up_proj", "down_proj"):
            return None
        part = kind.removesuffix("_proj")
        experts: list[tuple[BlockFormat, torch.Tensor]] = []
        while expert_layer(owner, part, len(experts)) in self.blocks:
            experts.append(self.blocks[expert_layer(owner, part, len(experts))])
        return DequantizedRows(experts, stacked=True) if experts else None

    def slice(self, key: str) -> Any:
        """A reader of the tensor `key` that reads only what it is indexed with."""
        from safetensors import safe_open

        held = self._from_blocks(key)
        if held is not None:
            return held
        file = self.index[key]
        if file not in self._handles:
            self._handles[file] = self._files.enter_context(safe_open(str(file), "pt"))
        return self._handles[file].get_slice(key)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole checkpoint tensor behind parameter `name`."""
        return self.slice(self.key(name))[:]


class DequantizedRows:
    """A layer's blocks read as its fp32 weight (or, `stacked`, the blocks of each of a layer's
    experts as the experts' weights one above the other), as a safetensors slice is read."""

    def __init__(self, parts: list[tuple[BlockFormat, torch.Tensor]], stacked: bool = False):
        self.parts = parts
        self.stacked = stacked

    def get_shape(self) -> list[int]:
        fmt, rows = self.parts[0]
        shape = [rows.shape[0], gguf_blocks.in_features(fmt, rows)]
        return [len(self.parts), *shape] if self.stacked else shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        weights = [gguf_blocks.dequantize_rows(fmt, rows) for fmt, rows in self.parts]
        whole = torch.stack(weights) if self.stacked else weights[0]
        return whole[index].contiguous()


# Each expert's own tensors, as checkpoints name them: (gate, up, down), Qwen's and Mixtral's.
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def fill(
    model: nn.Module,
    checkpoint: CheckpointTensors,
    dtype: torch.dtype,
    read: Callable[[str, CheckpointTensors], torch.Tensor] | None = None,
) -> None:
    """Every parameter of `model` still on the meta device read from `checkpoint`, as
    `read(name, checkpoint)` gives it (default: whole), and every persistent buffer the
    checkpoint holds (a router's bias); each in `dtype` but those the model keeps in fp32.
    Raises KeyError naming a parameter the checkpoint lacks."""
    read = read or whole_tensor
    kept = kept_in_fp32(model, dtype)
    for name, param in list(model.named_parameters()):
        if not param.is_meta:
            continue
        tensor = read(name, checkpoint).to(_dtype_of(name, dtype, kept))
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            name = f"{module_name}.{attr}" if module_name else attr
            if buffer is None or attr in module._non_persistent_buffers_set:
                continue
            try:
                tensor = checkpoint.tensor(name)
            except KeyError:
                continue  # left as the model built it
            module._buffers[attr] = tensor.to(_dtype_of(name, dtype, kept))


def kept_in_fp32(model: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The name patterns of the tensors transformers keeps in fp32 in a 16-bit model (a
    router's weight and bias, in DeepSeek V3's kind), as it loads them."""
    if dtype not in (torch.float16, torch.bfloat16):
        return ()
    patterns = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        patterns |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return tuple(sorted(patterns))


def _dtype_of(name: str, dtype: torch.dtype, kept: tuple[str, ...]) -> torch.dtype:
    return torch.float32 if any(pattern in name for pattern in kept) else dtype


def whole_tensor(name: str, checkpoint: CheckpointTensors) -> torch.Tensor:
    """Parameter `name` whole: its checkpoint tensor, or a layer's experts stacked."""
    owner, _, kind = name.rpartition(".")
    try:
        return checkpoint.tensor(name)
    except KeyError:
        if owner.endswith(".experts") and kind in ("gate_up_proj", "down_proj"):
            return stacked_experts(owner, kind, checkpoint, slice(None))
        raise


def stacked_experts(
    owner: str, kind: str, checkpoint: CheckpointTensors, channels: slice
) -> torch.Tensor:
    """A layer's experts stacked as Hugging Face holds them (`[experts, 2 * inter, hidden]`,
    gate above up; `[experts, hidden, inter]`), each cut to `channels`, read from the
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
    return _stacked_gateless(owner, kind, checkpoint, channels)


def _stacked_gateless(
    owner: str, kind: str, checkpoint: CheckpointTensors, channels: slice
) -> torch.Tensor:
    """A layer's experts without a gate stacked as Hugging Face holds them (`up_proj`
    `[experts, inter, hidden]`, `down_proj` `[experts, hidden, inter]`: Nemotron-H's), each cut
    to `channels`, read from each expert's own `up_proj` and `down_proj`."""
    shares = []
    for expert in itertools.count():
        try:
            key = checkpoint.key(f"{owner}.{expert}.{kind}.weight")
        except KeyError:
            break
        reader = checkpoint.slice(key)
        shares.append(reader[:, channels] if kind == "down_proj" else reader[channels])
    if not shares or kind not in ("up_proj", "down_proj"):
        raise KeyError(f"{owner}.{kind}")
    return torch.stack(shares)
