"""Steps with prompt chunks run piece by piece around attention over padded static buffers
(CUDA graphs on a GPU) and give generate's greedy tokens."""

from __future__ import annotations

import pytest

from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.piecewise_graphs import PiecewiseGraphs, bucket_sizes
from tests.conftest import CUDA, TRITON_DEVICE, needs_triton
from tests.helpers import tiny_core
from tests.worker.graph_checks import check_greedy, spy_padding


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(20) == [8, 16, 20]
    assert bucket_sizes(64) == [8, 16, 32, 64]
    assert bucket_sizes(2048) == [8, 16, 32, 64, 128, 256, 512]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_padded_pieces_match_generate_with_chunks_and_preemption(backend):
    """Without a GPU the pieces run eagerly over the padded buffers, attention between them
    on the real tokens only: padded rows must neither disturb nor leak anything."""
    core, _ = tiny_core(
        attention_backend=backend,
        num_blocks=28,
        max_model_len=64,
        max_num_batched_tokens=24,
    )
    runner = core.runner
    runner.piecewise = PiecewiseGraphs(runner.model, max_tokens=24)
    buckets = spy_padding(runner.piecewise)
    check_greedy(core, 8)
    assert core.scheduler.num_preemptions > 0
    assert any(size > tokens for tokens, size in buckets)  # some steps were padded
    assert any(tokens > 8 for tokens, _ in buckets)  # and some carried prompt chunks
    assert all(size == min(s for s in bucket_sizes(24) if s >= n) for n, size in buckets)


def test_steps_past_the_largest_bucket_run_eagerly():
    core, _ = tiny_core(max_num_batched_tokens=256)
    runner = core.runner
    runner.piecewise = PiecewiseGraphs(runner.model, max_tokens=16)
    buckets = spy_padding(runner.piecewise)
    check_greedy(core, 6)
    assert buckets and all(tokens <= 16 for tokens, _ in buckets)


@needs_triton
def test_pieces_and_decode_graphs_together_with_async_scheduling():
    """The Triton backend (interpreted without a GPU), decode steps through the decode graphs'
    padded path, the others through the pieces, steps overlapped."""
    core, _ = tiny_core(
        device=TRITON_DEVICE,
        attention_backend="triton",
        block_size=16,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        enforce_eager=True,
        async_scheduling=True,
    )
    runner = core.runner
    runner.graphs = DecodeGraphs(
        runner.model, runner.backend, runner.kv_cache, max_num_seqs=6, max_model_len=512
    )
    runner.piecewise = PiecewiseGraphs(runner.model, max_tokens=32)
    buckets = spy_padding(runner.piecewise)
    check_greedy(core, 6)
    assert buckets and all(tokens > 1 or size == 8 for tokens, size in buckets)


@pytest.mark.parametrize("device", [CUDA])
def test_captured_pieces_match_generate(device):
    core, _ = tiny_core(device=device, max_num_seqs=8, max_num_batched_tokens=64)
    piecewise = core.runner.piecewise
    assert piecewise is not None and sorted(piecewise.graphs) == [8, 16, 32, 64]
    buckets = spy_padding(piecewise)
    check_greedy(core, 8)
    assert any(tokens > 8 for tokens, _ in buckets)
