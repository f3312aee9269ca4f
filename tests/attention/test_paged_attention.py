"""The paged KV cache against full recomputation on a tiny random-weight Llama."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.attention import get_backend
from engine.kv.kv_cache import KVCache, KVCacheSpec
from engine.scheduling.scheduler import ScheduledRequest
from engine.worker.input_batch import InputBatch
from tests.conftest import CUDA, TRITON_DEVICE, needs_triton
from tests.helpers import tiny_core, tiny_llama
from tests.scheduler_utils import create_request


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of the last position from a plain forward over the whole sequence."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            ids = torch.tensor([tokens], device=model.device)
            return model(input_ids=ids, use_cache=False).logits[0, -1].float()
    finally:
        from engine.attention.hf import register

        model.set_attn_implementation(register())


def run_chunk(core, request, num_tokens: int) -> torch.Tensor:
    """Run one chunk of one request through the runner; return the last position's logits."""
    from engine.worker.input_batch import build_input_batch

    assert core.scheduler.block_manager.allocate(request, request.num_computed_tokens + num_tokens)
    block_size = core.runner.kv_cache.block_size
    batch = build_input_batch([ScheduledRequest(request, num_tokens)], block_size)
    logits = core.runner.forward(batch, np.array([batch.num_tokens - 1]))
    request.num_computed_tokens += num_tokens
    return logits[0].float()


def test_decode_logits_through_the_paged_cache_equal_a_full_recompute(device):
    model = tiny_llama().to(device)
    core, _ = tiny_core(model, device=device, block_size=4)
    request = create_request("r", prompt_len=11)
    run_chunk(core, request, 11)
    rng = random.Random(0)
    for _ in range(9):  # decode across several block boundaries
        request.append_output(rng.randrange(2, 320))
        paged = run_chunk(core, request, 1)
        reference = full_logits(model, request.all_token_ids)
        torch.testing.assert_close(paged, reference, atol=1e-4, rtol=1e-4)


def test_prefill_chunks_after_a_cached_prefix_equal_a_full_recompute(device):
    model = tiny_llama().to(device)
    core, _ = tiny_core(model, device=device, block_size=4)
    request = create_request("r", prompt_len=30)
    for size in (7, 9, 14):  # chunk boundaries inside blocks
        logits = run_chunk(core, request, size)
        prefix = request.all_token_ids[: request.num_computed_tokens]
        torch.testing.assert_close(logits, full_logits(model, prefix), atol=1e-4, rtol=1e-4)


def test_mixed_batch_of_decodes_and_prefills_matches_each_sequence_alone(device):
    """One flattened step: two decodes with different contexts, a fresh prompt and a chunk."""
    from engine.worker.input_batch import build_input_batch

    model = tiny_llama().to(device)
    core, _ = tiny_core(model, device=device, block_size=4)
    a, b = create_request("a", prompt_len=5), create_request("b", prompt_len=13)
    c, d = create_request("c", prompt_len=6), create_request("d", prompt_len=20)
    run_chunk(core, a, 5)
    run_chunk(core, b, 13)
    run_chunk(core, d, 8)
    a.append_output(42)
    b.append_output(17)
    items = [
        ScheduledRequest(a, 1),
        ScheduledRequest(b, 1),
        ScheduledRequest(c, 6),
        ScheduledRequest(d, 12),
    ]
    for item in items:
        core.scheduler.block_manager.allocate(
            item.request, item.request.num_computed_tokens + item.num_tokens
        )
    batch = build_input_batch(items, 4)
    last = batch.query_starts + batch.query_lens - 1
    logits = core.runner.forward(batch, last).float()
    for row, item in enumerate(items):
        reference = full_logits(model, item.request.all_token_ids)
        torch.testing.assert_close(logits[row], reference, atol=1e-4, rtol=1e-4)


def naive_attention(q, k, v, scale):
    """q [n, H, D], k/v [L, KVH, D], causal with the n queries at the end of L."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n, length = q.shape[0], k.shape[0]
    allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v)


def mixed_step(
    cache: KVCache,
    history: dict[int, tuple[torch.Tensor, torch.Tensor]],
    contexts: list[int],
    queries: list[int],
) -> tuple[InputBatch, torch.Tensor, torch.Tensor]:
    """One step over layer 0 for rows whose full K/V are `history[row]`: `contexts[row]` of
    their tokens already cached (written as earlier steps would have, in scattered blocks) and
    the next `queries[row]` new. Returns the step's batch and its new K and V."""
    block_size, device = cache.block_size, cache.device
    total = [c + q for c, q in zip(contexts, queries, strict=True)]
    free = list(range(cache.num_blocks))
    random.Random(1).shuffle(free)  # blocks are scattered, not contiguous
    tables = [[free.pop() for _ in range(-(-t // block_size))] for t in total]
    width = max(len(t) for t in tables)

    def slots(row, positions):
        return [tables[row][p // block_size] * block_size + p % block_size for p in positions]

    for row, ctx in enumerate(contexts):
        if ctx:
            k, v = history[row]
            cache.write(0, torch.tensor(slots(row, range(ctx)), device=device), k[:ctx], v[:ctx])
    rows = range(len(contexts))
    batch = InputBatch(
        requests=[],
        input_ids=np.zeros(sum(queries), dtype=np.int64),
        positions=np.concatenate([np.arange(c, t) for c, t in zip(contexts, total, strict=True)]),
        slot_mapping=np.array(
            [s for row in rows for s in slots(row, range(contexts[row], total[row]))]
        ),
        query_starts=np.cumsum([0, *queries[:-1]]),
        query_lens=np.array(queries),
        context_lens=np.array(contexts),
        block_table=np.array([t + [0] * (width - len(t)) for t in tables]),
        sample_rows=np.arange(len(contexts)),
    )
    new_k = torch.cat([history[row][0][contexts[row] :] for row in rows])
    new_v = torch.cat([history[row][1][contexts[row] :] for row in rows])
    return batch, new_k, new_v


BACKENDS_ON_DEVICES = [
    ("torch", "cpu"),
    ("cpu", "cpu"),
    pytest.param("triton", TRITON_DEVICE, marks=needs_triton),
    pytest.param("torch", CUDA.values[0], marks=CUDA.marks),
]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dim", [8, 32])
@pytest.mark.parametrize(("backend_name", "device"), BACKENDS_ON_DEVICES)
def test_backend_matches_naive_attention_per_sequence(block_size, dim, backend_name, device):
    """Decodes, fresh prompts and chunks after a cached prefix in one step (the cpu backend's
    prefill kernel takes head dim 32; 8 keeps the torch path)."""
    torch.manual_seed(0)
    heads, kv_heads = 4, 2
    spec = KVCacheSpec(
        num_layers=1,
        num_kv_heads=kv_heads,
        head_dim=dim,
        dtype=torch.float32,
        block_size=block_size,
    )
    cache = KVCache(spec, num_blocks=64, device=torch.device(device))
    backend = get_backend(backend_name, torch.device(device))
    assert backend.name == backend_name
    contexts, queries = [0, 5, 9, 0], [1, 1, 4, 6]
    total = [c + q for c, q in zip(contexts, queries, strict=True)]
    history = {
        i: (
            torch.randn(t, kv_heads, dim, device=device),
            torch.randn(t, kv_heads, dim, device=device),
        )
        for i, t in enumerate(total)
    }
    batch, new_k, new_v = mixed_step(cache, history, contexts, queries)
    query_starts = batch.query_starts
    q = torch.randn(sum(queries), heads, dim, device=device)
    out = backend.forward(0, q, new_k, new_v, 0.5, backend.build_metadata(batch, cache))
    for row in range(4):
        start, n = int(query_starts[row]), queries[row]
        k, v = history[row]
        expected = naive_attention(q[start : start + n], k, v, 0.5)
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
