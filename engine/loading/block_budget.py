"""Whether a 16-bit model on a CPU keeps its checkpoint's quantized blocks for lack of memory.

Left to itself (`--keep-blocks` not given either way), a GGUF file's or quantized checkpoint's
layers widen to 16-bit panels, the fastest form from a few streams up. Where those weights,
with the KV cache's budget, would not fit in the memory the host has left
(`host_memory.available_bytes`: MemAvailable, or what a container's limit leaves), they stay as
their blocks instead (a third of the bytes of bf16 for Q4_K_M's mix), multiplied as
`--keep-blocks` multiplies them, and one warning says so: an 8B model's Q4_K_M file then serves
from about 5 GB rather than failing for the 16 GB of its widened weights. A budget beyond the
host's memory whatever the form (the 4 GiB default in a smaller container) leaves small models
widened.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.loading import gguf_blocks
from engine.worker import host_memory

logger = logging.getLogger(__name__)

# Of the memory left, what the widened weights and the KV cache may take: the rest is for the
# step's activations and the interpreter's own growth.
FITS = 0.9


@dataclass(frozen=True, slots=True)
class BlockSizes:
    """What a converted checkpoint folder holds: its blocks' bytes, the weights they stand for
    (a count), and the bytes of its other tensors (embeddings, norms), as stored."""

    blocks: int
    weights: int
    others: int

    def widened(self, dtype: torch.dtype) -> int:
        """Bytes of the model with its blocks widened to `dtype`."""
        return self.weights * dtype.itemsize + self.others

    def kept(self) -> int:
        """Bytes of the model with its blocks kept."""
        return self.blocks + self.others


def block_sizes(folder: Path) -> BlockSizes:
    """The sizes of the converted checkpoint in `folder`, read from its files' headers. A plain
    conversion (the default model's) holds fp32 weights of its block layers too; those are not
    counted among the others."""
    blocks = weights = 0
    layers = set()
    for file in gguf_blocks.block_files(folder):
        header = _header(file)
        formats = header.pop("__metadata__", None) or {}
        for name, entry in header.items():
            fmt = gguf_blocks.FORMATS.get(formats.get(name, ""))
            if fmt is None:
                continue
            rows, row_bytes = entry["shape"]
            blocks += rows * row_bytes
            weights += rows * (row_bytes // fmt.block_bytes * fmt.block)
            layers.add(name)
    others = 0
    for file in folder.glob("*.safetensors"):
        header = _header(file)
        header.pop("__metadata__", None)
        for name, entry in header.items():
            if name.removesuffix(".weight") not in layers:
                start, end = entry["data_offsets"]
                others += end - start
    return BlockSizes(blocks, weights, others)


def _header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: each tensor's dtype, shape and byte offsets by name, and
    its `__metadata__`."""
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header: dict[str, Any] = json.loads(handle.read(length))
    return header


def why_keep_blocks(
    sizes: BlockSizes, dtype: torch.dtype, reserve: int, available: int | None
) -> str:
    """Why the blocks should stay as they are ("" where the widened model fits): the widened
    weights and `reserve` bytes (the KV cache's budget) are more than `FITS` of the memory
    `available` (None: the host does not say, so nothing is kept). Where the budget would not
    fit beside the kept blocks either (it is more than the host has; the KV cache's own warning
    says so), keeping them makes no budget fit and costs speed from a few streams up: the
    weights then widen where they take at most half of what fits, leaving the KV cache the rest."""
    if available is None:
        return ""
    widened = sizes.widened(dtype)
    fits = FITS * available
    if widened + reserve <= fits:
        return ""
    if sizes.kept() + reserve > fits and widened <= fits / 2:
        return ""
    return (
        f"widened to {str(dtype).removeprefix('torch.')} the weights would take "
        f"{widened / 2**30:.2f} GiB and the KV cache {reserve / 2**30:.2f} GiB, more than "
        f"{FITS:.0%} of the {available / 2**30:.2f} GiB of memory left; kept, they take "
        f"{sizes.kept() / 2**30:.2f} GiB"
    )


def keep_for_memory(folder: Path, dtype: torch.dtype, reserve: int) -> bool:
    """Whether the 16-bit model in `folder` should keep its blocks for lack of memory; warns
    once where it should."""
    reason = why_keep_blocks(block_sizes(folder), dtype, reserve, host_memory.available_bytes())
    if reason:
        logger.warning(
            "keeping the checkpoint's quantized blocks (as --keep-blocks): %s. Slower from a "
            "few streams up; --no-keep-blocks widens them anyway",
            reason,
        )
    return bool(reason)
