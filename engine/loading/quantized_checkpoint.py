"""Quantized checkpoints as `--model`: `conveyor serve --model Qwen/Qwen2.5-0.5B-Instruct-AWQ` (or a
folder of one), as `vllm serve` takes them: AWQ, GPTQ, compressed-tensors (llm-compressor's
W4A16, W8A16, W8A8 and FP8 schemes) and FP8 checkpoints.

Such a checkpoint is converted once into Conveyor's cache, a layer at a time, as one with fp32
weights and every other file of its folder (tokenizer, chat template, generation config). The
weights are read here (`packed_weights.py`): integers packed in words (AWQ's GEMM packing, GPTQ's
2, 4 or 8 bits in its own format or its v2, compressed-tensors' pack-quantized schemes) or stored
unpacked (INT8), each weight `scale * (q - zero)`, exact in fp32; FP8 weights times their scale per
row, group, tensor or tile. Where each 32 inputs of a row share one group, a layer's 4- or 8-bit
integers are kept as blocks that widen to exactly its weights, instead of its fp32 weight, as a
GGUF file's blocks are: the CPU's panel product reads them, other forms dequantize them as they
load (`block_model`). compressed-tensors' other formats (NVFP4, MXFP4) are dequantized by
transformers. Later starts load the folder in seconds; changed weight files convert again.

An MXFP4 checkpoint (gpt-oss as published: its experts in 4-bit blocks) is not converted: in fp32
on a CPU its experts hold their blocks (`mxfp4_experts`), elsewhere transformers dequantizes them
to the model's dtype as it loads (`load_options`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.config import EngineConfig
from engine.core.paths import cache_dir
from engine.loading import gguf_blocks, packed_weights
from engine.loading.checkpoint_tensors import model_from_config, parameters_on_meta
from engine.loading.conversions import ShardWriter, convert_once, source_key
from engine.loading.expert_blocks import CHECKPOINT_EXPERT, join_checkpoint_experts
from engine.loading.hub import MODEL_FILES, snapshot

logger = logging.getLogger(__name__)

# Written last into a converted folder: its presence says the conversion finished.
SOURCE_FILE = "conveyor-quantized.json"
MARKERS = packed_weights.MARKERS
# compressed-tensors' formats read here; transformers dequantizes the others (NVFP4, MXFP4).
READ_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# vLLM's `--quantization` names, by the method of the checkpoints they serve.
METHOD_NAMES = {
    "awq_marlin": "awq",
    "gptq_marlin": "gptq",
    "marlin": "gptq",
    "compressed_tensors": "compressed-tensors",
}
# A hub repository's id, `org/name`.
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# Methods transformers dequantizes as the model loads, with no converted copy: MXFP4, the
# experts of gpt-oss as published.
DEQUANTIZED_ON_LOAD = frozenset({"mxfp4"})


@dataclass(frozen=True, slots=True)
class Scheme:
    """How a checkpoint's quantized layers are stored."""

    method: str  # awq, gptq, compressed-tensors or fp8
    bits: int = 0  # 0: each layer's own (compressed-tensors)
    group_size: int = 0  # -1: one group per row; 0: each layer's own
    zero_offset: int = 0  # GPTQ's own format stores each zero less one
    read_here: bool = True  # weights read by `packed_weights`; else transformers dequantizes

    def describe(self) -> str:
        if self.method in ("awq", "gptq"):
            return f"{self.method.upper()}, {self.bits}-bit, groups of {self.group_size}"
        return self.method + ("" if self.read_here else ", dequantized by transformers")


def scheme_of(folder: Path) -> Scheme | None:
    """The quantization scheme of the checkpoint in `folder` (its config's
    `quantization_config`, or an older GPTQ checkpoint's `quantize_config.json`); None for a
    checkpoint of any other kind. Refused, by what it is, where the packing is one Conveyor
    does not read."""
    config = _read_json(folder / "config.json")
    settings = config.get("quantization_config")
    if settings is None and (folder / "quantize_config.json").is_file():
        settings = {"quant_method": "gptq", **_read_json(folder / "quantize_config.json")}
    if not isinstance(settings, dict):
        return None
    method = str(settings.get("quant_method", "")).lower()
    if method == "awq":
        return _awq_scheme(settings)
    if method == "gptq":
        return _gptq_scheme(settings)
    if method == "compressed-tensors":
        return Scheme(method, read_here=_all_read_here(settings))
    if method == "fp8":
        return Scheme(method, bits=8)
    return None


def _awq_scheme(settings: dict[str, Any]) -> Scheme:
    bits = int(settings.get("bits", settings.get("w_bit", 4)))
    group = int(settings.get("group_size", settings.get("q_group_size", 128)))
    version = str(settings.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not settings.get("zero_point", True):
        raise ValueError(
            f"AWQ checkpoint of {bits} bits, version {version!r}, zero_point "
            f"{settings.get('zero_point', True)}: only AutoAWQ's 4-bit GEMM packing with zero "
            "points is served"
        )
    return Scheme("awq", bits, group)


def _gptq_scheme(settings: dict[str, Any]) -> Scheme:
    bits = int(settings.get("bits", 4))
    group = int(settings.get("group_size", 128))
    packing = str(settings.get("checkpoint_format", settings.get("format", "gptq"))).lower()
    if bits not in (2, 4, 8) or packing not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"GPTQ checkpoint of {bits} bits in format {packing!r}: 2-, 4- and 8-bit checkpoints "
            "in GPTQ's own format (or its v2) are served"
        )
    return Scheme("gptq", bits, group, zero_offset=1 if packing == "gptq" else 0)


def _all_read_here(settings: dict[str, Any]) -> bool:
    """Whether every scheme of a compressed-tensors config stores weights read here: integers of
    2, 4 or 8 bits packed in words (W4A16, W8A16) or INT8 ones unpacked (W8A8), in runs of
    inputs, or FP8 weights (FP8 W8A8, FP8 blocks)."""
    groups = settings.get("config_groups") or {}
    formats = settings.get("format")

    def read(group: dict[str, Any]) -> bool:
        weights = group.get("weights") or {}
        fmt = group.get("format") or formats
        if fmt not in READ_FORMATS or weights.get("actorder") not in (None, "weight"):
            return False
        if weights.get("type") == "float":
            return weights.get("num_bits") == 8
        return weights.get("num_bits") in ((2, 4, 8) if fmt == "pack-quantized" else (8,))

    return bool(groups) and all(read(group) for group in groups.values())


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else {}


def method_dequantized_on_load(folder: Path) -> str | None:
    """The checkpoint's quantization method where transformers dequantizes it as it loads
    (`DEQUANTIZED_ON_LOAD`), else None."""
    settings = _read_json(folder / "config.json").get("quantization_config")
    method = str(settings.get("quant_method", "")).lower() if isinstance(settings, dict) else ""
    return method if method in DEQUANTIZED_ON_LOAD else None


def load_options(path: str) -> dict[str, Any]:
    """What transformers' load of the checkpoint at `path` takes beside its dtype: an MXFP4
    checkpoint's experts dequantized to that dtype as they load (transformers' own MXFP4
    kernels would come from a hub, and Conveyor's decoder runs the experts as projections)."""
    if method_dequantized_on_load(Path(path)) == "mxfp4":
        from transformers.utils.quantization_config import Mxfp4Config

        logger.info("%s: MXFP4 experts, dequantized as they load", path)
        return {"quantization_config": Mxfp4Config(dequantize=True)}
    return {}


def quantized_folder(name: str) -> Path | None:
    """The local folder of the quantized checkpoint `--model` names (a folder, or a hub id
    fetched into the Hugging Face cache, an MXFP4 one's too); None where `name` is no such
    checkpoint, or is a local MXFP4 one (read from where it is)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder if scheme_of(folder) is not None else None
    return _hub_checkpoint(name) if HUB_ID.match(name) else None


@functools.cache
def _hub_checkpoint(repo: str) -> Path | None:
    """The hub checkpoint `repo`, fetched, where its config says it is quantized; None where it
    says otherwise or cannot be read (loading it then reports why). The config is read from the
    Hugging Face cache where it is there (an offline host asks the hub nothing), else fetched.
    Once per process: a start asks for the checkpoint several times."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo, "config.json")
        config = Path(cached if isinstance(cached, str) else hf_hub_download(repo, "config.json"))
    except Exception:  # not a hub id, offline, no such file: loading reports it
        return None
    if scheme_of(config.parent) is None and method_dequantized_on_load(config.parent) is None:
        return None
    return snapshot(repo, None, MODEL_FILES, EngineConfig(), weights=True)


def check_requested(name: str | None, requested: str | None) -> None:
    """`--quantization` (vLLM's flag) names the checkpoint's own method, or is refused: Conveyor
    serves quantized checkpoints and GGUF files as they are stored, and quantizes no model as it
    loads. vLLM's names of its kernels for a method (`awq_marlin`) are that method."""
    if requested is None:
        return
    from engine.loading.gguf_file import is_gguf_file

    if name is None or is_gguf_file(name):
        stored: str | None = "gguf"
    else:
        folder = quantized_folder(name)
        scheme = scheme_of(folder) if folder is not None else None
        read_as_is = method_dequantized_on_load(folder or Path(name))
        stored = scheme.method if scheme is not None else read_as_is
    wanted = METHOD_NAMES.get(requested, requested)
    if stored is None:
        raise ValueError(
            f"--quantization {requested}: {name} is not a quantized checkpoint, and Conveyor "
            "does not quantize a model as it loads; serve an AWQ, GPTQ, compressed-tensors, "
            "FP8, MXFP4 or GGUF checkpoint instead"
        )
    if stored != wanted:
        raise ValueError(
            f"--quantization {requested} does not match the checkpoint's quantization ({stored})"
        )


def converted_folder(folder: Path, label: str) -> Path:
    """Where the conversion of the checkpoint in `folder`, named `label`, lives in the cache."""
    sources = [folder / "config.json", *_weight_files(folder)]
    name = label.rstrip("/").rpartition("/")[2] or folder.name
    return cache_dir() / "models" / "quantized" / f"{name}-{source_key(sources)}"


def ensure_converted(name: str) -> Path:
    """The plain checkpoint folder converted from the quantized checkpoint `name` (a folder or
    hub id), converting it on first use."""
    folder = quantized_folder(name)
    if folder is None:
        raise ValueError(f"--model {name}: not a quantized checkpoint")
    target = converted_folder(folder, name)

    def converted(staged: Path) -> dict[str, object]:
        blocks = convert(folder, staged)
        logger.info("%s converted into %s", name, target)
        return {"checkpoint": str(folder.resolve()), "blocks": blocks}

    return convert_once(target, SOURCE_FILE, converted)


def convert(folder: Path, out: Path) -> int:
    """Write the checkpoint in `folder` to `out` with fp32 weights, a layer whose groups its
    blocks hold exactly kept as those blocks instead (where the model has a linear layer of its
    name); return how many layers kept blocks."""
    scheme = scheme_of(folder)
    assert scheme is not None
    files = _weight_files(folder)
    if not files:
        raise ValueError(f"{folder}: a {scheme.method} checkpoint needs safetensors files")
    logger.info("converting %s (%s) to fp32 weights ...", folder, scheme.describe())
    if not scheme.read_here:
        _dequantize_with_transformers(folder, out, scheme)
        return 0
    out.mkdir(parents=True)
    _copy_other_files(folder, out)
    _write_config(folder, out)
    blocks = gguf_blocks.BlockWriter(out)
    writer = ShardWriter(out)
    for name, tensor in _dense_tensors(folder, files, scheme, blocks, model_layout(out)):
        writer.add(name, tensor)
    writer.close()
    kept = blocks.close()
    logger.info("%d linear layers keep their quantized groups as blocks", kept)
    return kept


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _dense_tensors(
    folder: Path,
    files: list[Path],
    scheme: Scheme,
    blocks: gguf_blocks.BlockWriter,
    layout: ModelLayout,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, a quantized layer's parts as its fp32 `weight`, floating
    point ones in fp32; the blocks of the layers that have them go into `blocks`, and a layer of
    the model's linear layers kept so has no `weight`; nor has an expert's projection whose
    layer's experts are all kept so (joined, `expert_blocks`: experts' blocks are held until
    the end)."""
    from safetensors import safe_open

    opened = [safe_open(str(path), framework="pt") for path in files]
    where = {name: handle for handle in opened for name in handle.keys()}  # noqa: SIM118
    layers = sorted(
        {name.rpartition(".")[0] for name in where if name.rpartition(".")[2] in MARKERS}
    )
    experts: gguf_blocks.Blocks = {}
    for layer in layers:
        weight, held = _layer(folder, scheme, where, layer)
        if held is not None and gguf_blocks.holds(*held, weight):
            if layer not in layout.linears and layout.experts and CHECKPOINT_EXPERT.match(layer):
                experts[layer] = held  # written below unless its layer's experts all join
                continue
            blocks.add(layer, *held)
            if layer in layout.linears:
                continue
        yield f"{layer}.weight", weight
    joined, leftover = join_checkpoint_experts(experts, layout.experts)
    blocks.add_all(joined)
    for layer in leftover:
        yield f"{layer}.weight", _layer(folder, scheme, where, layer)[0]
    read = {f"{layer}.{part}" for layer in layers for part in packed_weights.PARTS}
    for name, handle in where.items():
        if name not in read and name.rpartition(".")[2] not in packed_weights.DROPPED:
            tensor = handle.get_tensor(name)
            yield name, tensor.float() if tensor.is_floating_point() else tensor


def _layer(
    folder: Path, scheme: Scheme, where: dict[str, Any], layer: str
) -> tuple[torch.Tensor, tuple[gguf_blocks.BlockFormat, torch.Tensor] | None]:
    """The quantized layer `layer`'s fp32 weight, and its blocks where it has them."""
    parts = {
        part: where[f"{layer}.{part}"].get_tensor(f"{layer}.{part}")
        for part in packed_weights.PARTS
        if f"{layer}.{part}" in where
    }
    try:
        return _read_layer(scheme, parts)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{folder}: cannot read the quantized layer {layer}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """The names of the model's linear layers and of its experts modules."""

    linears: frozenset[str] = frozenset()
    experts: frozenset[str] = frozenset()


def model_layout(out: Path) -> ModelLayout:
    """The linear layers and experts of the model whose config is in folder `out` (none where
    transformers cannot build it: every layer then keeps its fp32 weight too)."""
    from torch import nn

    try:
        with parameters_on_meta():
            model = model_from_config(str(out), torch.float32, trust_remote_code=False)
    except (ImportError, KeyError, OSError, ValueError) as exc:
        logger.info("keeping every layer's fp32 weight: the model cannot be built here (%s)", exc)
        return ModelLayout()
    modules = list(model.named_modules())
    return ModelLayout(
        frozenset(name for name, module in modules if type(module) is nn.Linear),
        frozenset(name for name, module in modules if hasattr(module, "gate_up_proj")),
    )


def _read_layer(
    scheme: Scheme, parts: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, tuple[gguf_blocks.BlockFormat, torch.Tensor] | None]:
    """A quantized layer's fp32 weight, and its blocks where it has them."""
    if "qweight" in parts and scheme.method == "awq":
        integers = packed_weights.awq(parts, scheme.group_size)
    elif "qweight" in parts:
        integers = packed_weights.gptq(parts, scheme.bits, scheme.group_size, scheme.zero_offset)
    elif "weight_packed" in parts:
        integers = packed_weights.pack_quantized(parts)
    else:
        found = packed_weights.unpacked(parts)
        if isinstance(found, torch.Tensor):
            return found, None
        integers = found
    scales = parts.get("scales", parts.get("weight_scale"))
    assert scales is not None  # every integer layer has them
    return integers.weight(), packed_weights.blocks_of(integers, scales)


def _dequantize_with_transformers(folder: Path, out: Path, scheme: Scheme) -> None:
    """A scheme whose weights are not read here (compressed-tensors' NVFP4, MXFP4): transformers
    loads the model dequantized to fp32, and it is saved as it loaded."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    compressed = scheme.method == "compressed-tensors"
    kind = CompressedTensorsConfig if compressed else FineGrainedFP8Config
    try:
        with warnings.catch_warnings():  # that the checkpoint's settings are kept but this one
            warnings.filterwarnings("ignore", message=r".*already has a `quantization_config`")
            model = AutoModelForCausalLM.from_pretrained(
                folder, quantization_config=kind(dequantize=True), dtype=torch.float32
            )
    except (ImportError, KeyError, NotImplementedError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{folder}: transformers cannot dequantize it: {exc}") from exc
    model.save_pretrained(out)
    _copy_other_files(folder, out)


def _copy_other_files(folder: Path, out: Path) -> None:
    """Every file but the weights, the config and the quantization settings, where `out` has
    none of that name yet."""
    skipped = {"model.safetensors.index.json", "quantize_config.json", "config.json"}
    for path in folder.iterdir():
        if (
            path.is_file()
            and path.suffix not in WEIGHT_SUFFIXES
            and path.name not in skipped
            and not (out / path.name).exists()
        ):
            shutil.copyfile(path, out / path.name)


def _write_config(folder: Path, out: Path) -> None:
    """The config without its quantization settings, saying fp32."""
    config = _read_json(folder / "config.json")
    config.pop("quantization_config", None)
    config["dtype"] = config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
