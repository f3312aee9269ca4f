"""Conveyor's Triton kernels for the paged KV cache on GPUs.

`paged_prefill` attends every prompt chunk of a step in one launch: one program per tile of 32
query tokens and query head, over the sequence's cached prefix and the chunk's own (already
stored) K/V, read in place through the block table with the causal limit of each token.
`paged_decode` attends one query token per sequence over that sequence's blocks, read in place
through its block table: no gathered copy, no padding mask, and a cost set by each sequence's
own length rather than the longest one in the batch. The query heads that share a KV head meet
each tile of 32 K/V tokens in one `tl.dot` (tensor cores), and a sequence's tokens are split
into pieces attended by separate programs and then combined (flash-decoding), so that a few
long sequences still give every streaming multiprocessor work. `store_kv` writes new tokens'
K/V at their slots and skips slot -1, so padded rows of a fixed-size (CUDA graph) batch write
nothing.

Both run unchanged in Triton's interpreter (`TRITON_INTERPRET=1`), on CPU tensors, which is how
the test suite checks them on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import triton
import triton.language as tl

# Tokens of K/V one step of the decode loop multiplies at a time: a tile of the products the
# tensor cores take (`tl.dot` needs at least 16 on each side).
TILE = 32
# The fp8 K/V caches the kernels read and write, under any query dtype.
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# The most pieces one sequence's tokens are split into, and how many programs per streaming
# multiprocessor the splits aim for.
MAX_SPLITS = 16
PROGRAMS_PER_SM = 2


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """`a @ b` summed in fp32: fp32 operands exactly (not in tf32); with WIDEN, 16-bit operands
    widened first (Triton's interpreter multiplies bf16 as its raw bits), which gives the same
    products, since those of two 16-bit floats are exact in fp32."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _scales(kv_scales_ptr, SCALED: tl.constexpr):
    """The layer's key and value scales, read from the device (1.0 where the cache is not
    scaled)."""
    key_scale = 1.0
    value_scale = 1.0
    if SCALED:
        key_scale = tl.load(kv_scales_ptr)
        value_scale = tl.load(kv_scales_ptr + 1)
    return key_scale, value_scale


@triton.jit
def _attend(
    query,
    positions,
    key_ptr,
    value_ptr,
    table_row_ptr,
    kv_head,
    start,
    end,
    window,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """The `ROWS` query rows over one sequence's K/V tokens [start, end) of `kv_head`, read in
    place through its block table row, TILE_N at a time, with an online softmax in fp32: the
    unnormalised sums `[ROWS, DIM_PAD]`, the softmax totals and the maxima. With CAUSAL, row i
    sees keys up to `positions[i]` only, and with a `window` (0: none) only its last `window`
    of them. A row that sees no key of a tile yet keeps a zero sum and an infinite maximum."""
    dim = tl.arange(0, DIM_PAD)
    running_max = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM_PAD], tl.float32)
    for first in range(start, end, TILE_N):
        token = first + tl.arange(0, TILE_N)
        valid = token < end
        block = tl.load(table_row_ptr + token // BLOCK, mask=valid, other=0)
        offsets = (
            block[:, None] * cache_stride_block
            + (token % BLOCK)[:, None] * cache_stride_slot
            + kv_head * cache_stride_head
            + dim[None, :]
        )
        kv_mask = valid[:, None] & (dim < DIM)[None, :]
        key = tl.load(key_ptr + offsets, mask=kv_mask, other=0.0).to(query.dtype)
        scores = _dot(query, tl.trans(key), IEEE, WIDEN)
        if CAUSAL:  # a branch taken when the kernel compiles
            seen = valid[None, :] & (token[None, :] <= positions[:, None])
            seen = seen & ((window == 0) | (token[None, :] > positions[:, None] - window))
        else:
            seen = valid[None, :]
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row with no key seen so far subtracts 0, not an infinity (which would give NaN).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(running_max - shift)
        value = tl.load(value_ptr + offsets, mask=kv_mask, other=0.0).to(query.dtype)
        acc = acc * rescale[:, None] + _dot(weights.to(value.dtype), value, IEEE, WIDEN)
        total = total * rescale + tl.sum(weights, axis=1)
        running_max = new_max
    return acc, total, running_max


@triton.jit
def _with_sinks(acc, total, running_max, sinks):
    """An online softmax's sums, totals and maxima with each row's sink joined: a logit of
    its own (gpt-oss's, per head) that adds to the total and to no sum."""
    top = tl.maximum(running_max, sinks)
    rescale = tl.exp(running_max - top)
    return acc * rescale[:, None], total * rescale + tl.exp(sinks - top), top


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    table_ptr,
    lens_ptr,
    kv_scales_ptr,
    sinks_ptr,
    scale,
    window,
    query_stride_token,
    query_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    table_stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    SPLITS: tl.constexpr,
    SCALED: tl.constexpr,
    SINKS: tl.constexpr,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """One program per (sequence, kv head, split): the GROUP query heads sharing that kv head
    walk their split of the sequence's tokens a tile at a time, through the block table, with
    an online softmax in fp32 and both products in `tl.dot`. With one split the program writes
    the output (each head's sink joined, with SINKS); with several, its unnormalised sums,
    maximum and total for `_combine_kernel`, which joins the sinks."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = tl.arange(0, GROUP_PAD)
    dim = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + group
    q_mask = (group < GROUP)[:, None] & (dim < DIM)[None, :]
    q_offsets = seq * query_stride_token + heads[:, None] * query_stride_head + dim[None, :]
    query = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)
    key_scale, value_scale = _scales(kv_scales_ptr, SCALED)
    query = (query.to(tl.float32) * (scale * key_scale)).to(query_ptr.dtype.element_ty)

    length = tl.load(lens_ptr + seq)
    # With a window, the sequence's last `window` tokens only, split alike.
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    chunk = tl.cdiv(tl.cdiv(length - first, SPLITS), TILE_TOKENS) * TILE_TOKENS
    start = first + split * chunk
    end = tl.minimum(start + chunk, length)
    acc, total, running_max = _attend(
        query,
        group,
        key_ptr,
        value_ptr,
        table_ptr + seq * table_stride,
        kv_head,
        start,
        end,
        0,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        GROUP_PAD,
        BLOCK,
        DIM,
        DIM_PAD,
        TILE_TOKENS,
        False,
        IEEE,
        WIDEN,
    )
    acc = acc * value_scale
    if SPLITS == 1:
        if SINKS:
            sinks = tl.load(sinks_ptr + heads, mask=group < GROUP, other=0.0).to(tl.float32)
            acc, total, running_max = _with_sinks(acc, total, running_max, sinks)
        result = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
        o_offsets = seq * out_stride_token + heads[:, None] * out_stride_head + dim[None, :]
        tl.store(out_ptr + o_offsets, result.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (seq * GROUP * tl.num_programs(1) + heads) * SPLITS + split
        head_mask = group < GROUP
        tl.store(part_max_ptr + row, running_max, mask=head_mask)
        tl.store(part_sum_ptr + row, total, mask=head_mask)
        tl.store(part_acc_ptr + row[:, None] * DIM_PAD + dim[None, :], acc, mask=q_mask)


@triton.jit
def _combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    sinks_ptr,
    out_stride_token,
    out_stride_head,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One program per (sequence, query head): the splits' partial softmaxes rescaled to their
    common maximum and summed (with the head's sink in the total, with SINKS)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.arange(0, SPLITS_PAD)
    dim = tl.arange(0, DIM_PAD)
    rows = (seq * HEADS + head) * SPLITS + split
    present = split < SPLITS
    maxima = tl.load(part_max_ptr + rows, mask=present, other=float("-inf"))
    sums = tl.load(part_sum_ptr + rows, mask=present, other=0.0)
    acc_mask = present[:, None] & (dim < DIM)[None, :]
    accs = tl.load(part_acc_ptr + rows[:, None] * DIM_PAD + dim[None, :], mask=acc_mask, other=0.0)
    top = tl.max(maxima, axis=0)
    sink = 0.0
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    # Empty splits (maximum -inf) weigh nothing; all of a sequence with no tokens are empty.
    top = tl.where(top > float("-inf"), top, 0.0)
    weights = tl.exp(maxima - top)
    total = tl.sum(weights * sums, axis=0)
    if SINKS:
        total += tl.exp(sink - top)
    mixed = tl.sum(weights[:, None] * accs, axis=0)
    result = tl.where(total > 0, mixed / tl.maximum(total, 1e-30), 0.0)
    offsets = seq * out_stride_token + head * out_stride_head + dim
    tl.store(out_ptr + offsets, result.to(out_ptr.dtype.element_ty), mask=dim < DIM)


# Query tokens of one prompt chunk a prefill program takes at a time.
PREFILL_TILE = 32


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    table_ptr,
    tile_rows_ptr,
    tile_starts_ptr,
    query_starts_ptr,
    query_lens_ptr,
    context_lens_ptr,
    kv_scales_ptr,
    sinks_ptr,
    scale,
    window,
    query_stride_token,
    query_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    table_stride,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SCALED: tl.constexpr,
    SINKS: tl.constexpr,
    IEEE: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """One program per (tile of a chunk's query tokens, query head): the tile attends causally
    over its sequence's K/V up to its last token, the cached prefix and the chunk's own tokens
    alike read in place through the block table (the chunk's were stored before), with an
    online softmax in fp32 and both products in `tl.dot`; the head's sink joins it, with
    SINKS."""
    tile_index = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row = tl.load(tile_rows_ptr + tile_index)
    first_query = tl.load(tile_starts_ptr + tile_index)
    query_start = tl.load(query_starts_ptr + row)
    query_len = tl.load(query_lens_ptr + row)
    context = tl.load(context_lens_ptr + row)
    offs_m = first_query + tl.arange(0, TILE_M)
    dim = tl.arange(0, DIM_PAD)
    m_valid = offs_m < query_len
    q_mask = m_valid[:, None] & (dim < DIM)[None, :]
    q_offsets = (query_start + offs_m)[:, None] * query_stride_token + head * query_stride_head
    query = tl.load(query_ptr + q_offsets + dim[None, :], mask=q_mask, other=0.0)
    key_scale, value_scale = _scales(kv_scales_ptr, SCALED)
    query = (query.to(tl.float32) * (scale * key_scale)).to(query_ptr.dtype.element_ty)
    positions = context + offs_m
    end = context + tl.minimum(first_query + TILE_M, query_len)
    # With a window, from the first key the tile's first token sees.
    start = tl.where(window > 0, tl.maximum(context + first_query - window + 1, 0), 0)

    acc, total, running_max = _attend(
        query,
        positions,
        key_ptr,
        value_ptr,
        table_ptr + row * table_stride,
        kv_head,
        start,
        end,
        window,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        TILE_M,
        BLOCK,
        DIM,
        DIM_PAD,
        TILE_N,
        True,
        IEEE,
        WIDEN,
    )
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        acc, total, running_max = _with_sinks(acc, total, running_max, sink)
    result = acc * value_scale / tl.maximum(total, 1e-30)[:, None]
    o_offsets = (query_start + offs_m)[:, None] * out_stride_token + head * out_stride_head
    tl.store(out_ptr + o_offsets + dim[None, :], result.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slots_ptr,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    kv_scales_ptr,
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """One program per token. Into an fp8 cache (`FP8_MAX`, its largest value) K/V go divided
    by the layer's scales and saturated to the format's range."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        head = tl.arange(0, HEADS_PAD)[:, None]
        dim = tl.arange(0, DIM_PAD)[None, :]
        mask = (head < HEADS) & (dim < DIM)
        cache = (
            (slot // BLOCK) * cache_stride_block
            + (slot % BLOCK) * cache_stride_slot
            + head * cache_stride_head
            + dim
        )
        key = tl.load(key_ptr + token * key_stride_token + head * key_stride_head + dim, mask=mask)
        value = tl.load(
            value_ptr + token * value_stride_token + head * value_stride_head + dim, mask=mask
        )
        if FP8_MAX > 0:
            key_scale, value_scale = _scales(kv_scales_ptr, True)
            key = tl.clamp(key.to(tl.float32) / key_scale, -FP8_MAX, FP8_MAX)
            value = tl.clamp(value.to(tl.float32) / value_scale, -FP8_MAX, FP8_MAX)
        tl.store(key_cache_ptr + cache, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + cache, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`query [seqs, heads, dim]` over caches `[blocks, block_size, kv_heads, dim]`; row i
    reads `seq_lens[i]` tokens through `block_table[i]` (its last `window` only, where given),
    each head's `sinks` logit (`[heads]`, where given) joining its softmax. A row of length 0
    gives zeros.

    Each sequence's tokens are split into `splits` pieces attended in parallel and combined
    (None: enough pieces to give every streaming multiprocessor work, `decode_splits`). The
    count depends on the batch's shape only, never its lengths, so a captured graph replays
    it for any lengths. An fp8 cache holds K/V divided by `kv_scales` (`[2]` fp32 on the
    device: the key and value scales; 1.0 when None)."""
    seqs, heads, dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    _check_cache(query, key_cache, value_cache, dim)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} kv heads")
    if block_table.shape[0] != seqs or seq_lens.shape != (seqs,):
        raise ValueError("block_table and seq_lens need one row per query")
    group = heads // kv_heads
    _check_sinks(sinks, heads, query.device)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if seqs == 0:
        return out
    splits = splits or decode_splits(seqs, kv_heads, query.device)
    dim_pad = _pad(dim, 16)
    parts = (seqs, heads, splits) if splits > 1 else (1, 1, 1)
    part_acc = torch.empty((*parts, dim_pad), dtype=torch.float32, device=query.device)
    part_max = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(parts, dtype=torch.float32, device=query.device)
    _paged_decode_kernel[(seqs, kv_heads, splits)](
        out,
        part_acc,
        part_max,
        part_sum,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        _scales_of(kv_scales, query.device),
        part_max if sinks is None else sinks,  # never read without sinks
        scale,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=_pad(group, 16),
        BLOCK=block_size,
        DIM=dim,
        DIM_PAD=dim_pad,
        TILE_TOKENS=TILE,
        SPLITS=splits,
        SCALED=key_cache.dtype in FP8,
        SINKS=sinks is not None,
        IEEE=query.dtype == torch.float32,
        WIDEN=query.device.type == "cpu",
    )
    if splits > 1:
        _combine_kernel[(seqs, heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            part_max if sinks is None else sinks,
            out.stride(0),
            out.stride(1),
            HEADS=heads,
            DIM=dim,
            DIM_PAD=dim_pad,
            SPLITS=splits,
            SPLITS_PAD=_pad(splits),
            SINKS=sinks is not None,
        )
    return out


def decode_splits(seqs: int, kv_heads: int, device: torch.device) -> int:
    """Pieces per sequence for a decode batch: on a GPU, enough for `PROGRAMS_PER_SM` programs
    on every streaming multiprocessor (a single long sequence otherwise keeps a few busy), at
    most `MAX_SPLITS`; one elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    target = PROGRAMS_PER_SM * _multiprocessors(device.index or 0)
    return max(1, min(MAX_SPLITS, target // (seqs * kv_heads)))


@cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@dataclass(frozen=True, slots=True)
class PrefillRows:
    """The multi-token rows of a step as `paged_prefill` takes them, on the device: each row's
    first flattened query token, query count, cached tokens and block table, and the work list
    of (row, first query token) tiles."""

    query_starts: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    tile_rows: torch.Tensor
    tile_starts: torch.Tensor

    @classmethod
    def of(
        cls,
        query_starts: np.ndarray,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_table: np.ndarray,
        device: torch.device,
    ) -> PrefillRows:
        tiles_per_row = -(-query_lens // PREFILL_TILE)
        tile_rows = np.repeat(np.arange(len(query_lens)), tiles_per_row)
        first_tile = np.cumsum(tiles_per_row) - tiles_per_row
        tile_starts = (np.arange(len(tile_rows)) - first_tile[tile_rows]) * PREFILL_TILE

        def to(array: np.ndarray) -> torch.Tensor:
            contiguous = np.ascontiguousarray(array, dtype=np.int64)
            return torch.from_numpy(contiguous).to(device, non_blocking=True)

        return cls(
            to(query_starts),
            to(query_lens),
            to(context_lens),
            to(block_table),
            to(tile_rows),
            to(tile_starts),
        )


def paged_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    rows: PrefillRows,
    scale: float,
    kv_scales: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attend the query tokens of every multi-token row of a step (`query [tokens, heads, dim]`,
    flattened as the step is) causally over their sequences in the cache (within a `window`,
    and with each head's `sinks` logit, where given), K/V of the new tokens already stored;
    write each row's tokens of `out`, and leave the others as they are. An fp8 cache holds K/V
    divided by `kv_scales`, as for `paged_decode`."""
    _, heads, dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    _check_cache(query, key_cache, value_cache, dim)
    if out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError("out must be shaped as the query, head dims contiguous")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} kv heads")
    _check_sinks(sinks, heads, query.device)
    tiles = rows.tile_rows.shape[0]
    if tiles == 0:
        return
    _paged_prefill_kernel[(tiles, heads)](
        out,
        query,
        key_cache,
        value_cache,
        rows.block_table,
        rows.tile_rows,
        rows.tile_starts,
        rows.query_starts,
        rows.query_lens,
        rows.context_lens,
        _scales_of(kv_scales, query.device),
        rows.tile_rows if sinks is None else sinks,  # never read without sinks
        scale,
        window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        rows.block_table.stride(0),
        GROUP=heads // kv_heads,
        BLOCK=block_size,
        DIM=dim,
        DIM_PAD=_pad(dim, 16),
        TILE_M=PREFILL_TILE,
        TILE_N=TILE,
        SCALED=key_cache.dtype in FP8,
        SINKS=sinks is not None,
        IEEE=query.dtype == torch.float32,
        WIDEN=query.device.type == "cpu",
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write `[tokens, kv_heads, dim]` K/V at their slots; tokens whose slot is -1 are skipped.
    An fp8 cache takes them divided by `kv_scales`, as for `paged_decode`."""
    tokens, kv_heads, dim = key.shape
    _check_cache(key, key_cache, value_cache, dim)
    if value.shape != key.shape or slot_mapping.shape != (tokens,):
        raise ValueError("key, value and slot_mapping need the same number of tokens")
    if tokens == 0:
        return
    block_size = key_cache.shape[1]
    _store_kv_kernel[(tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        _scales_of(kv_scales, key.device),
        BLOCK=block_size,
        HEADS=kv_heads,
        HEADS_PAD=_pad(kv_heads),
        DIM=dim,
        DIM_PAD=_pad(dim),
        FP8_MAX=torch.finfo(key_cache.dtype).max if key_cache.dtype in FP8 else 0.0,
    )


def _scales_of(kv_scales: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """`kv_scales`, checked, or scales of 1.0."""
    if kv_scales is None:
        return torch.ones(2, dtype=torch.float32, device=device)
    if kv_scales.shape != (2,) or kv_scales.dtype != torch.float32:
        raise ValueError("kv_scales must be [2] fp32: the key and the value scale")
    return kv_scales


def _check_sinks(sinks: torch.Tensor | None, heads: int, device: torch.device) -> None:
    if sinks is not None and (
        sinks.shape != (heads,) or sinks.device != device or sinks.stride(0) != 1
    ):
        raise ValueError(f"sinks must be one contiguous logit per query head ({heads}) on {device}")


def _check_cache(
    tensor: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, dim: int
) -> None:
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must have the same shape and layout")
    if key_cache.shape[-1] != dim or key_cache.stride(-1) != 1 or tensor.stride(-1) != 1:
        raise ValueError("head dims must match and be contiguous")
    if key_cache.dtype != tensor.dtype and key_cache.dtype not in FP8:
        raise ValueError(f"cache dtype {key_cache.dtype} differs from {tensor.dtype}")


def _pad(n: int, least: int = 1) -> int:
    return max(triton.next_power_of_2(n), least)
