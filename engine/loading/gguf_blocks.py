"""GGUF's quantized blocks as an exact, compact form of a checkpoint's linear weights.

A model converted from a GGUF file (the default model comes dequantized from Q4_1; any
`--model FILE.gguf` is converted the same way, `gguf_file.py`) has fp32 weights that are exactly
`d * q + m` or `d * q` per block of 32 (or, for K-quants, 16) inputs. Kept beside the checkpoint
(in `gguf_blocks/`: each linear layer's blocks, rows as GGUF stores them, under the layer's
module name), those blocks let the CPU's panel product stream a fifth to a third of the fp32
bytes (Q4_0 and Q4_1, Q4_K, Q8_0, Q6_K; MXFP4 an eighth; the 5-bit types, Q3_K and the IQ4
types as Q8_K panels, about a third) and widen each weight to the same fp32 value in registers.
A layer uses its blocks only where they widen to exactly the weights loaded from the checkpoint,
so outputs do not change, only the bytes read. An AWQ or GPTQ checkpoint's 4- and 8-bit groups
are kept the same way (`quantized_checkpoint.py`), in formats of their own (Q4_G, Q8_G).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.loading.conversions import ShardWriter

# In a subfolder: servers that load every `*.safetensors` at a checkpoint's top level (vLLM)
# must not take the blocks for weights. One file (`blocks.safetensors`), or numbered shards of
# `BLOCK_SHARD_BYTES` with an index.
BLOCKS_DIR = "gguf_blocks"
BLOCK_SHARD_BYTES = 256 << 20
BLOCK = 32
PANEL = 16


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """How GGUF stores a block of a row, and how a panel group holds 16 columns of 32 inputs."""

    name: str
    block_bytes: int  # per GGUF block of one row
    # per 16 columns and 32 input features in a panel (`csrc/include/block_panels.h`)
    group_bytes: int
    has_min: bool
    nibbles: bool  # 4-bit q, two columns to a byte in panels
    block: int = BLOCK  # a GGUF block's inputs (a K-quant's super-block: 256)
    wide_scales: bool = False  # panels hold its scales and minima in fp32 (else fp16)


Q4_1 = BlockFormat("q4_1", 20, group_bytes=64 + BLOCK * 8, has_min=True, nibbles=True)
Q8_0 = BlockFormat("q8_0", 34, group_bytes=32 + BLOCK * 16, has_min=False, nibbles=False)
# K-quants, cut into 32-wide blocks whose scales (products of two GGUF scales, exact in fp32 but
# not in fp16) panels hold in fp32: Q4_K a scale and a minimum per 32 inputs, Q6_K a scale per 16.
Q4_K = BlockFormat("q4_k", 144, 128 + BLOCK * 8, True, nibbles=True, block=256, wide_scales=True)
Q6_K = BlockFormat("q6_k", 210, 128 + BLOCK * 16, False, nibbles=False, block=256, wide_scales=True)
# Not GGUF's: 8-bit q with a scale per 16 inputs and a minimum per 32, all fp32. It holds any
# of the above exactly, so that projections stored in different types join into one
# (`as_q8_k`), and GGUF's 5-bit types, which have no panels of their own.
Q8_K = BlockFormat("q8_k", 0, 192 + BLOCK * 16, has_min=True, nibbles=False, wide_scales=True)
# MXFP4 (OCP's microscaling FP4; llama.cpp's MXFP4_MOE files keep their experts in it): per 32
# inputs an E8M0 scale byte and 16 bytes of E2M1 codes (IQ4_NL's layout). Its panels hold the
# scale bytes and the codes as they are (0.53 bytes a weight); each code widens to its value
# doubled (GGUF's levels) times half the scale, `2 ** (e - 128)`: exact in fp32.
MXFP4 = BlockFormat("mxfp4", 17, 16 + BLOCK * 8, has_min=False, nibbles=True)
MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
PANEL_FORMATS = (Q4_1, Q8_0, Q4_K, Q6_K, Q8_K, MXFP4)
Q5_0 = BlockFormat("q5_0", 22, Q8_K.group_bytes, has_min=True, nibbles=False)
Q5_1 = BlockFormat("q5_1", 24, Q8_K.group_bytes, has_min=True, nibbles=False)
Q5_K = BlockFormat("q5_k", 176, Q8_K.group_bytes, has_min=True, nibbles=False, block=256)
# Q3_K (3-bit q under a 6-bit scale per 16 inputs) and the non-linear 4-bit types (each q an
# index into 16 int8 levels: IQ4_NL under a scale per 32, IQ4_XS under a super-block's d times
# a 6-bit scale per 32), all held as Q8_K's parts.
Q3_K = BlockFormat("q3_k", 110, Q8_K.group_bytes, has_min=True, nibbles=False, block=256)
IQ4_NL = BlockFormat("iq4_nl", 18, Q8_K.group_bytes, has_min=True, nibbles=False)
IQ4_XS = BlockFormat("iq4_xs", 136, Q8_K.group_bytes, has_min=True, nibbles=False, block=256)
# IQ4's 16 levels, as GGUF defines them.
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# Not GGUF's: an AWQ or GPTQ group's rows cut into 32-wide blocks (`quantized_checkpoint.py`),
# each its fp32 scale and minimum (`-scale * zero`) and its 4-bit q as Q4_1 holds them, or its
# 8-bit q less 128 (int8); held in Q4_K's and Q8_K's panels.
Q4_G = BlockFormat("q4_g", 24, Q4_K.group_bytes, has_min=True, nibbles=True, wide_scales=True)
Q8_G = BlockFormat("q8_g", 40, Q8_K.group_bytes, has_min=True, nibbles=False, wide_scales=True)
AS_Q8_K = (Q5_0, Q5_1, Q5_K, Q3_K, IQ4_NL, IQ4_XS)
FORMATS = {f.name: f for f in (*PANEL_FORMATS, *AS_Q8_K, Q4_G, Q8_G)}
# Those with a layout for 8-bit products against activations rounded to 8-bit blocks: Q4_1's
# and Q8_0's own, and Q4_K's and 4-bit groups' (fp32 scales and minima) as Q4_1's with theirs
# rounded to fp16: a relative change of at most 2**-11, far below the activations' rounding.
INT8_FORMATS = (Q4_1, Q8_0, Q4_K, Q4_G)
# Projections Conveyor's decoder joins into one product (`models.layers.fuse_linears`): their
# panels join only where they share a layout.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# The format block panels hold, by their group size.
GROUP_FORMATS = {f.group_bytes: f for f in PANEL_FORMATS}
# Blocks by the name of the linear layer they hold: its format and its rows.
Blocks = dict[str, tuple[BlockFormat, torch.Tensor]]


def in_features(fmt: BlockFormat, rows: torch.Tensor) -> int:
    """The input features of GGUF rows `[out, in / block * block_bytes]`."""
    return rows.shape[1] // fmt.block_bytes * fmt.block


def split_rows(
    fmt: BlockFormat, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """GGUF rows uint8 as (d, m or None, q) per 32-wide block: weight = d * q (+ m). d and m
    `[out, in / 32]`, fp16 for Q4_1 and Q8_0, fp32 for Q4_K and Q4_G (m is minus its minimum);
    Q6_K's, Q8_G's and the 5-bit types' d `[out, in / 32, 2]` fp32, one per 16 inputs. q `[out,
    in / 32, 32]`: uint8 0..15 (Q4_1, Q4_K, Q4_G), int8 (Q8_0, Q8_G, Q6_K's -32..31, the 5-bit
    types')."""
    if fmt is Q4_K:
        return _split_q4_k(rows)
    if fmt is Q6_K:
        return _split_q6_k(rows)
    if fmt in (Q5_0, Q5_1, Q5_K):
        return _split_5_bit(fmt, rows)
    if fmt is Q3_K:
        return _split_q3_k(rows)
    if fmt in (IQ4_NL, IQ4_XS):
        return _split_iq4(fmt, rows)
    if fmt is MXFP4:
        return _split_mxfp4(rows)
    blocks = rows.reshape(rows.shape[0], -1, fmt.block_bytes)
    width, dtype = (4, torch.float32) if fmt.wide_scales else (2, torch.float16)
    d = blocks[..., :width].contiguous().view(dtype).squeeze(-1)
    if not fmt.has_min:
        return d, None, blocks[..., width:].contiguous().view(torch.int8)
    m = blocks[..., width : 2 * width].contiguous().view(dtype).squeeze(-1)
    packed = blocks[..., 2 * width :]
    if not fmt.nibbles:  # Q8_G, in Q8_K's panels: a scale per 16 inputs
        return d.unsqueeze(-1).expand(*d.shape, 2), m, packed.contiguous().view(torch.int8)
    return d, m, torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _split_q4_k(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks (d, dmin fp16; 8 six-bit scales and minima in 12 bytes; 128 bytes of
    nibbles, each 32 bytes holding two blocks: low halves, then high halves) as 32-wide blocks
    with `d * scale` and `-dmin * min`, both exact in fp32."""
    out = rows.shape[0]
    blocks = rows.reshape(out, -1, Q4_K.block_bytes)
    d, least = _k_scales(blocks)
    nibbles = blocks[..., 16:].reshape(out, -1, 4, 1, 32)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=3).reshape(out, -1, 32)
    return d, least, q


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's scales `d * scale` and minima `-dmin * min` per 32-wide block (`[out,
    in / 32]` fp32) from super-blocks `[out, count, bytes]` that start with d, dmin and the 12
    bytes of six-bit scales and minima."""
    out = blocks.shape[0]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:16].reshape(out, -1, 3, 4).to(torch.int32)
    low, high, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    scale = torch.cat([low & 63, (rest & 15) | ((low >> 2) & 48)], dim=-1)
    least = torch.cat([high & 63, (rest >> 4) | ((high >> 2) & 48)], dim=-1)
    return (d * scale).reshape(out, -1), (-dmin * least).reshape(out, -1)


def _split_5_bit(
    fmt: BlockFormat, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_0 (`d * (q - 16)`), Q5_1 (`d * q + m`) and Q5_K (Q4_K's scales, a fifth bit per q) as
    Q8_K's parts: scales `[out, in / 32, 2]` and minima `[out, in / 32]` fp32, q int8."""
    out = rows.shape[0]
    blocks = rows.reshape(out, -1, fmt.block_bytes)
    if fmt is Q5_K:
        d, least = _k_scales(blocks)
        high = blocks[..., 16:48].reshape(out, -1, 1, 32)
        high = torch.cat([(high >> bit) & 1 for bit in range(8)], dim=2)  # [.., block, 32]
        low = blocks[..., 48:].reshape(out, -1, 4, 1, 32)
        low = torch.cat([low & 0x0F, low >> 4], dim=3).reshape(out, -1, 8, 32)
        q = (low | (high << 4)).to(torch.int8).reshape(out, -1, 32)
        return d.view(out, -1, 1).expand(-1, -1, 2), least, q
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    start = 4 if fmt is Q5_1 else 2
    bits = blocks[..., start : start + 4].to(torch.int64)
    bits = bits[..., 0] | bits[..., 1] << 8 | bits[..., 2] << 16 | bits[..., 3] << 24
    high = (bits.unsqueeze(-1) >> torch.arange(32)) & 1
    packed = blocks[..., start + 4 :]
    low = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int64)
    q = low | (high << 4)
    if fmt is Q5_1:
        least = blocks[..., 2:4].contiguous().view(torch.float16).float()
    else:
        q, least = q - 16, torch.zeros_like(d)
    return d.expand(-1, -1, 2), least.squeeze(-1), q.to(torch.int8)


def _split_q3_k(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q3_K super-blocks (32 bytes of high bits, 64 of low bit pairs, 12 bytes of 6-bit scales,
    d fp16) as Q8_K's parts: a scale `d * (scale - 32)` (exact in fp32) per 16 inputs, no
    minimum, q -4..3 (its high bit set means no offset, clear means -4)."""
    out = rows.shape[0]
    blocks = rows.reshape(out, -1, Q3_K.block_bytes).to(torch.int32)
    hmask, low, packed = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
    d = blocks[..., 108:110].to(torch.uint8).contiguous().view(torch.float16).float()
    # Scale j's low 4 bits: byte j % 8, its low or high nibble; its high 2 bits: byte 8 + j % 4,
    # bits 2 * (j // 4).
    j = torch.arange(16)
    lows = (packed[..., j % 8] >> (4 * (j // 8))) & 0x0F
    highs = (packed[..., 8 + j % 4] >> (2 * (j // 4))) & 0x03
    scales = d * ((lows | (highs << 4)) - 32).float()  # [out, count, 16]
    pairs = low.reshape(out, -1, 2, 1, 32) >> (2 * torch.arange(4)).view(1, 1, 1, 4, 1)
    bits = hmask.reshape(out, -1, 1, 32) >> torch.arange(8).view(1, 1, 8, 1)
    q = (pairs.reshape(out, -1, 256) & 3) - 4 * (1 - (bits.reshape(out, -1, 256) & 1))
    d16 = scales.reshape(out, -1, 2)  # 16-input groups two to a 32-wide block
    return d16, torch.zeros(d16.shape[:2]), q.to(torch.int8).reshape(out, -1, 32)


def _split_iq4(
    fmt: BlockFormat, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ4_NL (d fp16, 16 bytes of indices: the low nibbles are the block's first 16 inputs)
    and IQ4_XS (d fp16, 6-bit scales less 32 per 32 inputs in 2 + 4 bytes, 128 bytes of
    indices) as Q8_K's parts: the scale per 32 inputs (`d * scale` exact in fp32), no minimum,
    q the int8 level each index names."""
    out = rows.shape[0]
    blocks = rows.reshape(out, -1, fmt.block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [out, count, 1]
    q = _levels(blocks[..., 2:] if fmt is IQ4_NL else blocks[..., 8:], IQ4_LEVELS)
    if fmt is IQ4_NL:
        scale = d.reshape(out, -1)
    else:
        j = torch.arange(8)
        high = blocks[..., 2:4].to(torch.int32)
        high = (high[..., 0] | high[..., 1] << 8).unsqueeze(-1) >> (2 * j) & 0x03
        low = blocks[..., 4 + j // 2].to(torch.int32) >> (4 * (j % 2)) & 0x0F
        scale = (d * ((low | high << 4) - 32).float()).reshape(out, -1)
    return scale.unsqueeze(-1).expand(-1, -1, 2), torch.zeros_like(scale), q


def _split_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP4 blocks (an E8M0 scale byte, 16 bytes of E2M1 codes) as Q8_K's parts: the scale per
    32 inputs `2 ** (e - 128)` (GGUF's half scale, subnormal below e = 2), no minimum, q the
    doubled E2M1 value each code names."""
    out = rows.shape[0]
    blocks = rows.reshape(out, -1, MXFP4.block_bytes)
    scale = _half_scales(blocks[..., 0])
    q = _levels(blocks[..., 1:], MXFP4_LEVELS)
    return scale.unsqueeze(-1).expand(-1, -1, 2), torch.zeros_like(scale), q


def _half_scales(e: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes as GGUF's half scales `2 ** (e - 128)` in fp32, built from their bits
    (below 2: subnormal)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def _indices(packed: torch.Tensor) -> torch.Tensor:
    """Blocks' 16 bytes of 4-bit indices `[out, blocks, 16]` (the low halves index the block's
    first 16 inputs, the high halves the next) as `[out, blocks, 32]` uint8."""
    out = packed.shape[0]
    packed = packed.reshape(out, -1, 1, 16)
    return torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(out, -1, 32)


def _levels(packed: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """Blocks' 4-bit indices (`_indices`) as the int8 levels they name `[out, blocks, 32]`."""
    return torch.tensor(levels, dtype=torch.int8)[_indices(packed).long()]


def _split_q6_k(rows: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
    """Q6_K super-blocks (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
    fp16) as 32-wide blocks with a scale `d * scale` (exact in fp32) per 16 inputs."""
    out = rows.shape[0]
    blocks = rows.reshape(out, -1, Q6_K.block_bytes)
    low = blocks[..., 0:128].reshape(out, -1, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=3).reshape(out, -1, 8, 32)
    high = blocks[..., 128:192].reshape(out, -1, 2, 1, 32)
    high = torch.cat([(high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3)
    q = (low | (high.reshape(out, -1, 8, 32) << 4)).to(torch.int8) - 32
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()
    return (d * scales).reshape(out, -1, 2), None, q.reshape(out, -1, 32)


def group_rows(
    d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor, scales: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows `[out, in / 32 * bytes]` of 32-wide blocks, each its scale `d` and minimum `m`
    (`[out, in / 32]`, stored in `scales`) and its q (`[out, in / 32, 32]`): Q4_G (fp32, q uint8
    0..15), Q8_G (fp32, q int8), Q4_1 (fp16, q uint8 0..15) or Q8_0 (fp16, q int8, no m)."""
    if q.dtype == torch.uint8:
        q = q[..., :16] | (q[..., 16:] << 4)
    parts = [d.to(scales).unsqueeze(-1)] + ([] if m is None else [m.to(scales).unsqueeze(-1)])
    body = q.contiguous().view(torch.uint8)
    blocks = torch.cat([part.view(torch.uint8) for part in parts] + [body], dim=-1)
    return blocks.reshape(q.shape[0], -1)


def dequantize_rows(fmt: BlockFormat, rows: torch.Tensor) -> torch.Tensor:
    """GGUF rows to fp32 `[out, in]`, as GGUF's own dequantization computes them. The weight is
    the only fp32 tensor of its size made: scales and minima apply to it in place."""
    d, m, q = split_rows(fmt, rows)
    weight = q.float()
    scales = d.float()  # [out, blocks], or [out, blocks, 2]: one per 16 inputs
    weight.view(*scales.shape, -1).mul_(scales.unsqueeze(-1))
    if m is not None:
        weight.add_(m.float().unsqueeze(-1))
    return weight.reshape(rows.shape[0], -1)


def pack_panels(fmt: BlockFormat, rows: torch.Tensor) -> torch.Tensor:
    """GGUF rows `[out, in / block * block_bytes]` to block panels `[ceil(out / 16), in / 32,
    group_bytes]` uint8; spare columns of the last panel hold zero weights."""
    out = rows.shape[0]
    padded = -(-out // PANEL) * PANEL
    if fmt is MXFP4:  # the scale bytes and the codes as stored
        blocks = rows.reshape(out, -1, MXFP4.block_bytes)
        parts = [_columns_last(_pad(blocks[..., 0].contiguous(), padded))]
        q = _indices(blocks[..., 1:])
    else:
        d, m, q = split_rows(fmt, rows)
        parts = [_columns_last(_pad(d, padded)).view(torch.uint8)]
        if m is not None:
            parts.append(_columns_last(_pad(m, padded)).view(torch.uint8))
    # [panels, 16, blocks, 32] -> [panels, blocks, 32, 16]: per input feature, its 16 columns.
    by_feature = _pad(q, padded).view(padded // PANEL, PANEL, *q.shape[1:]).permute(0, 2, 3, 1)
    if fmt.nibbles:
        by_feature = by_feature[..., :8] | (by_feature[..., 8:] << 4)
    parts.append(by_feature.contiguous().view(torch.uint8).flatten(2))
    return torch.cat([part.flatten(2) for part in parts], dim=2).contiguous()


def pack_int8_panels(fmt: BlockFormat, rows: torch.Tensor) -> torch.Tensor | None:
    """Rows of one of `INT8_FORMATS` to int8 block panels `[ceil(out / 16), in / 32, 320 or
    544]`, laid out for 8-bit products against activations rounded to 8-bit blocks
    (`csrc/include/block_panels.h`); None where a Q4_K or 4-bit group's scale or minimum is too
    large for fp16."""
    if fmt is Q8_0:
        return _pack_q8_0_int8_panels(rows)
    if fmt is not Q4_1:
        rounded = rounded_to_q4_1(fmt, rows)
        if rounded is None:
            return None
        rows = rounded
    d, m, q = split_rows(Q4_1, rows)
    assert m is not None  # Q4_1 blocks hold a minimum
    padded = -(-rows.shape[0] // PANEL) * PANEL
    blocks = q.shape[1]
    # Columns as (h, c), features as (part, step, i): feature 16 part + 4 step + i.
    split = _pad(q, padded).view(padded // PANEL, 2, 8, blocks, 2, 4, 4)
    by_step = split.permute(0, 3, 1, 5, 2, 6, 4)  # [panels, blocks, h, step, c, i, part]
    packed = (by_step[..., 0] | (by_step[..., 1] << 4)).contiguous().flatten(2)
    scales = [_columns_last(_pad(part, padded)).view(torch.uint8) for part in (d, m)]
    return torch.cat([*scales, packed], dim=2).view(torch.int8).contiguous()


def int8_layout(fmt: BlockFormat) -> BlockFormat | None:
    """The int8 panels blocks of `fmt` take (Q4_1's or Q8_0's); None where they take none."""
    if fmt in (Q4_1, Q4_K, Q4_G):
        return Q4_1
    return Q8_0 if fmt is Q8_0 else None


def rounds_inputs(layer: str, blocks: Blocks) -> bool:
    """Whether `layer` of `blocks` takes int8 panels under `--int8-activations`: its format has
    them, and each projection it is joined with has blocks of the same int8 layout (a Q4_K_M
    layer's Q4_K q and k beside its Q6_K v keep their exact blocks, which join as Q8_K)."""
    layout = int8_layout(blocks[layer][0])
    if layout is None:
        return False
    owner, _, leaf = layer.rpartition(".")
    for group in SIBLINGS:
        if leaf in group:
            names = [f"{owner}.{sibling}" for sibling in group]
            return all(n in blocks and int8_layout(blocks[n][0]) is layout for n in names)
    return True


def rounded_to_q4_1(fmt: BlockFormat, rows: torch.Tensor) -> torch.Tensor | None:
    """Q4_K or Q4_G rows as Q4_1 rows of the same q, their fp32 scales and minima rounded to
    fp16; None where one does not fit fp16."""
    d, m, q = split_rows(fmt, rows)
    assert m is not None  # both hold a minimum
    half_d, half_m = d.half(), m.half()
    if not (torch.isfinite(half_d).all() and torch.isfinite(half_m).all()):
        return None
    return group_rows(half_d, half_m, q, scales=torch.float16)


def _pack_q8_0_int8_panels(rows: torch.Tensor) -> torch.Tensor:
    d, _, q = split_rows(Q8_0, rows)
    padded = -(-rows.shape[0] // PANEL) * PANEL
    blocks = q.shape[1]
    # Columns as (h, c), features as (step, i): feature 4 step + i.
    split = _pad(q, padded).view(padded // PANEL, 2, 8, blocks, 8, 4)
    packed = split.permute(0, 3, 1, 4, 2, 5).contiguous().flatten(2)  # [.., h, step, c, i]
    scales = _columns_last(_pad(d, padded)).view(torch.int8)
    return torch.cat([scales, packed], dim=2).contiguous()


# The E8M0 scale bytes under which every MXFP4 weight is a normal bf16 number (levels 1 to 12
# times 2 ** (e - 128)), as `mxfp4_bf16_linear` widens them.
MXFP4_BF16_SCALES = range(2, 253)


def mxfp4_fits_bf16(panels: torch.Tensor, out_features: int) -> bool:
    """Whether the first `out_features` columns of MXFP4 block panels have only scale bytes
    in `MXFP4_BF16_SCALES` (the spare columns of the last panel hold zeros)."""
    scales = panels[:, :, :PANEL].permute(0, 2, 1).reshape(-1, panels.shape[1])[:out_features]
    first, last = MXFP4_BF16_SCALES[0], MXFP4_BF16_SCALES[-1]
    return bool(scales.numel() == 0 or (scales.min() >= first and scales.max() <= last))


def dequantize_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """Block panels back to the fp32 weight `[out, in]` they hold."""
    if panels.dtype == torch.int8:
        return _dequantize_int8_panels(panels, out_features)
    count, blocks, _ = panels.shape
    halves, least, q = _unpack_panels(panels)
    weight = halves.repeat_interleave(BLOCK // 2, dim=2) * q.float()
    if least is not None:
        weight = weight + least.unsqueeze(2)
    # [panels, blocks, 32, 16] -> [panels * 16, in]
    rows = weight.permute(0, 3, 1, 2).reshape(count * PANEL, blocks * BLOCK)
    return rows[:out_features]


def as_q8_k(panels: torch.Tensor) -> torch.Tensor:
    """Block panels of any format as Q8_K panels of the same weights (each widens to the same
    fp32 value: the scales and minima widen exactly, q fits int8, and `d * q + 0` rounds as
    `d * q` does)."""
    halves, least, q = _unpack_panels(panels)
    if least is None:
        least = halves.new_zeros(halves[:, :, 0].shape)
    parts = [halves.flatten(2), least, q.to(torch.int8).flatten(2)]
    return torch.cat([part.contiguous().view(torch.uint8) for part in parts], dim=2)


def _unpack_panels(
    panels: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Block panels as (scales `[panels, blocks, 2, 16]` fp32, one per column and 16 inputs;
    minima `[panels, blocks, 16]` fp32 or None; q `[panels, blocks, 32, 16]`, uint8 or int8)."""
    fmt = GROUP_FORMATS[panels.shape[2]]
    count, blocks, _ = panels.shape
    scale_bytes = fmt.group_bytes - BLOCK * (8 if fmt.nibbles else 16)
    if fmt is MXFP4:  # E8M0 bytes
        scales = _half_scales(panels[..., :scale_bytes])
    else:
        wide = torch.float32 if fmt.wide_scales else torch.float16
        scales = panels[..., :scale_bytes].contiguous().view(wide).float()
    scales = scales.view(count, blocks, -1, PANEL)  # sets of 16: d, d and m, or d, d, m
    packed = panels[..., scale_bytes:].reshape(count, blocks, BLOCK, -1)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1) if fmt.nibbles else packed.view(torch.int8)
    if fmt is MXFP4:  # each code its doubled E2M1 value
        q = torch.tensor(MXFP4_LEVELS, dtype=torch.int8)[q.long()]
    least = scales[:, :, -1] if fmt.has_min else None
    halves = scales[:, :, :-1] if fmt.has_min else scales
    if halves.shape[2] == 1:  # one scale per 32 inputs
        halves = halves.expand(-1, -1, 2, -1)
    return halves, least, q


def _dequantize_int8_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    count, blocks, _ = panels.shape
    d = _halves(panels, 0)
    m = None
    if panels.shape[2] == Q8_0.group_bytes:
        q = panels[..., 32:].reshape(count, blocks, 2, 8, 8, 4)  # [.., h, step, c, i]
        # -> [panels, h, c, blocks, step, i]: columns 8h + c, feature 4 step + i.
        q = q.permute(0, 2, 4, 1, 3, 5)
    else:
        m = _halves(panels, 32)
        packed = panels[..., 64:].view(torch.uint8).reshape(count, blocks, 2, 4, 8, 4)
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # [.., h, step, c, i, part]
        # -> [panels, h, c, blocks, part, step, i]: columns 8h + c, feature 16 part + 4 step + i.
        q = q.permute(0, 2, 4, 1, 6, 3, 5)
    weight = d.transpose(1, 2).unsqueeze(-1) * q.reshape(count, PANEL, blocks, BLOCK).float()
    if m is not None:
        weight = weight + m.transpose(1, 2).unsqueeze(-1)
    return weight.reshape(count * PANEL, blocks * BLOCK)[:out_features]


def _halves(panels: torch.Tensor, start: int) -> torch.Tensor:
    """The 16 fp16 values at byte `start` of each group (a scale or minimum per column), in
    fp32: `[panels, blocks, 16]`."""
    return panels[..., start : start + 32].contiguous().view(torch.float16).float()


def _columns_last(scales: torch.Tensor) -> torch.Tensor:
    """Per-row, per-block scales `[padded out, blocks, ...]` as `[panels, blocks, ..., 16]`."""
    return scales.view(-1, PANEL, *scales.shape[1:]).movedim(1, -1).contiguous()


def _pad(rows: torch.Tensor, count: int) -> torch.Tensor:
    if rows.shape[0] == count:
        return rows
    padded = rows.new_zeros((count, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    return padded


def q4_0_as_q4_1(rows: torch.Tensor) -> torch.Tensor | None:
    """Q4_0 rows (`d * (q - 8)`, 18 bytes a block) as the Q4_1 rows of the same weights: the
    minimum `-8 d` is exact in fp16, and `d * q - 8 d` exact in fp32. None where a scale is too
    large for its minimum to fit fp16."""
    blocks = rows.reshape(rows.shape[0], -1, 18)
    d = blocks[..., 0:2].contiguous().view(torch.float16)
    m = d * -8
    if not torch.isfinite(m).all():
        return None
    q41 = torch.cat([blocks[..., 0:2], m.view(torch.uint8), blocks[..., 2:]], dim=-1)
    return q41.reshape(rows.shape[0], -1).contiguous()


def holds(fmt: BlockFormat, rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the blocks `rows` widen to exactly `weight` (`[out, in]`, fp32)."""
    return rows.shape[0] == weight.shape[0] and torch.equal(dequantize_rows(fmt, rows), weight)


class BlockWriter:
    """Layers' blocks written beside a checkpoint in folder `out` as they come
    (`BLOCKS_DIR`, in shards of `BLOCK_SHARD_BYTES`), so a conversion holds at most one shard
    of them; nothing is written where no layer keeps blocks."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.layers = 0
        self._writer: ShardWriter | None = None

    def add(self, name: str, fmt: BlockFormat, rows: torch.Tensor) -> None:
        if self._writer is None:
            self._writer = ShardWriter(self.out / BLOCKS_DIR, BLOCK_SHARD_BYTES, stem="blocks")
        self._writer.add(name, rows, note=fmt.name)
        self.layers += 1

    def add_all(self, blocks: Blocks) -> None:
        for name, (fmt, rows) in blocks.items():
            self.add(name, fmt, rows)

    def close(self) -> int:
        """Save the last shard; return how many layers kept blocks."""
        if self._writer is not None:
            self._writer.close()
        return self.layers


def save(blocks: Blocks, out: Path) -> None:
    """Keep `blocks` beside the checkpoint in folder `out`."""
    writer = BlockWriter(out)
    writer.add_all(blocks)
    writer.close()


def block_files(folder: Path) -> list[Path]:
    """The files of blocks kept beside the checkpoint in `folder` (none: empty)."""
    return sorted((folder / BLOCKS_DIR).glob("*.safetensors"))


def load(folder: Path) -> Blocks:
    """The blocks kept beside the checkpoint in `folder`, by layer name (none: empty)."""
    from safetensors import safe_open

    found = {}
    for file in block_files(folder):
        with safe_open(str(file), framework="pt") as blocks:
            formats = blocks.metadata() or {}
            for name in blocks.keys():  # noqa: SIM118 (safe_open is not a mapping)
                fmt = FORMATS.get(formats.get(name, ""))
                if fmt is not None:
                    found[name] = (fmt, blocks.get_tensor(name))
    return found
