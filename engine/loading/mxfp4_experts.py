"""An MXFP4 checkpoint's experts (gpt-oss as published) held as their blocks.

Each expert projection of such a checkpoint is stored as E2M1 codes, two a byte, under an E8M0
scale per 32 inputs (`experts.gate_up_proj_blocks` `[experts, out, in / 32, 16]` and its
`_scales`, gpt-oss's gate and up rows in turn). On a CPU whose panel product runs in fp32, the
model is built without those weights and each expert's layer of `ExpertLinears` takes GGUF's
MXFP4 rows made of them (`gguf_blocks.MXFP4`: 0.53 bytes a weight, widened in registers to
exactly the values transformers' dequantization gives), so the experts never exist in fp32.
Elsewhere transformers dequantizes them as the model loads (`quantized_checkpoint.load_options`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.loading import gguf_blocks
from engine.loading.checkpoint_tensors import CheckpointTensors, tensor_index
from engine.loading.expert_blocks import expert_layer
from engine.loading.gguf_blocks import Blocks
from engine.loading.quantized_checkpoint import method_dequantized_on_load

# The checkpoint's blocks of a layer's experts, by the part of `ExpertLinears` they hold.
PARTS = {"gate_up_proj": "gate_up", "down_proj": "down"}


@dataclass(slots=True)
class HeldExperts:
    """Each expert layer's MXFP4 rows (`ExpertLinears`' names) and its bias, in the same order
    as its rows."""

    blocks: Blocks = field(default_factory=dict)
    biases: dict[str, torch.Tensor] = field(default_factory=dict)


def is_mxfp4(path: str) -> bool:
    """Whether `path` is a folder of an MXFP4 checkpoint."""
    return method_dequantized_on_load(Path(path)) == "mxfp4"


def expert_blocks(folder: Path) -> HeldExperts:
    """The experts of the MXFP4 checkpoint in `folder` as MXFP4 rows, one layer per expert: gate
    rows above up rows, as `ExpertLinears` holds gpt-oss's experts."""
    index = tensor_index(sorted(folder.glob("*.safetensors")))
    held = HeldExperts()
    with CheckpointTensors(index) as checkpoint:  # each file opened once
        for name in index:
            owner, _, kind = name.rpartition(".")
            fused = kind.removesuffix("_blocks")
            if fused == kind or fused not in PARTS:
                continue
            scales = checkpoint.slice(f"{owner}.{fused}_scales")[:]
            rows = gguf_rows(checkpoint.slice(name)[:], scales)
            bias = None
            if f"{owner}.{fused}_bias" in index:
                bias = checkpoint.slice(f"{owner}.{fused}_bias")[:].float()
            if fused == "gate_up_proj":
                rows = torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)
                bias = None if bias is None else torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)
            for expert in range(rows.shape[0]):
                layer = expert_layer(owner, PARTS[fused], expert)
                held.blocks[layer] = (gguf_blocks.MXFP4, rows[expert].contiguous())
                if bias is not None:
                    held.biases[layer] = bias[expert].contiguous()
    return held


def gguf_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 blocks `[..., blocks, 16]` (byte j: the codes of inputs 2j, in its
    low half, and 2j + 1) and their scale bytes `[..., blocks]` as GGUF's MXFP4 rows `[...,
    blocks * 17]` (the scale byte, then byte j: the codes of inputs j and 16 + j)."""
    in_order = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)
    packed = in_order[..., :16] | (in_order[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2)
