"""The integer weights of AWQ, GPTQ and compressed-tensors' pack-quantized checkpoints.

Each quantized layer stores small integers q packed into int32 words, a zero and a scale per
group of inputs (AWQ and GPTQ `[groups, out]`, inputs running down the rows; compressed-tensors
`[out, groups]`), and its weight is `scale * (q - zero)`. Here they become that weight in fp32
(exact: 16-bit scales times integers below 2**9) and, where each 32 inputs of a row share one
group and q has 4 or 8 bits, blocks that widen to the same weight for the CPU's panel product
(`gguf_blocks.Q4_G`, `Q8_G`; symmetric groups in GGUF's Q4_1 and Q8_0, which also multiply
against 8-bit activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.loading import gguf_blocks

# AutoAWQ packs eight 4-bit outputs in a word in this order; column k of 8 sits in field
# AWQ_FIELDS[k].
AWQ_FIELDS = (0, 4, 1, 5, 2, 6, 3, 7)
# The tensors a quantized layer may store: AWQ's and GPTQ's; compressed-tensors' packed
# integers, or unpacked INT8 or FP8 weights with their scales; fine-grained FP8 weights with a
# scale per tile.
PARTS = (
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight",
    "weight_scale_inv",
)
# What marks a layer as quantized.
MARKERS = ("qweight", "weight_packed", "weight_scale", "weight_scale_inv")
# Tensors only a quantized product reads (activation scales): not carried over.
DROPPED = ("input_scale", "input_zero_point", "input_global_scale", "weight_global_scale")
# Scales that make `scale * (q - zero)` exact in fp32, and `d * q + m` the same value.
EXACT_SCALES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Integers:
    """A layer's integers: q `[out, in]` in 0..2**bits - 1, zeros and scales `[out, groups]`,
    and each input's group `[in]`."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor
    bits: int

    def weight(self) -> torch.Tensor:
        """`scale * (q - zero)` `[out, in]`, fp32."""
        zero = self.zeros[:, self.groups]
        return ((self.q - zero).float() * self.scales[:, self.groups].float()).contiguous()


def awq(parts: dict[str, torch.Tensor], group_size: int) -> Integers:
    """AutoAWQ's GEMM packing: `qweight [in, out / 8]`, `qzeros [groups, out / 8]`, eight
    4-bit fields a word in its interleaved order, `scales [groups, out]`."""
    q = _awq_columns(_fields(parts["qweight"], 4)).t()
    zeros = _awq_columns(_fields(parts["qzeros"], 4)).t()
    return Integers(q, zeros, parts["scales"].t(), _runs(q.shape[1], group_size), 4)


def gptq(parts: dict[str, torch.Tensor], bits: int, group_size: int, zero_offset: int) -> Integers:
    """GPTQ's packing: `qweight [in * bits / 32, out]`, inputs packed down the columns,
    `qzeros [groups, out * bits / 32]` (each zero less `zero_offset`), `scales [groups, out]`,
    and `g_idx [in]`, each input's group (act-order groups are not runs of inputs)."""
    q = _fields(parts["qweight"].t(), bits)
    out, inputs = q.shape
    zeros = (_fields(parts["qzeros"], bits)[:, :out] + zero_offset).t()
    g_idx = parts.get("g_idx")
    groups = g_idx.long() if g_idx is not None else _runs(inputs, group_size)
    return Integers(q, zeros, parts["scales"].t(), groups, bits)


def pack_quantized(parts: dict[str, torch.Tensor]) -> Integers:
    """compressed-tensors' pack-quantized weights: `weight_packed [out, in * bits / 32]`,
    signed q plus `2**(bits - 1)` packed along the inputs, `weight_scale [out, groups]` (one group
    per row for channel-wise scales), and for asymmetric schemes `weight_zero_point`, signed too,
    packed down the rows; `weight_shape` is `[out, in]`."""
    out, inputs = (int(n) for n in parts["weight_shape"].tolist())
    packed = parts["weight_packed"]
    bits = 32 * packed.shape[1] // inputs
    if bits not in (2, 4, 8) or packed.shape[1] * 32 != inputs * bits:
        raise ValueError(f"weight_packed {tuple(packed.shape)} of a [{out}, {inputs}] weight")
    offset = 1 << (bits - 1)
    q = _fields(packed, bits)
    scales = parts["weight_scale"].reshape(-1, parts["weight_scale"].shape[-1]).expand(out, -1)
    zero = parts.get("weight_zero_point")
    if zero is None:
        zeros = torch.full(scales.shape, offset, dtype=torch.int32)
    elif zero.dtype == torch.int32 and zero.shape[0] != out:  # packed (plus the offset)
        zeros = _fields(zero.t(), bits)[:, :out].t()
    else:
        zeros = zero.to(torch.int32).expand(out, -1) + offset
    return Integers(q, zeros, scales, _runs_of(inputs, scales.shape[1]), bits)


def unpacked(parts: dict[str, torch.Tensor]) -> Integers | torch.Tensor:
    """Weights stored unpacked with their scales: INT8 (compressed-tensors' naive-quantized
    W8A8) as integers; FP8 as its fp32 weight, with a scale per row, group, tensor or tile
    (`weight_scale`), or fine-grained FP8's per tile (`weight_scale_inv`)."""
    stored = parts["weight"]
    out, inputs = stored.shape
    scale = parts.get("weight_scale", parts.get("weight_scale_inv"))
    if scale is None:
        raise KeyError("weight_scale")
    if scale.dim() == 2 and scale.shape[0] != out:  # a scale per tile of rows and inputs
        tile = -(-out // scale.shape[0]), -(-inputs // scale.shape[1])
        wide = scale.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:out, :inputs]
        return stored.float() * wide.float()
    scales = scale.reshape(-1, scale.shape[-1] if scale.dim() else 1).expand(out, -1)
    groups = _runs_of(inputs, scales.shape[1])
    if stored.dtype != torch.int8:
        return stored.float() * scales[:, groups].float()
    zero = parts.get("weight_zero_point")
    zeros = (0 if zero is None else zero.to(torch.int32).expand(out, -1)) + 128
    q = stored.to(torch.int32) + 128
    return Integers(q, torch.as_tensor(zeros).expand(out, scales.shape[1]), scales, groups, 8)


def blocks_of(
    integers: Integers, scales: torch.Tensor
) -> tuple[gguf_blocks.BlockFormat, torch.Tensor] | None:
    """Blocks of the layer, where each 32-wide block of inputs is in one group, q has 4 or 8 bits
    and the stored `scales` are 16-bit (so `d * q + m` is exactly its weight): GGUF's Q4_1 or
    Q8_0 for symmetric groups (zero `2**(bits - 1)`) whose scales fp16 holds, which also multiply
    against 8-bit activations; else Q4_G or Q8_G."""
    out, inputs = integers.q.shape
    exact = scales.dtype in EXACT_SCALES
    if integers.bits not in (4, 8) or inputs % gguf_blocks.BLOCK or not exact:
        return None
    runs = integers.groups.view(-1, gguf_blocks.BLOCK)
    if not torch.equal(runs, runs[:, :1].expand_as(runs)):
        return None
    group = runs[:, 0]  # each block's group
    d = integers.scales[:, group].float()
    zeros = integers.zeros[:, group]
    q = integers.q.view(out, -1, gguf_blocks.BLOCK)
    if torch.all(zeros == 1 << (integers.bits - 1)) and _fp16_holds(d, integers.bits):
        return _symmetric_blocks(d, q, integers.bits)
    if integers.bits == 4:  # d * q - d * zero
        return gguf_blocks.Q4_G, gguf_blocks.group_rows(d, -d * zeros, q.to(torch.uint8))
    # 8-bit q as int8 q - 128: d * (q - 128) + d * (128 - zero)
    return gguf_blocks.Q8_G, gguf_blocks.group_rows(d, d * (128 - zeros), (q - 128).to(torch.int8))


def _symmetric_blocks(
    d: torch.Tensor, q: torch.Tensor, bits: int
) -> tuple[gguf_blocks.BlockFormat, torch.Tensor]:
    """Symmetric groups in GGUF's formats: 4-bit `d * (q - 8)` as Q4_1's `d * q + m` with
    `m = -8 d`, 8-bit `d * (q - 128)` as Q8_0's `d * q` with q less 128; fp16 scales."""
    half = torch.float16
    if bits == 4:
        return gguf_blocks.Q4_1, gguf_blocks.group_rows(d, -8 * d, q.to(torch.uint8), half)
    return gguf_blocks.Q8_0, gguf_blocks.group_rows(d, None, (q - 128).to(torch.int8), half)


def _fp16_holds(d: torch.Tensor, bits: int) -> bool:
    """Whether fp16 holds every scale exactly, and for 4 bits Q4_1's minimum `-8 d` too."""
    held = [d] if bits == 8 else [d, 8 * d]
    return all(torch.equal(values.half().float(), values) for values in held)


def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words `[rows, n]` as their `32 / bits` fields each, lowest first: `[rows, n * 32 /
    bits]` int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.flatten(-2)


def _awq_columns(fields: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's fields `[rows, out]` in column order."""
    index = (torch.arange(fields.shape[1]) // 8 * 8).view(-1, 8) + torch.tensor(AWQ_FIELDS)
    return fields[:, index.flatten()]


def _runs_of(inputs: int, groups: int) -> torch.Tensor:
    """Each input's group for `groups` equal runs of inputs (scales stored `[out, groups]`,
    which say the runs' number, not their size)."""
    if inputs % groups:
        raise ValueError(f"{groups} groups of scales do not divide {inputs} inputs")
    return _runs(inputs, inputs // groups)


def _runs(inputs: int, size: int) -> torch.Tensor:
    """Each input's group for groups of `size` consecutive inputs (a whole row for `size` 0 or
    less)."""
    return torch.arange(inputs) // (inputs if size <= 0 else size)
