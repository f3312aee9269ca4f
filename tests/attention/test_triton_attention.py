"""Conveyor's Triton kernels against a token-by-token reference: on the GPU where there is one,
else in Triton's interpreter on the CPU."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed on this platform")

from engine.attention import get_backend, resolve_backend_name, triton_paged
from engine.kernels.triton import paged_attention as kernels
from engine.kv.kv_cache import KVCache, KVCacheSpec
from tests.attention.attention_cases import (
    TOLERANCE,
    random_case,
    reference_decode,
    reference_prefill,
)
from tests.conftest import TRITON_DEVICE


def on_device(case):
    return tuple(t.to(TRITON_DEVICE) for t in case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(4, 4, 16), (9, 3, 5), (8, 1, 1)])
def test_decode_matches_reference(dtype, heads, kv_heads, block_size):
    case = random_case(
        dtype, heads, kv_heads, 32, block_size, [1, 2, block_size, block_size + 1, 37]
    )
    out = kernels.paged_decode(*on_device(case), scale=0.125)
    assert out.dtype == dtype and out.shape == case[0].shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.cpu().float(), reference_decode(*case, scale=0.125), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_matches_reference(dtype, splits):
    """Sequences split into pieces, some of them empty (a row shorter than a tile per piece,
    an empty row), combined to what one pass gives."""
    lens = [0, 1, 31, 33, 97, 260]
    case = random_case(dtype, 8, 2, 64, 16, lens, seed=splits)
    out = kernels.paged_decode(*on_device(case), scale=0.125, splits=splits)
    tol = TOLERANCE[dtype]
    query, key_cache, value_cache, tables, lengths = case
    expected = reference_decode(query[1:], key_cache, value_cache, tables[1:], lengths[1:], 0.125)
    torch.testing.assert_close(out[1:].cpu().float(), expected, atol=tol, rtol=tol)
    assert not out[0].cpu().any(), "a row of no tokens gives zeros"
    one_pass = kernels.paged_decode(*on_device(case), scale=0.125, splits=1)
    torch.testing.assert_close(out, one_pass, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("splits", [1, 3])
def test_a_windowed_decode_attends_to_each_rows_last_tokens(window, splits):
    lens = [1, 5, 17, 33, 70]
    case = random_case(torch.float32, 8, 2, 32, 5, lens, seed=window)
    out = kernels.paged_decode(*on_device(case), scale=0.125, splits=splits, window=window)
    expected = reference_decode(*case, scale=0.125, window=window)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 7, 20])
def test_windowed_prefill_rows_attend_within_their_windows(window):
    """Windows shorter than a tile and longer, over fresh prompts and chunks after a cached
    prefix: a tile's keys start where its first token's window does."""
    assert_prefill_rows_match_reference(window, sinks=None, seed=window)


def assert_prefill_rows_match_reference(window: int, sinks: torch.Tensor | None, seed: int):
    """Fresh prompts and chunks after a cached prefix, fp32, in one launch (within `window`,
    with `sinks`, where given), each row against the token-by-token reference."""
    rows = [(0, 40), (37, 33), (3, 9)]
    query, key_cache, value_cache, table, lens = prefill_step(
        torch.float32, 4, 2, 16, 5, rows, seed=seed
    )
    contexts = np.array([c for c, _ in rows])
    starts = np.cumsum(lens) - lens
    device = torch.device(TRITON_DEVICE)
    work = kernels.PrefillRows.of(starts, lens, contexts, table.numpy(), device)
    out = torch.zeros_like(query).to(device)
    q, kc, vc = (t.to(device) for t in (query, key_cache, value_cache))
    on_device_sinks = None if sinks is None else sinks.to(device)
    kernels.paged_prefill(out, q, kc, vc, work, scale=0.2, window=window, sinks=on_device_sinks)
    tol = TOLERANCE[torch.float32]
    for row in range(len(rows)):
        span = slice(int(starts[row]), int(starts[row] + lens[row]))
        expected = reference_prefill(
            query[span], key_cache, value_cache, table[row], int(contexts[row]), 0.2, window, sinks
        )
        torch.testing.assert_close(out.cpu()[span], expected, atol=tol, rtol=tol)


def sinks_of(heads: int, seed: int) -> torch.Tensor:
    """Per-head sink logits about as large as the scores, so each one weighs."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2.0


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_joins_each_heads_sink_to_its_softmax(dtype, window, splits):
    """gpt-oss's sinks, in one pass and across splits (joined where they combine), with and
    without a window; a row of no tokens still gives zeros."""
    lens = [0, 1, 17, 33, 70]
    case = random_case(dtype, 8, 2, 32, 5, lens, seed=11)
    sinks = sinks_of(8, seed=window + splits).to(dtype)
    out = kernels.paged_decode(
        *on_device(case), scale=0.125, splits=splits, window=window, sinks=sinks.to(TRITON_DEVICE)
    )
    query, key_cache, value_cache, tables, lengths = case
    expected = reference_decode(
        query[1:], key_cache, value_cache, tables[1:], lengths[1:], 0.125, window, sinks=sinks
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[1:].cpu().float(), expected, atol=tol, rtol=tol)
    assert not out[0].cpu().any(), "a row of no tokens gives zeros"
    plain = reference_decode(query[1:], key_cache, value_cache, tables[1:], lengths[1:], 0.125)
    assert (plain - expected).abs().max() > 10 * tol, "the sinks weigh"


@pytest.mark.parametrize("window", [0, 7])
def test_prefill_rows_join_each_heads_sink_to_their_softmax(window):
    assert_prefill_rows_match_reference(window, sinks=sinks_of(4, seed=window), seed=window + 1)


def test_sinks_must_be_one_logit_per_query_head():
    case = on_device(random_case(torch.float32, 8, 2, 32, 5, [3], seed=1))
    with pytest.raises(ValueError, match="one contiguous logit per query head"):
        kernels.paged_decode(*case, scale=0.1, sinks=torch.zeros(2, device=TRITON_DEVICE))


def test_splits_fill_the_multiprocessors_from_the_batch_shape_alone(monkeypatch):
    monkeypatch.setattr(kernels, "_multiprocessors", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert kernels.decode_splits(1, 8, cuda) == kernels.MAX_SPLITS  # 264 // 8 = 33, capped
    assert kernels.decode_splits(8, 8, cuda) == 4  # 264 // 64
    assert kernels.decode_splits(64, 8, cuda) == 1
    assert kernels.decode_splits(1, 8, torch.device("cpu")) == 1


def prefill_step(dtype, heads, kv_heads, dim, block_size, rows, seed=0):
    """One step's multi-token rows, `(cached tokens, query tokens)` each, over one cache of
    scattered blocks holding every row's whole sequence; the query flattened as a step is."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in rows]
    pool = sum(needed) + 3
    key_cache = torch.randn(pool, block_size, kv_heads, dim, generator=generator).to(dtype)
    value_cache = torch.randn(pool, block_size, kv_heads, dim, generator=generator).to(dtype)
    free = list(range(pool))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    table = torch.zeros(len(rows), max(needed), dtype=torch.int64)
    for row, blocks in enumerate(tables):
        table[row, : len(blocks)] = torch.tensor(blocks)
    lens = np.array([q for _, q in rows])
    query = torch.randn(int(lens.sum()), heads, dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, table, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(4, 2, 16), (6, 3, 5), (4, 1, 1)])
def test_prefill_rows_of_a_step_match_reference_in_one_call(dtype, heads, kv_heads, block_size):
    """Fresh prompts and chunks after a cached prefix, shorter and longer than a tile, in one
    launch; tokens of other rows (decodes) are left as they were."""
    rows = [(0, 5), (9, 4), (0, 40), (37, 33), (0, 1)]
    query, key_cache, value_cache, table, lens = prefill_step(
        dtype, heads, kv_heads, 24, block_size, rows
    )
    contexts = np.array([c for c, _ in rows])
    starts = np.cumsum(lens) - lens
    # Row 4 stands for a decode row: not handed to the prefill kernel.
    prefill = [0, 1, 2, 3]
    device = torch.device(TRITON_DEVICE)
    work = kernels.PrefillRows.of(
        starts[prefill], lens[prefill], contexts[prefill], table[prefill].numpy(), device
    )
    out = torch.full_like(query, 7.0).to(device)
    q, kc, vc = (t.to(device) for t in (query, key_cache, value_cache))
    kernels.paged_prefill(out, q, kc, vc, work, scale=0.2)
    out = out.cpu().float()
    tol = TOLERANCE[dtype]
    for row in prefill:
        span = slice(int(starts[row]), int(starts[row] + lens[row]))
        expected = reference_prefill(
            query[span], key_cache, value_cache, table[row], int(contexts[row]), 0.2
        )
        torch.testing.assert_close(out[span], expected, atol=tol, rtol=tol, msg=f"row {row}")
    assert torch.equal(out[-1], torch.full_like(out[-1], 7.0)), "the decode row is untouched"


def test_prefill_work_list_tiles_every_row():
    work = kernels.PrefillRows.of(
        np.array([0, 3, 70]), np.array([3, 67, 32]), np.zeros(3), np.zeros((3, 1)), "cpu"
    )
    assert work.tile_rows.tolist() == [0, 1, 1, 1, 2]
    assert work.tile_starts.tolist() == [0, 0, 32, 64, 0]


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def scaled(case, cache_dtype, key_scale, value_scale):
    """The case with its caches in fp8 holding K/V divided by their scales, and the K/V those
    caches stand for (what the reference attends over)."""
    query, key_cache, value_cache, *rest = case
    fp8_keys = (key_cache.float() / key_scale).to(cache_dtype)
    fp8_values = (value_cache.float() / value_scale).to(cache_dtype)
    seen = (fp8_keys.float() * key_scale, fp8_values.float() * value_scale)
    return (query, fp8_keys, fp8_values, *rest), (query, *seen, *rest)


def scales_of(key_scale: float, value_scale: float) -> torch.Tensor:
    """A layer's scales as the kernels read them: `[2]` fp32 on the device."""
    return torch.tensor([key_scale, value_scale], device=TRITON_DEVICE)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_reads_an_fp8_cache_with_scales(cache_dtype, query_dtype, splits):
    case = random_case(query_dtype, 8, 2, 32, 16, [1, 30, 70], seed=5)
    ours, reference = scaled(case, cache_dtype, 0.5, 2.0)
    out = kernels.paged_decode(
        *on_device(ours), scale=0.125, splits=splits, kv_scales=scales_of(0.5, 2.0)
    )
    assert out.dtype == query_dtype
    tol = TOLERANCE[query_dtype] * 4  # 2.0 times values of up to ~4
    expected = reference_decode(*reference, scale=0.125)
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_prefill_reads_an_fp8_cache_with_scales(cache_dtype):
    rows = [(0, 5), (9, 40)]
    query, key_cache, value_cache, table, lens = prefill_step(
        torch.bfloat16, 4, 2, 32, 16, rows, seed=2
    )
    (_, fp8_keys, fp8_values, *_), (_, keys, values, *_) = scaled(
        (query, key_cache, value_cache), cache_dtype, 2.0, 0.5
    )
    contexts = np.array([c for c, _ in rows])
    starts = np.cumsum(lens) - lens
    device = torch.device(TRITON_DEVICE)
    work = kernels.PrefillRows.of(starts, lens, contexts, table.numpy(), device)
    out = torch.zeros_like(query).to(device)
    q, kc, vc = (t.to(device) for t in (query, fp8_keys, fp8_values))
    kernels.paged_prefill(out, q, kc, vc, work, 0.2, kv_scales=scales_of(2.0, 0.5))
    for row in range(len(rows)):
        span = slice(int(starts[row]), int(starts[row] + lens[row]))
        expected = reference_prefill(query[span], keys, values, table[row], int(contexts[row]), 0.2)
        torch.testing.assert_close(out[span].cpu().float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_store_into_fp8_divides_by_the_scales_and_saturates(cache_dtype):
    key = torch.tensor([[[1.0, -3.0, 1e6, -1e6]]]).repeat(2, 1, 4).to(TRITON_DEVICE)
    value = key / 2
    key_cache = torch.zeros(2, 4, 1, 16, dtype=cache_dtype, device=TRITON_DEVICE)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([5, -1], device=TRITON_DEVICE)
    kernels.store_kv(key, value, key_cache, value_cache, slots, kv_scales=scales_of(0.5, 4.0))
    largest = torch.finfo(cache_dtype).max
    stored_key, stored_value = key_cache[1, 1, 0].float().cpu(), value_cache[1, 1, 0].float().cpu()
    assert stored_key[:4].tolist() == [2.0, -6.0, largest, -largest]
    assert stored_value[:4].tolist() == [0.125, -0.375, largest, -largest]
    assert key_cache[0].float().abs().sum() == 0 and key_cache[1, 0].float().abs().sum() == 0


def test_decode_reads_a_strided_query_and_gives_zeros_for_empty_rows():
    query, key_cache, value_cache, tables, lens = random_case(
        torch.float32, 6, 2, 24, 4, [3, 9, 14]
    )
    packed = torch.cat([query.flatten(1), torch.randn(3, 40)], dim=1)  # as a fused projection
    strided = packed[:, : 6 * 24].view(3, 6, 24)  # head dim 24: not a power of two
    empty = torch.tensor([0, 9, 0])
    out = kernels.paged_decode(
        *on_device((strided, key_cache, value_cache, tables, empty)), scale=0.25
    ).cpu()
    assert torch.equal(out[0], torch.zeros(6, 24)) and torch.equal(out[2], torch.zeros(6, 24))
    expected = reference_decode(query[1:2], key_cache, value_cache, tables[1:2], lens[1:2], 0.25)
    torch.testing.assert_close(out[1:2], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_the_slots_the_cache_writes_and_skips_padding(dtype):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=16, dtype=dtype, block_size=5)
    ours = KVCache(spec, num_blocks=6, device=torch.device(TRITON_DEVICE))
    reference = KVCache(spec, num_blocks=6, device=torch.device(TRITON_DEVICE))
    fused = torch.randn(7, 9, 16).to(dtype).to(TRITON_DEVICE)  # q, k, v heads side by side
    key, value = fused[:, 3:6], fused[:, 6:]
    slots = torch.tensor([0, 29, 7, -1, 12, -1, 3], device=TRITON_DEVICE)
    kernels.store_kv(key, value, ours.key(1), ours.value(1), slots)
    kept = slots >= 0
    reference.write(1, slots[kept], key[kept], value[kept])
    assert torch.equal(ours.tensor, reference.tensor)
    assert ours.tensor[0].abs().sum() == 0  # the other layer is untouched


def test_kernels_refuse_mismatched_inputs():
    query, key_cache, value_cache, tables, lens = random_case(torch.float32, 6, 4, 8, 4, [5])
    with pytest.raises(ValueError, match="do not divide"):
        kernels.paged_decode(query, key_cache, value_cache, tables, lens, 1.0)
    query, key_cache, value_cache, tables, lens = random_case(torch.float32, 4, 2, 8, 4, [5])
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode(query.half(), key_cache, value_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="one row per query"):
        kernels.paged_decode(query, key_cache, value_cache, tables, lens[:0], 1.0)
    with pytest.raises(ValueError, match="same number of tokens"):
        kernels.store_kv(key_cache[0], value_cache[0], key_cache, value_cache, lens)


def test_backend_choice_on_gpus(monkeypatch):
    monkeypatch.setattr(triton_paged, "usable", lambda device: True)
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    monkeypatch.setattr(triton_paged, "usable", lambda device: False)
    assert resolve_backend_name("auto", torch.device("cuda")) == "torch"
    monkeypatch.setattr(triton_paged, "available", lambda: False)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        get_backend("triton", torch.device(TRITON_DEVICE))


def test_usable_runs_the_kernels_and_reports_a_failure(monkeypatch, caplog):
    triton_paged.usable.cache_clear()
    assert triton_paged.usable(TRITON_DEVICE)

    def no_compiler():
        raise RuntimeError("Failed to find C compiler. Please specify via CC")

    monkeypatch.setattr(triton_paged, "_kernels", no_compiler)
    triton_paged.usable.cache_clear()
    assert not triton_paged.usable(TRITON_DEVICE)
    assert "Failed to find C compiler" in caplog.text
    triton_paged.usable.cache_clear()


@pytest.mark.parametrize("broken", ["paged_decode", "paged_prefill"])
def test_usable_refuses_a_kernel_that_answers_wrongly(monkeypatch, caplog, broken):
    """A kernel that runs but computes the wrong thing (a Triton or driver version that
    miscompiles it) turns the backend down too."""

    class Wrong:
        def __getattr__(self, name):
            return getattr(kernels, name)

    wrong = Wrong()
    if broken == "paged_decode":
        wrong.paged_decode = lambda query, *args: torch.zeros_like(query)
    else:
        wrong.paged_prefill = lambda out, *args: out.fill_(1.0)
    monkeypatch.setattr(triton_paged, "_kernels", lambda: wrong)
    triton_paged.usable.cache_clear()
    try:
        assert not triton_paged.usable(TRITON_DEVICE)
    finally:
        triton_paged.usable.cache_clear()
    kind = "decode" if broken == "paged_decode" else "prefill"
    assert f"the {kind}" in caplog.text and "wrong answer" in caplog.text


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        get_backend("triton", torch.device("cpu"))
