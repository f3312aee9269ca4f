"""AWQ and GPTQ checkpoints as `--model`: `conveyor serve --model Qwen/Qwen2.5-0.5B-Instruct-AWQ`
(or a folder of one), as `vllm serve` takes them.

A checkpoint whose config says `quant_method` `awq` (AutoAWQ's GEMM packing, 4-bit) or `gptq`
(4- or 8-bit, 2-bit too; GPTQ's own format or its v2) is converted once into Conveyor's cache:
each quantized layer's weight `scale * (q - zero)`, computed in fp32, where it is exact (scales
in fp16 or bf16), saved as a plain checkpoint with every other file of the folder (tokenizer,
chat template, generation config). Where each 32 inputs of a row share one group (groups of 32,
64, 128 or a whole row, not GPTQ's act-order groups), the layer's 4- or 8-bit groups are kept
beside in blocks (`gguf_blocks.Q4_G`, `Q8_G`) that widen to exactly those weights, for the CPU's
panel product to read instead of the fp32 weights, as a GGUF file's blocks are. Later starts load
the folder in seconds; changed weight files convert again.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.paths import cache_dir
from engine.loading import gguf_blocks
from engine.loading.conversions import convert_once, source_key

logger = logging.getLogger(__name__)

# Written last into a converted folder: its presence says the conversion finished.
SOURCE_FILE = "conveyor-quantized.json"
METHODS = ("awq", "gptq")
# AutoAWQ packs eight 4-bit outputs in a word in this order; column k of 8 sits in field
# AWQ_FIELDS[k].
AWQ_FIELDS = (0, 4, 1, 5, 2, 6, 3, 7)
QUANTIZED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# fp32 bytes per converted weight file.
SHARD_BYTES = 2 << 30
# Files of a hub checkpoint a conversion reads (not its `.bin` or other frameworks' copies).
# A hub repository's id, `org/name`.
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]


@dataclass(frozen=True, slots=True)
class Scheme:
    """How a checkpoint's quantized layers are stored."""

    method: str  # awq or gptq
    bits: int
    group_size: int  # -1: one group per row
    zero_offset: int = 0  # GPTQ's own format stores each zero less one


def scheme_of(folder: Path) -> Scheme | None:
    """The AWQ or GPTQ scheme of the checkpoint in `folder` (its config's `quantization_config`,
    or an older GPTQ checkpoint's `quantize_config.json`); None for any other checkpoint.
    Refused, by what it is, where the packing is one Conveyor does not read."""
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


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else {}


def quantized_folder(name: str) -> Path | None:
    """The local folder of the AWQ or GPTQ checkpoint `--model` names (a folder, or a hub id
    fetched into the Hugging Face cache); None where `name` is no such checkpoint."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder if scheme_of(folder) is not None else None
    return _hub_checkpoint(name) if HUB_ID.match(name) else None


@functools.cache
def _hub_checkpoint(repo: str) -> Path | None:
    """The hub checkpoint `repo`, fetched, where its config says AWQ or GPTQ; None where it says
    otherwise or cannot be read (loading it then reports why). Once per process: a start asks
    for the checkpoint several times."""
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        config = Path(hf_hub_download(repo, "config.json"))
    except Exception:  # not a hub id, offline, no such file: loading reports it
        return None
    if scheme_of(config.parent) is None:
        return None
    return Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS))


def converted_folder(folder: Path, label: str) -> Path:
    """Where the conversion of the checkpoint in `folder`, named `label`, lives in the cache."""
    sources = [folder / "config.json", *_weight_files(folder)]
    name = label.rstrip("/").rpartition("/")[2] or folder.name
    return cache_dir() / "models" / "quantized" / f"{name}-{source_key(sources)}"


def ensure_converted(name: str) -> Path:
    """The plain checkpoint folder converted from the AWQ or GPTQ checkpoint `name` (a folder
    or hub id), converting it on first use."""
    folder = quantized_folder(name)
    if folder is None:
        raise ValueError(f"--model {name}: not an AWQ or GPTQ checkpoint")
    target = converted_folder(folder, name)

    def converted(staged: Path) -> dict[str, object]:
        blocks = convert(folder, staged)
        logger.info("%s converted into %s", name, target)
        return {"checkpoint": str(folder.resolve()), "blocks": blocks}

    return convert_once(target, SOURCE_FILE, converted)


def convert(folder: Path, out: Path) -> int:
    """Write the checkpoint in `folder` to `out` with each quantized layer's weight in fp32 and
    its blocks beside where they hold it; return how many layers kept blocks."""
    from safetensors.torch import save_file

    scheme = scheme_of(folder)
    assert scheme is not None
    files = _weight_files(folder)
    if not files:
        raise ValueError(f"{folder}: an {scheme.method.upper()} checkpoint needs safetensors files")
    logger.info(
        "converting %s (%s, %d-bit, groups of %d) to a checkpoint with fp32 weights ...",
        folder,
        scheme.method.upper(),
        scheme.bits,
        scheme.group_size,
    )
    out.mkdir(parents=True)
    blocks: dict[str, tuple[gguf_blocks.BlockFormat, torch.Tensor]] = {}
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in _dense_tensors(folder, files, scheme, blocks):
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) >= SHARD_BYTES:
            shards.append({})
        shards[-1][name] = tensor
    _save_shards(shards, out, save_file)
    _copy_other_files(folder, out)
    if blocks:
        gguf_blocks.save(blocks, out / gguf_blocks.BLOCKS_FILE)
    logger.info("%d linear layers keep their quantized groups as blocks", len(blocks))
    return len(blocks)


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _dense_tensors(
    folder: Path,
    files: list[Path],
    scheme: Scheme,
    blocks: dict[str, tuple[gguf_blocks.BlockFormat, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, a quantized layer's parts as its fp32 `weight`, floating
    point ones in fp32; the blocks of the layers that have them go into `blocks`."""
    from safetensors import safe_open

    opened = [safe_open(str(path), framework="pt") for path in files]
    where = {name: handle for handle in opened for name in handle.keys()}  # noqa: SIM118
    layers = sorted(n.removesuffix(".qweight") for n in where if n.endswith(".qweight"))
    parts = {f"{layer}.{part}" for layer in layers for part in QUANTIZED_PARTS}
    for layer in layers:
        found = {
            part: where[f"{layer}.{part}"].get_tensor(f"{layer}.{part}")
            for part in QUANTIZED_PARTS
            if f"{layer}.{part}" in where
        }
        try:
            weight, held = dequantize(scheme, found)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise ValueError(f"{folder}: cannot read the quantized layer {layer}: {exc}") from exc
        if held is not None:
            blocks[layer] = held
        yield f"{layer}.weight", weight
    for name, handle in where.items():
        if name not in parts:
            tensor = handle.get_tensor(name)
            yield name, tensor.float() if tensor.is_floating_point() else tensor


def dequantize(
    scheme: Scheme, parts: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, tuple[gguf_blocks.BlockFormat, torch.Tensor] | None]:
    """A quantized layer's `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`) as its fp32 weight
    `[out, in]`, and its blocks where each 32 inputs of a row share a group and the bits fit."""
    if scheme.method == "awq":
        q = _awq_columns(_fields(parts["qweight"], 4))  # [in, out]
        zeros = _awq_columns(_fields(parts["qzeros"], 4))  # [groups, out]
    else:
        words = parts["qweight"]  # [in * bits / 32, out], inputs packed down the columns
        q = _fields(words.t(), scheme.bits).t()
        zeros = _fields(parts["qzeros"], scheme.bits) + scheme.zero_offset
    scales = parts["scales"].float()  # [groups, out]
    groups = _group_of_input(scheme, parts.get("g_idx"), q.shape[0])
    q = q.t()  # [out, in]
    zero = zeros[groups].t()  # per input, [out, in]
    scale = scales[groups].t()
    weight = (q - zero).float() * scale
    return weight.contiguous(), _blocks(scheme, groups, q, zero, scale)


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words `[rows, n]` as their `32 / bits` fields each, lowest first: `[rows, n * 32 /
    bits]` int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.flatten(-2)


def _awq_columns(fields: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's fields `[rows, out]` in column order."""
    order = torch.tensor(AWQ_FIELDS)
    index = (torch.arange(fields.shape[1]) // 8 * 8).view(-1, 8) + order
    return fields[:, index.flatten()]


def _group_of_input(scheme: Scheme, g_idx: torch.Tensor | None, inputs: int) -> torch.Tensor:
    """Each input feature's group: GPTQ's `g_idx` where the checkpoint has one (act-order
    checkpoints' groups are not runs of inputs), else runs of `group_size` inputs."""
    if g_idx is not None:
        return g_idx.long()
    size = inputs if scheme.group_size <= 0 else scheme.group_size
    return torch.arange(inputs) // size


def _blocks(
    scheme: Scheme, groups: torch.Tensor, q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor
) -> tuple[gguf_blocks.BlockFormat, torch.Tensor] | None:
    """Q4_G or Q8_G rows of the layer, where each 32-wide block of inputs is in one group."""
    out, inputs = q.shape
    if scheme.bits not in (4, 8) or inputs % gguf_blocks.BLOCK:
        return None
    runs = groups.view(-1, gguf_blocks.BLOCK)
    if not torch.equal(runs, runs[:, :1].expand_as(runs)):
        return None
    first = slice(None, None, gguf_blocks.BLOCK)  # each block's first input holds its group's
    d, zeros = scale[:, first], zero[:, first]
    blocks = q.view(out, -1, gguf_blocks.BLOCK)
    if scheme.bits == 4:  # d * q - d * zero
        return gguf_blocks.Q4_G, gguf_blocks.group_rows(d, -d * zeros, blocks.to(torch.uint8))
    # 8-bit q as int8 q - 128: d * (q - 128) + d * (128 - zero)
    shifted = (blocks - 128).to(torch.int8)
    return gguf_blocks.Q8_G, gguf_blocks.group_rows(d, d * (128 - zeros), shifted)


def _save_shards(shards: list[dict[str, torch.Tensor]], out: Path, save_file: Any) -> None:
    """Weights as one `model.safetensors`, or numbered files with an index."""
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _copy_other_files(folder: Path, out: Path) -> None:
    """Every file but the weights and the quantization settings, the config without them (and
    saying fp32)."""
    skipped = {"model.safetensors.index.json", "quantize_config.json", "config.json"}
    for path in folder.iterdir():
        if path.is_file() and path.suffix not in WEIGHT_SUFFIXES and path.name not in skipped:
            shutil.copyfile(path, out / path.name)
    config = _read_json(folder / "config.json")
    config.pop("quantization_config", None)
    config["dtype"] = config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
