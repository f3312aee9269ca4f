"""Conveyor's C++ paged decode kernel against attention over gathered K/V, and the backend
choice that puts it on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import available_backends, get_backend, resolve_backend_name
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.build import BuildResult
from tests.attention.attention_cases import TOLERANCE, random_case, reference_decode


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_ops.load(), "the C++ kernel must build on the test machine"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_kernel_matches_reference(dtype, heads, kv_heads, block_size):
    lens = [1, 2, block_size, block_size + 1, 37, 70]
    case = random_case(dtype, heads, kv_heads, 32, block_size, lens)
    out = cpu_ops.paged_decode(*case, scale=0.125)
    assert out.dtype == dtype and out.shape == case[0].shape
    expected = reference_decode(*case, scale=0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [24, 64, 128])
@pytest.mark.parametrize("block_size", [5, 16])
def test_kernel_matches_reference_for_each_head_dim_path(dtype, dim, block_size):
    """64 and 128 keep the weighted sum in registers, 24 is not a multiple of the 8-wide steps;
    lengths leave 1 to 3 rows after the four-row score steps."""
    lens = [1, 3, 6, block_size + 2, 41, 66]
    case = random_case(dtype, 9, 3, dim, block_size, lens, seed=dim)
    out = cpu_ops.paged_decode(*case, scale=dim**-0.5)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out.float(), reference_decode(*case, scale=dim**-0.5), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("rows", [2, 40])  # by (sequence, kv head), and by sequence
@pytest.mark.parametrize(("softcap", "sunk"), [(0.5, False), (0.0, True), (2.0, True)])
def test_capped_scores_and_sinks_match_the_reference(dtype, window, rows, softcap, sunk):
    """Gemma 2's soft cap and gpt-oss's sinks, alone and together, with and without a window,
    over each way the work is cut."""
    rng = random.Random(rows)
    lens = [rng.randrange(1, 60) for _ in range(rows)]
    case = random_case(dtype, 8, 2, 32, 5, lens, seed=rows)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2 if sunk else None
    options = {"scale": 0.5, "window": window, "softcap": softcap, "sinks": sinks}
    out = cpu_ops.paged_decode(*case, **options)
    expected = reference_decode(*case, **options)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    plain = reference_decode(*case, scale=0.5, window=window)
    assert (expected - plain).abs().max() > 1e-2  # the features change the rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 4, 5, 9, 64])
@pytest.mark.parametrize("rows", [2, 40])  # by (sequence, kv head), and by sequence
def test_a_window_attends_to_each_rows_last_tokens_only(dtype, window, rows):
    """Windows shorter than a block, of a block, across blocks and longer than the rows:
    each row starts mid-block where its window does."""
    rng = random.Random(window)
    lens = [rng.randrange(1, 60) for _ in range(rows)]
    case = random_case(dtype, 8, 2, 32, 5, lens, seed=window)
    out = cpu_ops.paged_decode(*case, scale=0.125, window=window)
    tol = TOLERANCE[dtype]
    expected = reference_decode(*case, scale=0.125, window=window)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    if window < max(lens):
        whole = reference_decode(*case, scale=0.125)
        assert not torch.allclose(out.float(), whole, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_splits_work_by_sequence_or_by_head_alike(dtype):
    """Many rows run one task per sequence, few rows one task per kv head: same numbers."""
    lens = [random.Random(row).randrange(1, 90) for row in range(4 * torch.get_num_threads() + 8)]
    case = random_case(dtype, 9, 3, 64, 16, lens, seed=3)
    many = cpu_ops.paged_decode(*case, scale=0.125)
    few = torch.cat(
        [
            cpu_ops.paged_decode(
                *(t[row : row + 1] if t.dim() != 4 else t for t in case), scale=0.125
            )
            for row in range(len(lens))
        ]
    )
    torch.testing.assert_close(many, few, atol=0, rtol=0)
    expected = reference_decode(*case, scale=0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(many.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [3, 40])
def test_kernel_gives_the_same_bits_on_any_number_of_threads(rows):
    """Tasks (sequences, or kv heads of few sequences) go to whichever thread is free, each
    fetching the first block of the one it takes next; every output is one task's, so one
    thread or several give the same bits."""
    lens = [random.Random(rows + row).randrange(1, 120) for row in range(rows)]
    case = random_case(torch.bfloat16, 9, 3, 64, 16, lens, seed=rows)
    query, key_cache, value_cache, tables, seq_lens = case
    query = query.float()
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(
                cpu_ops.paged_decode(query, key_cache, value_cache, tables, seq_lens, 0.125)
            )
    finally:
        torch.set_num_threads(threads)
    for other in outputs[1:]:
        assert torch.equal(outputs[0], other)
    expected = reference_decode(
        query, key_cache.float(), value_cache.float(), tables, seq_lens, 0.125
    )
    torch.testing.assert_close(outputs[0], expected, atol=1e-5, rtol=1e-5)


def test_kernel_reads_a_strided_query_and_ignores_table_padding():
    query, key_cache, value_cache, tables, lens = random_case(
        torch.float32, 6, 2, 16, 4, [3, 9, 14]
    )
    packed = torch.cat([query.flatten(1), torch.randn(3, 40)], dim=1)  # as a fused projection
    strided = packed[:, : 6 * 16].view(3, 6, 16)
    assert not strided.is_contiguous()
    padded = torch.cat([tables, torch.full((3, 2), 10_000)], dim=1)  # never-read columns
    out = cpu_ops.paged_decode(strided, key_cache, value_cache, padded, lens, 0.25)
    expected = reference_decode(query, key_cache, value_cache, tables, lens, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_fp32_query_over_a_narrower_cache(cache_dtype):
    """A model computed in fp32 over a 16- or 8-bit cache: the cache's values, widened exactly,
    with fp32 arithmetic throughout (odd lengths leave partial blocks and SIMD tails)."""
    query, key_cache, value_cache, tables, lens = random_case(
        torch.float32, 6, 2, 64, 16, [1, 17, 40, 333]
    )
    key_cache, value_cache = key_cache.to(cache_dtype), value_cache.to(cache_dtype)
    out = cpu_ops.paged_decode(query, key_cache, value_cache, tables, lens, 0.125)
    assert out.dtype == torch.float32
    expected = reference_decode(query, key_cache.float(), value_cache.float(), tables, lens, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_kernel_rejects_mismatched_shapes():
    query, key_cache, value_cache, tables, lens = random_case(torch.float32, 4, 2, 8, 4, [5])
    with pytest.raises(RuntimeError, match="head shapes"):
        cpu_ops.paged_decode(query[:, :3], key_cache, value_cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="the query's dtype, or 16 bits or fp8"):
        cpu_ops.paged_decode(query.bfloat16(), key_cache, value_cache, tables, lens, 1.0)
    with pytest.raises(RuntimeError, match="the query's dtype, or 16 bits or fp8"):
        cpu_ops.paged_decode(
            query.bfloat16(), key_cache.half(), value_cache.half(), tables, lens, 1.0
        )
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_ops.paged_decode(query, key_cache, value_cache, tables + 1000, lens, 1.0)
    with pytest.raises(RuntimeError, match="outside its block table"):
        cpu_ops.paged_decode(query, key_cache, value_cache, tables, lens + 100, 1.0)


def test_auto_picks_the_kernel_on_cpu():
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend_name("torch", torch.device("cpu")) == "torch"
    assert get_backend("auto", torch.device("cpu")).name == "cpu"
    assert set(available_backends()) == {"auto", "cpu", "torch", "triton"}


def test_cpu_backend_refuses_other_devices():
    with pytest.raises(ValueError, match="CPU only"):
        get_backend("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash", torch.device("cpu"))


def test_auto_falls_back_to_torch_where_the_kernel_cannot_build(monkeypatch):
    monkeypatch.setattr(
        cpu_ops, "build_result", lambda: BuildResult(("linear",), {"attention": "no compiler"})
    )
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    with pytest.raises(RuntimeError, match="did not build"):
        get_backend("cpu", torch.device("cpu"))
