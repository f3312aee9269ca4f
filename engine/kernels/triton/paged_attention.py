"""Conveyor's Triton kernels for the paged KV cache on GPUs.

`paged_decode` attends one query token per sequence over that sequence's blocks, read in place
through its block table: no gathered copy, no padding mask, and a cost set by each sequence's
own length rather than the longest one in the batch. `store_kv` writes new tokens' K/V at their
slots and skips slot -1, so padded rows of a fixed-size (CUDA graph) batch write nothing.

Both run unchanged in Triton's interpreter (`TRITON_INTERPRET=1`), on CPU tensors, which is how
the test suite checks them on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    table_ptr,
    lens_ptr,
    scale,
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
    BLOCK_PAD: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """One program per (sequence, kv head): the GROUP query heads sharing that kv head walk the
    sequence's blocks once, with an online (streaming) softmax in fp32."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    group = tl.arange(0, GROUP_PAD)
    token = tl.arange(0, BLOCK_PAD)
    dim = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + group
    q_mask = (group < GROUP)[:, None] & (dim < DIM)[None, :]
    q_offsets = seq * query_stride_token + heads[:, None] * query_stride_head + dim[None, :]
    query = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale

    length = tl.load(lens_ptr + seq)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for index in range(0, tl.cdiv(length, BLOCK)):
        block = tl.load(table_ptr + seq * table_stride + index)
        valid = (token < BLOCK) & (index * BLOCK + token < length)
        offsets = (
            block * cache_stride_block
            + token[:, None] * cache_stride_slot
            + kv_head * cache_stride_head
            + dim[None, :]
        )
        kv_mask = valid[:, None] & (dim < DIM)[None, :]
        key = tl.load(key_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(query[:, None, :] * key[None, :, :], axis=2)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        value = tl.load(value_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * value[None, :, :], axis=1)
        total = total * rescale + tl.sum(weights, axis=1)
        running_max = new_max

    result = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
    o_offsets = seq * out_stride_token + heads[:, None] * out_stride_head + dim[None, :]
    tl.store(out_ptr + o_offsets, result.to(out_ptr.dtype.element_ty), mask=q_mask)


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
    BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
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
        tl.store(key_cache_ptr + cache, key, mask=mask)
        tl.store(value_cache_ptr + cache, value, mask=mask)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`query [seqs, heads, dim]` over caches `[blocks, block_size, kv_heads, dim]`; row i
    reads `seq_lens[i]` tokens through `block_table[i]`. A row of length 0 gives zeros."""
    seqs, heads, dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    _check_cache(query, key_cache, value_cache, dim)
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} kv heads")
    if block_table.shape[0] != seqs or seq_lens.shape != (seqs,):
        raise ValueError("block_table and seq_lens need one row per query")
    group = heads // kv_heads
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if seqs == 0:
        return out
    _paged_decode_kernel[(seqs, kv_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=_pad(group),
        BLOCK=block_size,
        BLOCK_PAD=_pad(block_size),
        DIM=dim,
        DIM_PAD=_pad(dim),
    )
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `[tokens, kv_heads, dim]` K/V at their slots; tokens whose slot is -1 are skipped."""
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
        BLOCK=block_size,
        HEADS=kv_heads,
        HEADS_PAD=_pad(kv_heads),
        DIM=dim,
        DIM_PAD=_pad(dim),
    )


def _check_cache(
    tensor: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, dim: int
) -> None:
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must have the same shape and layout")
    if key_cache.shape[-1] != dim or key_cache.stride(-1) != 1 or tensor.stride(-1) != 1:
        raise ValueError("head dims must match and be contiguous")
    if key_cache.dtype != tensor.dtype:
        raise ValueError(f"cache dtype {key_cache.dtype} differs from {tensor.dtype}")


def _pad(n: int) -> int:
    return max(triton.next_power_of_2(n), 1)
