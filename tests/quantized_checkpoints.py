"""AWQ and GPTQ checkpoints written from tiny transformers models, as AutoAWQ and GPTQ's tools lay
them out: each decoder projection as random integers, zeros and fp16 scales packed into int32
words (AutoAWQ: eight outputs to a word in its interleaved order; GPTQ: inputs down the columns,
zeros less one in its own format), every other tensor in fp16, the settings in the config's
`quantization_config`. The model is given the weights those stand for, so it is the oracle."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

# AutoAWQ's packing: field s of a word holds column 8c + AWQ_PACK_ORDER[s].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_words(fields: np.ndarray, bits: int) -> np.ndarray:
    """`[..., n]` integers below 2**bits as int32 words `[..., n * bits / 32]`, field j of each
    word at bit j * bits."""
    per_word = 32 // bits
    grouped = fields.astype(np.uint64).reshape(*fields.shape[:-1], -1, per_word)
    words = np.zeros(grouped.shape[:-1], dtype=np.uint64)
    for j in range(per_word):
        words |= grouped[..., j] << np.uint64(j * bits)
    return words.astype(np.uint32).view(np.int32)


@dataclass(frozen=True)
class Layout:
    """How an AWQ or GPTQ checkpoint stores its layers."""

    method: str  # awq or gptq
    bits: int = 4
    group_size: int = 32  # -1: one group per row
    act_order: bool = False  # GPTQ's groups of inputs in a shuffled order
    v2: bool = False  # GPTQ's v2 format: zeros as they are, not less one
    symmetric: bool = False  # every zero 2**(bits - 1)

    @property
    def least_zero(self) -> int:
        """GPTQ's own format stores each zero less one: zero 0 cannot be stored."""
        return 1 if self.method == "gptq" and not self.v2 else 0


def quantized_layer(
    out: int, inputs: int, layout: Layout, rng: np.random.Generator
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A layer of random integers, zeros and scales: its stored tensors, and the fp32 weight
    `[out, in]` they stand for."""
    bits = layout.bits
    size = inputs if layout.group_size <= 0 else layout.group_size
    q = rng.integers(0, 2**bits, (inputs, out))
    zeros = rng.integers(layout.least_zero, 2**bits, (inputs // size, out))
    if layout.symmetric:
        zeros[:] = 1 << (bits - 1)
    top = 0.3 / 2 ** (bits - 1)
    scales = rng.uniform(0.5 * top, top, zeros.shape).astype(np.float16)
    g_idx = np.arange(inputs) // size
    if layout.act_order:
        g_idx = g_idx[rng.permutation(inputs)]
    return _stored(q, zeros, scales, g_idx, layout)


def rounded_layer(
    weight: np.ndarray, layout: Layout
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`weight [out, in]` rounded to the nearest of its group's `2**bits` levels between the
    group's least and greatest weight (not AWQ's or GPTQ's search, the same storage)."""
    bits = layout.bits
    out, inputs = weight.shape
    size = inputs if layout.group_size <= 0 else layout.group_size
    grouped = weight.T.reshape(inputs // size, size, out)
    low, high = np.minimum(grouped.min(1), 0), np.maximum(grouped.max(1), 0)
    if layout.symmetric:  # GPTQ's: levels around zero 2**(bits - 1)
        high = np.maximum(high, -low)
        low = -high
    scales = np.maximum((high - low) / (2**bits - 1), 1e-8).astype(np.float16)
    zeros = np.clip(np.round(-low / scales.astype(np.float64)), layout.least_zero, 2**bits - 1)
    if layout.symmetric:
        zeros[:] = 1 << (bits - 1)
    g_idx = np.arange(inputs) // size
    q = np.round(weight.T / scales[g_idx].astype(np.float64)) + zeros[g_idx]
    q = np.clip(q, 0, 2**bits - 1).astype(np.int64)
    return _stored(q, zeros.astype(np.int64), scales, g_idx, layout)


def _stored(
    q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray, layout: Layout
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Integers `q [in, out]`, zeros and fp16 scales `[groups, out]` and each input's group as
    the method stores them, and the fp32 weight `[out, in]` they stand for."""
    bits = layout.bits
    out = q.shape[1]
    weight = scales[g_idx].astype(np.float64) * (q - zeros[g_idx])
    stored_zeros = zeros - layout.least_zero
    if layout.method == "awq":
        order = np.asarray(AWQ_PACK_ORDER)
        columns = ((np.arange(out) // 8 * 8).reshape(-1, 8) + order).ravel()
        tensors = {
            "qweight": pack_words(q[:, columns], bits),
            "qzeros": pack_words(stored_zeros[:, columns], bits),
        }
    else:
        tensors = {
            "qweight": pack_words(q.T, bits).T.copy(),
            "qzeros": pack_words(stored_zeros, bits),
            "g_idx": g_idx.astype(np.int32),
        }
    tensors["scales"] = scales
    found = {name: torch.from_numpy(np.ascontiguousarray(t)) for name, t in tensors.items()}
    return found, torch.from_numpy(weight.T.astype(np.float32)).contiguous()


def write_quantized(
    folder: Path,
    model: Any,
    tokenizer: Any,
    layout: Layout,
    seed: int = 0,
    rounded: bool = False,
) -> int:
    """Save `model` as an AWQ or GPTQ checkpoint in two weight files with an index, and set its
    weights to what the checkpoint holds; return how many layers are quantized. Its decoder's
    projections are random integers, or with `rounded` its own weights rounded to them."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                if rounded:
                    parts, weight = rounded_layer(module.weight.float().numpy(), layout)
                else:
                    parts, weight = quantized_layer(*module.weight.shape, layout, rng)
                tensors.update({f"{name}.{part}": t for part, t in parts.items()})
                module.weight.copy_(weight)
                quantized += 1
        for name, param in model.named_parameters():
            if f"{name.removesuffix('.weight')}.qweight" not in tensors:
                param.copy_(param.half().float())  # stored in fp16
                tensors.setdefault(name, param.half().contiguous())
    _save_two_files(folder, tensors)
    config = model.config.to_dict()
    config["torch_dtype"] = "float16"
    config["quantization_config"] = _settings(layout)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(folder)
    return quantized


def _settings(layout: Layout) -> dict:
    if layout.method == "awq":
        return {
            "quant_method": "awq",
            "bits": layout.bits,
            "group_size": layout.group_size,
            "version": "gemm",
            "zero_point": True,
        }
    return {
        "quant_method": "gptq",
        "bits": layout.bits,
        "group_size": layout.group_size,
        "desc_act": layout.act_order,
        "sym": layout.symmetric,
        "checkpoint_format": "gptq_v2" if layout.v2 else "gptq",
    }


def _save_two_files(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for number, half in enumerate(halves, 1):
        file = f"model-{number:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in half}, str(folder / file))
        weight_map.update(dict.fromkeys(half, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def write_compressed_tensors(
    folder: Path,
    model: Any,
    tokenizer: Any,
    bits: int = 4,
    group_size: int | None = 32,
    symmetric: bool = False,
    fp8: bool = False,
    int8: bool = False,
) -> int:
    """Save `model` as llm-compressor saves a checkpoint, with compressed-tensors' own code: its
    decoder projections quantized from the model's weights in bf16 (integers of `bits` in
    groups of `group_size` inputs, or one scale per row for None: the W4A16 and W8A16 schemes,
    packed; with `fp8`, FP8 weights with a scale per row, the FP8 W8A8 scheme; with `int8`,
    unpacked INT8 weights with a scale per row, the W8A8 scheme); set the model's
    weights to what the checkpoint holds, dequantized in float64 from the saved tensors (with
    compressed-tensors' unpacking); return how many layers are quantized."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = "channel" if group_size is None or fp8 else "group"
    weights = QuantizationArgs(
        num_bits=8 if fp8 else bits,
        type="float" if fp8 else "int",
        symmetric=symmetric or fp8,
        strategy=strategy,
        group_size=None if strategy == "channel" else group_size,
    )
    activations = None
    if fp8 or int8:
        kind = "float" if fp8 else "int"
        activations = QuantizationArgs(num_bits=8, type=kind, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    stored = type(model)(model.config).to(torch.bfloat16).eval()
    stored.load_state_dict(model.state_dict())
    apply_quantization_config(
        stored, QuantizationConfig(config_groups={"g": scheme}, ignore=["lm_head"])
    )
    quantized = 0
    for module in stored.modules():
        if hasattr(module, "weight_scale"):
            weight = module.weight.data
            width = weight.shape[1] if strategy == "channel" else group_size
            grouped = weight.view(weight.shape[0], -1, width)
            scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), weights)
            module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.view_as(module.weight_zero_point))
            quantized += 1
    compressor = ModelCompressor.from_pretrained_model(stored)
    compressor.compress_model(stored)
    stored.save_pretrained(folder)
    compressor.update_config(str(folder))
    tokenizer.save_pretrained(folder)
    _hold_what_was_saved(folder, model, bits)
    return quantized


def _hold_what_was_saved(folder: Path, model: Any, bits: int) -> None:
    """Set `model`'s weights to the checkpoint's in `folder`: bf16 tensors widened, quantized
    layers `scale * (q - zero)` in float64 from compressed-tensors' unpacking."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as saved:
        tensors = {name: saved.get_tensor(name) for name in saved.keys()}  # noqa: SIM118
    held = {}
    for name, tensor in tensors.items():
        layer, _, part = name.rpartition(".")
        if part in ("weight_packed", "weight") and f"{layer}.weight_scale" in tensors:
            scale = tensors[f"{layer}.weight_scale"].double()
            if part == "weight_packed":
                shape = tuple(tensors[f"{layer}.weight_shape"].tolist())
                q = unpack_from_int32(tensor, bits, torch.Size(shape)).double()
            else:
                q = tensor.double()  # FP8
            zero = tensors.get(f"{layer}.weight_zero_point")
            if zero is not None:
                zero_shape = torch.Size((shape[0], scale.shape[1]))
                q = q - unpack_from_int32(
                    zero, bits, zero_shape, packed_dim=0
                ).double().repeat_interleave(q.shape[1] // scale.shape[1], dim=1)
            held[f"{layer}.weight"] = (
                q * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)
            ).float()
        elif part not in ("weight_scale", "weight_zero_point", "weight_shape", "weight_packed"):
            held[name] = tensor.float()
    model.load_state_dict(held, strict=True)


def write_fp8_blocks(folder: Path, model: Any, tokenizer: Any, block: int = 32) -> int:
    """Save `model` as a fine-grained FP8 checkpoint (DeepSeek's and Qwen's `-FP8` ones): each
    decoder projection in float8_e4m3fn with an fp32 scale per `block` x `block` tile
    (`weight_scale_inv`), every other tensor in bf16; set the model's weights to what it holds;
    return how many layers are quantized."""
    tensors, held, quantized = {}, {}, 0
    for name, tensor in model.state_dict().items():
        if ".layers." in name and name.endswith("proj.weight"):
            out, inputs = tensor.shape
            tiles = tensor.abs().reshape(out // block, block, inputs // block, block)
            scale = tiles.amax((1, 3)) / 448
            wide = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
            q = (tensor / wide).to(torch.float8_e4m3fn)
            tensors[name], tensors[f"{name}_scale_inv"] = q, scale.float()
            held[name] = (q.double() * wide.double()).float()
            quantized += 1
        else:
            tensors[name] = tensor.to(torch.bfloat16)
            held[name] = tensors[name].float()
    save_file(tensors, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(folder)
    model.load_state_dict(held)
    return quantized


def quantize_saved(folder: Path, layout: Layout, seed: int = 0) -> Path:
    """Turn the dense checkpoint saved in `folder` (one `model.safetensors`, names as on disk:
    a mixture's experts one by one) into an AWQ or GPTQ one, every decoder projection random
    integers; return the folder of the dense checkpoint they stand for (the oracle's)."""
    from safetensors import safe_open

    rng = np.random.default_rng(seed)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as saved:
        dense = {name: saved.get_tensor(name) for name in saved.keys()}  # noqa: SIM118
    tensors, held = {}, {}
    for name, tensor in dense.items():
        projection = name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))
        if ".layers." in name and projection and tensor.dim() == 2:  # Mixtral's experts: w1..3
            parts, weight = quantized_layer(*tensor.shape, layout, rng)
            layer = name.removesuffix(".weight")
            tensors.update({f"{layer}.{part}": t for part, t in parts.items()})
            held[name] = weight
        else:
            tensors[name] = tensor.half()
            held[name] = tensors[name].float()
    oracle = folder / "dense"
    oracle.mkdir()
    for path in folder.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            (oracle / path.name).write_bytes(path.read_bytes())
    save_file(held, str(oracle / "model.safetensors"))
    _save_two_files(folder, tensors)
    (folder / "model.safetensors").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = _settings(layout)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return oracle
