"""Conveyor's C++ paged prefill kernel: a sequence's query tokens attend causally over K/V read
in place from the cache, against attention over K/V gathered token by token."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import ops as cpu_ops
from tests.attention.attention_cases import random_sequence, reference_prefill
from tests.helpers import needs_bf16_panels, needs_cpu_kernels

CACHE_TOLERANCE = 2e-5  # fp32 arithmetic over the cache's values, whatever their width
# bf16 products: the softmax weights rounded to bf16 (8 significant bits) before the product with
# V; the reference rounds the queries alike and keeps the weights exact.
BF16_TOLERANCE = 1e-2
needs_bf16 = needs_bf16_panels
pytestmark = needs_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_ops.load(), "the C++ kernel must build on the test machine"


def check(query, key_cache, value_cache, blocks, context, scale=0.125):
    out = cpu_ops.paged_prefill(query, key_cache, value_cache, blocks, context, scale)
    assert out.dtype == torch.float32 and out.shape == query.shape
    expected = reference_prefill(query, key_cache, value_cache, blocks, context, scale)
    torch.testing.assert_close(out, expected, atol=CACHE_TOLERANCE, rtol=CACHE_TOLERANCE)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 4, 32), (9, 3, 64), (8, 1, 16), (2, 1, 128)]
)
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize(("context", "tokens"), [(0, 1), (0, 7), (0, 65), (3, 17), (60, 70)])
def test_kernel_matches_reference(heads, kv_heads, dim, block_size, context, tokens):
    """Token tiles of 48 / group rows and key tiles of 64: lengths end inside, on and past them,
    after a cached prefix or none."""
    check(
        *random_sequence(torch.float32, heads, kv_heads, dim, block_size, context, tokens), context
    )


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_fp32_queries_over_a_narrower_cache(cache_dtype):
    """The cache's values, widened exactly, with fp32 arithmetic throughout."""
    query, key_cache, value_cache, blocks = random_sequence(cache_dtype, 9, 3, 64, 16, 21, 150)
    check(query, key_cache, value_cache, blocks, 21)


@needs_bf16
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(4, 4, 32), (9, 3, 64), (8, 1, 16), (2, 1, 128)]
)
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize(
    ("context", "tokens"), [(0, 1), (0, 7), (0, 65), (3, 17), (60, 70), (0, 300)]
)
def test_bf16_products_match_the_reference_over_rounded_queries(
    heads, kv_heads, dim, block_size, context, tokens
):
    """A bf16 cache in bf16 dot products: odd and even key counts, tiles of 64 keys ending
    inside, on and past them. A row over one key is that key's value, exactly; past one key the
    weights' rounding shows, so the fp32 kernel's rows differ."""
    query, key_cache, value_cache, blocks = random_sequence(
        torch.bfloat16, heads, kv_heads, dim, block_size, context, tokens
    )
    out = cpu_ops.paged_prefill(query, key_cache, value_cache, blocks, context, 0.125, bf16=True)
    expected = reference_prefill(
        query.bfloat16().float(), key_cache, value_cache, blocks, context, 0.125
    )
    torch.testing.assert_close(out, expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    fp32 = cpu_ops.paged_prefill(query, key_cache, value_cache, blocks, context, 0.125)
    assert torch.equal(out[0], fp32[0]) == (context == 0)
    assert torch.equal(out[-1], fp32[-1]) == (context + tokens == 1)


def test_bf16_products_need_a_bf16_cache():
    query, key_cache, value_cache, blocks = random_sequence(torch.float16, 4, 2, 32, 4, 3, 10)
    match = "a bf16 cache" if cpu_ops.bf16_prefill_available() else "AVX-512 BF16"
    with pytest.raises(RuntimeError, match=match):
        cpu_ops.paged_prefill(query, key_cache, value_cache, blocks, 3, 0.125, bf16=True)


def test_a_long_prompt_over_many_key_tiles():
    query, key_cache, value_cache, blocks = random_sequence(
        torch.bfloat16, 9, 3, 64, 16, 0, 700, seed=4
    )
    check(query, key_cache, value_cache, blocks, 0)


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("window", [1, 7, 64, 100, 1000])
@pytest.mark.parametrize(("context", "tokens"), [(0, 150), (130, 70), (3, 17)])
def test_a_window_matches_the_reference(block_size, window, context, tokens):
    """Each token sees its last `window` positions: windows inside one tile of 64 keys, on one,
    across several and past the whole sequence, after a cached prefix or none, with tiles of
    keys before every token's window skipped."""
    query, key_cache, value_cache, blocks = random_sequence(
        torch.float32, 9, 3, 64, block_size, context, tokens, seed=window
    )
    out = cpu_ops.paged_prefill(
        query, key_cache, value_cache, blocks, context, 0.125, window=window
    )
    expected = reference_prefill(query, key_cache, value_cache, blocks, context, 0.125, window)
    torch.testing.assert_close(out, expected, atol=CACHE_TOLERANCE, rtol=CACHE_TOLERANCE)
    if window >= context + tokens:  # the window holds everything: as no window, to the bit
        whole = cpu_ops.paged_prefill(query, key_cache, value_cache, blocks, context, 0.125)
        assert torch.equal(out, whole)


@needs_bf16
@pytest.mark.parametrize("window", [1, 5, 64, 90])
def test_a_window_in_bf16_products_matches_the_reference(window):
    """The masked keys before a row's window, at any lane of an 8-key group, weigh nothing."""
    query, key_cache, value_cache, blocks = random_sequence(
        torch.bfloat16, 9, 3, 64, 16, 40, 150, seed=window
    )
    out = cpu_ops.paged_prefill(
        query, key_cache, value_cache, blocks, 40, 0.125, bf16=True, window=window
    )
    expected = reference_prefill(
        query.bfloat16().float(), key_cache, value_cache, blocks, 40, 0.125, window
    )
    torch.testing.assert_close(out, expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    if window == 1:  # each row is its own value, exactly
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16)])
@pytest.mark.parametrize(
    ("window", "softcap", "sunk"), [(0, 5.0, False), (0, 0.0, True), (40, 2.0, True)]
)
def test_capped_scores_and_sinks_match_the_reference(bf16, window, softcap, sunk):
    """Gemma 2's capped scores (a cap of 2 changes every row) and gpt-oss's sinks (a logit per
    head, some large, joining each softmax with no value), alone and beside a window."""
    query, key_cache, value_cache, blocks = random_sequence(
        torch.bfloat16, 8, 2, 64, 16, 30, 120, seed=7
    )
    query = query * 4  # scores past the cap
    sinks = torch.tensor([-2.0, 0.0, 1.0, 3.0, 8.0, -1.0, 0.5, 2.0]) if sunk else None
    out = cpu_ops.paged_prefill(
        query, key_cache, value_cache, blocks, 30, 0.125, bf16, window, softcap, sinks
    )
    rows = query.bfloat16().float() if bf16 else query
    expected = reference_prefill(
        rows, key_cache, value_cache, blocks, 30, 0.125, window, sinks, softcap
    )
    tolerance = BF16_TOLERANCE if bf16 else CACHE_TOLERANCE
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    plain = reference_prefill(rows, key_cache, value_cache, blocks, 30, 0.125, window)
    assert not torch.allclose(out, plain, atol=0.05, rtol=0.05)
    with pytest.raises(RuntimeError, match="one sink per query head"):
        cpu_ops.paged_prefill(
            query, key_cache, value_cache, blocks, 30, 0.125, sinks=torch.zeros(3)
        )


def test_a_windowed_chunk_equals_the_same_rows_of_the_whole_prompt():
    query, key_cache, value_cache, blocks = random_sequence(torch.float32, 9, 3, 64, 16, 0, 300)
    whole = cpu_ops.paged_prefill(query, key_cache, value_cache, blocks, 0, 0.125, window=70)
    tail = cpu_ops.paged_prefill(query[200:], key_cache, value_cache, blocks, 200, 0.125, window=70)
    torch.testing.assert_close(tail, whole[200:], atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="window must not be negative"):
        cpu_ops.paged_prefill(query, key_cache, value_cache, blocks, 0, 0.125, window=-1)


def test_a_chunk_equals_the_same_rows_of_the_whole_prompt():
    """A prompt run in one call and its tail run after the head is cached give the same rows to
    the bit: a row's keys and the order of its sums do not depend on how tokens are tiled."""
    query, key_cache, value_cache, blocks = random_sequence(torch.float32, 9, 3, 64, 16, 0, 200)
    whole = cpu_ops.paged_prefill(query, key_cache, value_cache, blocks, 0, 0.125)
    tail = cpu_ops.paged_prefill(query[130:], key_cache, value_cache, blocks, 130, 0.125)
    torch.testing.assert_close(tail, whole[130:], atol=0, rtol=0)


def test_kernel_reads_a_strided_query_and_ignores_spare_block_ids():
    query, key_cache, value_cache, blocks = random_sequence(torch.float32, 6, 2, 32, 4, 9, 14)
    packed = torch.cat([query.flatten(1), torch.randn(14, 40)], dim=1)  # as a fused projection
    strided = packed[:, : 6 * 32].view(14, 6, 32)
    assert not strided.is_contiguous()
    spare = torch.cat([blocks, torch.tensor([10_000, -1])])  # past the sequence: never read
    out = torch.ops.conveyor.paged_prefill(strided, key_cache, value_cache, spare, 9, 0.125)
    expected = reference_prefill(query, key_cache, value_cache, blocks, 9, 0.125)
    torch.testing.assert_close(out, expected, atol=CACHE_TOLERANCE, rtol=CACHE_TOLERANCE)


def test_kernel_rejects_bad_inputs():
    query, key_cache, value_cache, blocks = random_sequence(torch.float32, 4, 2, 32, 4, 3, 10)
    call = torch.ops.conveyor.paged_prefill
    with pytest.raises(RuntimeError, match="multiple of 16"):
        call(
            query[..., :24].contiguous(),
            key_cache[..., :24].contiguous(),
            value_cache[..., :24].contiguous(),
            blocks,
            3,
            0.125,
        )
    with pytest.raises(RuntimeError, match="do not cover"):
        call(query, key_cache, value_cache, blocks[:-1], 3, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        call(query, key_cache, value_cache, torch.full_like(blocks, 999), 3, 0.125)
    with pytest.raises(RuntimeError, match="fp32"):
        call(query.bfloat16(), key_cache, value_cache, blocks, 3, 0.125)
    with pytest.raises(RuntimeError, match="negative"):
        call(query, key_cache, value_cache, blocks, -1, 0.125)
    with pytest.raises(RuntimeError, match="head shapes"):
        call(query[:, :3].contiguous(), key_cache, value_cache, blocks, 3, 0.125)
    assert call(query[:0], key_cache, value_cache, blocks, 3, 0.125).shape == (0, 4, 32)


def several_sequences(cache_dtype=torch.bfloat16, seed=0):
    """Three sequences in one cache (scattered blocks), one fresh, one after 40 cached tokens,
    one after 3, with a decode row between the second and third runs of query rows."""
    generator = torch.Generator().manual_seed(seed)
    block_size, kv_heads, heads, dim = 16, 3, 9, 64
    contexts, lens, starts = [0, 40, 3], [70, 9, 130], [0, 70, 80]
    used = [-(-(c + n) // block_size) for c, n in zip(contexts, lens, strict=True)]
    shape = (sum(used) + 2, block_size, kv_heads, dim)
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype)
    order = torch.randperm(shape[0], generator=generator).tolist()
    table = torch.zeros(3, max(used), dtype=torch.int64)
    for row, n in enumerate(used):
        table[row, :n] = torch.tensor([order.pop() for _ in range(n)])
    query = torch.randn(starts[-1] + lens[-1], heads, dim, generator=generator)
    spans = [torch.tensor(x, dtype=torch.int64) for x in (starts, lens, contexts)]
    return query, key_cache, value_cache, spans, table


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16)])
def test_a_steps_sequences_in_one_call_match_each_alone(bf16):
    """Each run of rows equals its sequence attended alone, to the bit, in fp32 or bf16
    products; rows outside the runs are left as they were."""
    query, key_cache, value_cache, (starts, lens, contexts), table = several_sequences()
    out = torch.full_like(query, 7.0)
    cpu_ops.paged_prefill_rows(
        query, key_cache, value_cache, out, starts, lens, contexts, table, 0.125, bf16
    )
    tolerance = BF16_TOLERANCE if bf16 else CACHE_TOLERANCE
    for row in range(3):
        start, n, context = int(starts[row]), int(lens[row]), int(contexts[row])
        rows = query[start : start + n]
        alone = cpu_ops.paged_prefill(
            rows, key_cache, value_cache, table[row], context, 0.125, bf16
        )
        torch.testing.assert_close(out[start : start + n], alone, atol=0, rtol=0)
        expected = reference_prefill(
            rows.bfloat16().float() if bf16 else rows,
            key_cache,
            value_cache,
            table[row],
            context,
            0.125,
        )
        torch.testing.assert_close(out[start : start + n], expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(out[79], torch.full_like(out[79], 7.0))


def test_one_call_rejects_bad_runs():
    query, key_cache, value_cache, (starts, lens, contexts), table = several_sequences()
    call = torch.ops.conveyor.paged_prefill_rows

    def run(out=None, starts=starts, lens=lens, contexts=contexts, table=table):
        call(
            query,
            key_cache,
            value_cache,
            torch.empty_like(query) if out is None else out,
            starts,
            lens,
            contexts,
            table,
            0.125,
        )

    with pytest.raises(RuntimeError, match="in order, apart"):
        run(starts=torch.tensor([0, 60, 80]))  # the second run starts inside the first
    with pytest.raises(RuntimeError, match="in order, apart"):
        run(lens=torch.tensor([70, 9, 131]))  # past the last query row
    with pytest.raises(RuntimeError, match="in order, apart"):
        run(lens=torch.tensor([70, 0, 130]))
    with pytest.raises(RuntimeError, match="out must be"):
        run(out=torch.empty(query.shape[0] - 1, *query.shape[1:]))
    with pytest.raises(RuntimeError, match="int64"):
        run(contexts=contexts[:2])
    with pytest.raises(RuntimeError, match="table"):
        run(table=table[:2])
    with pytest.raises(RuntimeError, match="do not cover"):
        run(table=table[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="out of range"):
        run(table=torch.full_like(table, 10_000))


@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2]
)
def test_store_op_writes_what_the_cache_writes(cache_dtype):
    """New K/V read from a fused projection's rows (strided) land at their slots rounded as
    `KVCache.write` rounds them, to the bit; other slots keep what they held."""
    from engine.kv.kv_cache import KVCache, KVCacheSpec

    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=32, dtype=cache_dtype, block_size=4)
    ours, reference = (KVCache(spec, num_blocks=40, device=torch.device("cpu")) for _ in range(2))
    packed = torch.randn(150, 9 * 32)  # as the fused q/k/v output holds them
    key, value = packed[:, 96:192].view(150, 3, 32), packed[:, 192:].view(150, 3, 32)
    slots = torch.randperm(160)[:150]
    cpu_ops.store_kv(key, value, ours.key(1), ours.value(1), slots)
    reference.write(1, slots, key, value)
    assert torch.equal(ours.tensor.view(torch.uint8), reference.tensor.view(torch.uint8))
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.store_kv(key, value, ours.key(1), ours.value(1), slots + 1_000)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_ops.store_kv(key.bfloat16(), value, ours.key(1), ours.value(1), slots)


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    ("dim", "query_dtype", "cache_dtype", "model_dtype", "kernel_calls"),
    [
        (32, F32, F32, F32, [False]),
        (8, F32, F32, F32, []),
        (32, BF16, BF16, BF16, []),
        (32, F32, BF16, F32, [False]),  # an fp32 model over a narrower cache: fp32 products
        pytest.param(32, F32, BF16, BF16, [True], marks=needs_bf16),  # bf16 weights, fp32 rows
    ],
)
@pytest.mark.parametrize("features", ["plain", "window", "all"])
def test_backend_sends_prefill_chunks_to_the_kernel_where_it_applies(
    monkeypatch, dim, query_dtype, cache_dtype, model_dtype, kernel_calls, features
):
    """A fresh prompt and a chunk after cached tokens go to the kernel in one call, beside a
    decode row, in bf16 products for a bf16 model over a bf16 cache, with the layer's window,
    score cap and sinks; head dims it does not take and 16-bit activations keep the torch path.
    All give the gathered reference."""
    import numpy as np

    from engine.attention import get_backend
    from engine.attention.backend import LayerAttention
    from engine.kv.kv_cache import KVCache, KVCacheSpec
    from engine.worker.input_batch import InputBatch

    calls = []
    original = cpu_ops.paged_prefill_rows
    monkeypatch.setattr(
        cpu_ops,
        "paged_prefill_rows",
        lambda *args: calls.append(args[6:8] + args[9:11]) or original(*args),  # bf16, window
    )
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=dim, dtype=cache_dtype, block_size=4)
    cache = KVCache(spec, num_blocks=20, device=torch.device("cpu"))
    backend = get_backend("cpu", torch.device("cpu"), model_dtype)
    contexts, queries = [0, 6, 9], [5, 7, 1]  # the last row decodes
    tables = [[3, 9, 0], [12, 1, 7, 4], [15, 16, 17]]
    lengths = [c + q for c, q in zip(contexts, queries, strict=True)]
    k_all = [torch.randn(n, 2, dim, dtype=query_dtype) for n in lengths]
    v_all = [torch.randn(n, 2, dim, dtype=query_dtype) for n in lengths]

    def slots(row, positions):
        return [tables[row][p // 4] * 4 + p % 4 for p in positions]

    for row in (1, 2):
        context = contexts[row]
        cache.write(
            0, torch.tensor(slots(row, range(context))), k_all[row][:context], v_all[row][:context]
        )
    batch = InputBatch(
        requests=[],
        input_ids=np.zeros(13, dtype=np.int64),
        positions=np.concatenate([np.arange(0, 5), np.arange(6, 13), [9]]),
        slot_mapping=np.array(slots(0, range(5)) + slots(1, range(6, 13)) + slots(2, [9])),
        query_starts=np.array([0, 5, 12]),
        query_lens=np.array(queries),
        context_lens=np.array(contexts),
        block_table=np.array([tables[0] + [0], tables[1], tables[2] + [0]]),
        sample_rows=np.arange(3),
    )
    q = torch.randn(13, 4, dim, dtype=query_dtype)
    new_k = torch.cat([k_all[0], k_all[1][6:], k_all[2][9:]])
    new_v = torch.cat([v_all[0], v_all[1][6:], v_all[2][9:]])
    window = 0 if features == "plain" else 3
    softcap = 3.0 if features == "all" else 0.0
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if features == "all" else None
    metadata = backend.build_metadata(batch, cache)
    attention = LayerAttention.of(window, softcap, sinks)
    out = backend.forward(0, q, new_k, new_v, 0.25, metadata, attention)
    assert [(c.tolist(), t.shape[1], bf16, w) for c, t, bf16, w in calls] == [
        ([0, 6], 4, bf16, window) for bf16 in kernel_calls
    ]
    for row, start in enumerate([0, 5, 12]):
        n, context = queries[row], contexts[row]
        blocks = torch.tensor(tables[row])
        rows = q[start : start + n].to(cache_dtype if kernel_calls == [True] else F32).float()
        expected = reference_prefill(
            rows, cache.key(0), cache.value(0), blocks, context, 0.25, window, sinks, softcap
        )
        tol = 2e-2 if query_dtype == BF16 or kernel_calls == [True] else 1e-5
        torch.testing.assert_close(out[start : start + n].float(), expected, atol=tol, rtol=tol)
