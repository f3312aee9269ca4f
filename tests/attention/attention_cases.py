"""Random paged-attention cases and a token-by-token reference, shared by the kernel tests."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def reference_decode(
    query, key_cache, value_cache, tables, lens, scale, window=0, softcap=0.0, sinks=None
):
    """Each row's K/V gathered token by token (its last `window` tokens only, where given),
    then softmax attention in fp32: scores capped by `softcap`, each head's `sinks` logit in
    its softmax, where given."""
    rows, heads, _ = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = []
    for row in range(rows):
        length = int(lens[row])
        positions = range(max(0, length - window) if window else 0, length)
        blocks = [int(tables[row, p // block_size]) for p in positions]
        k = torch.stack(
            [key_cache[b, p % block_size] for b, p in zip(blocks, positions, strict=True)]
        ).float()
        v = torch.stack(
            [value_cache[b, p % block_size] for b, p in zip(blocks, positions, strict=True)]
        ).float()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", query[row].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:  # a column of logits with no value
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
            out.append(torch.einsum("ht,thd->hd", F.softmax(scores, dim=-1)[:, :-1], v))
            continue
        out.append(torch.einsum("ht,thd->hd", F.softmax(scores, dim=-1), v))
    return torch.stack(out)


def random_case(dtype, heads, kv_heads, dim, block_size, lens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 4 + sum(-(-n // block_size) for n in lens)
    shape = (num_blocks, block_size, kv_heads, dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype)
    value_cache = torch.randn(shape, generator=generator).to(dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # scattered blocks, as a real cache holds them
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for row, n in enumerate(lens):
        for i in range(-(-n // block_size)):
            tables[row, i] = free.pop()
    query = torch.randn(len(lens), heads, dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int64)


def reference_prefill(
    query, key_cache, value_cache, blocks, context, scale, window=0, sinks=None, softcap=0.0
):
    """Query token i at position context + i over the sequence's K/V gathered token by token,
    causally (its last `window` positions only, where given), with softmax attention in fp32
    (each head's `sinks` logit in its softmax, the scores capped at `softcap`, where given)."""
    tokens, heads, _ = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    positions = range(context + tokens)
    k = (
        torch.stack([key_cache[int(blocks[p // block_size]), p % block_size] for p in positions])
        .float()
        .repeat_interleave(heads // kv_heads, dim=1)
    )
    v = (
        torch.stack([value_cache[int(blocks[p // block_size]), p % block_size] for p in positions])
        .float()
        .repeat_interleave(heads // kv_heads, dim=1)
    )
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    key = torch.arange(context + tokens)[None, :]
    position = (context + torch.arange(tokens))[:, None]
    seen = key <= position
    if window:
        seen &= key > position - window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:  # a column of logits with no value
        sunk = sinks.float()[:, None, None].expand(heads, tokens, 1)
        weights = F.softmax(torch.cat([scores, sunk], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", weights, v)
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)


def random_sequence(cache_dtype, heads, kv_heads, dim, block_size, context, tokens, seed=0):
    """A cache holding one sequence of context + tokens positions in scattered blocks, and
    fp32 queries for its last `tokens` positions."""
    generator = torch.Generator().manual_seed(seed)
    used = -(-(context + tokens) // block_size)
    shape = (used + 4, block_size, kv_heads, dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    order = list(range(used + 4))
    random.Random(seed).shuffle(order)
    blocks = torch.tensor(order[:used], dtype=torch.int64)
    query = torch.randn(tokens, heads, dim, generator=generator)
    return query, key_cache, value_cache, blocks
