"""The scales of an fp8 KV cache: where each layer's key and value scales come from.

An fp8 cache stores K/V divided by a per-layer scale, so that the values fill the format's
range (e4m3 holds at most 448, with three bits of mantissa). The scales come, as in vLLM,

- from the checkpoint, where a quantizer wrote them (`model.layers.N.self_attn.k_scale` and
  `v_scale`, ModelOpt's `self_attn.k_proj.k_scale`, AutoFP8's `k_proj.output_scale`, or the
  older single `kv_scale` for both);
- or, with `--calculate-kv-scales`, from the first step the server runs: each layer's largest
  |K| maps to `KEY_RANGE` and its largest |V| to `VALUE_RANGE`, below e4m3's 448 to leave room
  for later tokens that reach further;
- else they are 1.0.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# What the first step's largest |K| and |V| are stored as (vLLM's defaults).
KEY_RANGE = 200.0
VALUE_RANGE = 100.0

# `...layers.<n>.self_attn.` then `k_scale`, `v_scale`, `kv_scale`, `k_proj.k_scale`,
# `v_proj.v_scale` or `k_proj.output_scale` / `v_proj.output_scale`.
_SCALE_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\."
    r"(?:(?P<kind>kv|k|v)_scale|(?P<proj>k|v)_proj\.(?:(?P=proj)_scale|output_scale))$"
)


def calibrated_scales(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`[2]` fp32: the key and value scales that store these K/V's largest magnitudes as
    `KEY_RANGE` and `VALUE_RANGE` (1.0 for an all-zero tensor)."""
    largest = torch.stack([key.abs().amax().float(), value.abs().amax().float()])
    ranges = torch.tensor([KEY_RANGE, VALUE_RANGE], device=largest.device)
    return torch.where(largest > 0, largest / ranges, torch.ones_like(largest))


def checkpoint_kv_scales(model: str, num_layers: int) -> torch.Tensor | None:
    """The KV scales the safetensors files of `model` (a folder, or a hub id already in the
    local cache) hold, `[layers, 2]` (key, value) with 1.0 for a layer they give none; None
    when they give none at all. A scale given per head or per channel becomes its largest
    entry, so no value saturates."""
    path = _checkpoint_folder(model)
    if path is None:
        return None
    scales = torch.ones(num_layers, 2, dtype=torch.float32)
    found = 0
    for file in sorted(path.glob("*.safetensors")):
        found += _read_scales(file, scales)
    if not found:
        return None
    logger.info("fp8 KV cache scales from the checkpoint: %d of %d layers", found, num_layers)
    return scales


def _checkpoint_folder(model: str) -> Path | None:
    if not model:
        return None
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not a hub id, or not in the local cache
        return None


def _read_scales(file: Path, scales: torch.Tensor) -> int:
    """Fill `scales` from the scale tensors in one safetensors file; how many layers had any."""
    from safetensors import safe_open

    layers = set()
    with safe_open(str(file), framework="pt") as reader:
        for name in reader.keys():  # noqa: SIM118  (a reader, not a dict)
            match = _SCALE_KEY.search(name)
            if match is None:
                continue
            layer = int(match.group(1))
            if layer >= scales.shape[0]:
                continue
            scale = float(reader.get_tensor(name).float().max())
            if not scale > 0:
                raise ValueError(f"{file.name}: {name} is {scale}, not a positive scale")
            kind = match.group("kind") or match.group("proj")
            for column in {"k": (0,), "v": (1,), "kv": (0, 1)}[kind]:
                scales[layer, column] = scale
            layers.add(layer)
    return len(layers)
