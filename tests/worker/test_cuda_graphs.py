"""Decode steps on padded static inputs (CUDA graphs on a GPU) give generate's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed on this platform")

from engine.attention import get_backend
from engine.core.engine_core import EngineCore
from engine.factory import _why_not_capturable
from engine.models import build_causal_lm
from engine.worker.cuda_graphs import DecodeGraphs, capture_sizes
from engine.worker.input_batch import InputBatch
from tests.conftest import CUDA, TRITON_DEVICE
from tests.helpers import tiny_core, tiny_llama
from tests.worker.graph_checks import check_greedy, spy_padding


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, *range(8, 65, 8)]
    assert capture_sizes(2000)[-1] == 512
    # vLLM's cudagraph_capture_sizes, and its max_cudagraph_capture_size over the same steps.
    assert capture_sizes(64, (16, 1, 4, 128)) == [1, 4, 16]
    assert capture_sizes(8, (16, 32)) == [8]
    assert capture_sizes(2000, largest=1024) == [1, 2, 4, *range(8, 1025, 8)]
    assert capture_sizes(64, largest=20) == [1, 2, 4, 8, 16, 20]


def eager_triton_core(max_num_seqs: int) -> EngineCore:
    """A core without graphs whose attention runs the Triton kernels (in the interpreter
    without a GPU), for a test to give its own decode graphs."""
    core, _ = tiny_core(
        device=TRITON_DEVICE,
        attention_backend="triton",
        block_size=16,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
    )
    return core


def test_padded_decode_steps_match_generate():
    """Without a GPU the padded static path runs eagerly, through the Triton kernels in the
    interpreter: padded rows (length 0, slot -1) must neither disturb nor leak anything."""
    core = eager_triton_core(7)
    assert core.runner.graphs is None
    runner = core.runner
    runner.graphs = DecodeGraphs(
        runner.model, runner.backend, runner.kv_cache, max_num_seqs=7, max_model_len=512
    )
    sizes = spy_padding(runner.graphs)
    check_greedy(core, 7)
    assert (7, 7) in sizes
    assert any(size > rows for rows, size in sizes)  # some steps were padded
    assert all(size == min(s for s in capture_sizes(7) if s >= rows) for rows, size in sizes)


@pytest.mark.parametrize("device", [CUDA])
def test_cuda_graphs_replay_decode_steps(device):
    core, _ = tiny_core(device=device, max_num_seqs=8)
    graphs = core.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    sizes = spy_padding(graphs)
    check_greedy(core, 6)
    assert {size for _, size in sizes} >= {8, 4}


def test_decode_steps_pad_to_the_chosen_sizes_only():
    """vLLM's `cudagraph_capture_sizes`: batches pad to the next size chosen, and the tokens
    stay generate()'s."""
    core = eager_triton_core(7)
    runner = core.runner
    runner.graphs = DecodeGraphs(
        runner.model, runner.backend, runner.kv_cache, 7, 512, capture_sizes(7, (3, 7))
    )
    sizes = spy_padding(runner.graphs)
    check_greedy(core, 7)
    assert {size for _, size in sizes} == {3, 7}
    assert all(size == (3 if rows <= 3 else 7) for rows, size in sizes)


@pytest.mark.parametrize("device", [CUDA])
def test_chosen_sizes_and_decode_only_graphs_are_captured_as_asked(device):
    core, _ = tiny_core(
        device=device, max_num_seqs=8, cuda_graph_sizes=(2, 8), mixed_step_graphs=False
    )
    graphs = core.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [2, 8]
    assert core.runner.piecewise is None
    check_greedy(core, 6)


@pytest.mark.parametrize("device", [CUDA])
def test_enforce_eager_captures_nothing(device):
    core, _ = tiny_core(device=device, enforce_eager=True)
    assert core.runner.graphs is None and core.runner.piecewise is None
    check_greedy(core, 3)


def batch_of(query_lens: list[int], width: int = 2) -> InputBatch:
    rows, tokens = len(query_lens), sum(query_lens)
    ids = np.zeros(tokens, dtype=np.int64)
    return InputBatch(
        requests=[None] * rows,
        input_ids=ids,
        positions=ids,
        slot_mapping=ids,
        query_starts=np.cumsum([0, *query_lens[:-1]]),
        query_lens=np.array(query_lens),
        context_lens=np.ones(rows, np.int64),
        block_table=np.zeros((rows, width), np.int64),
        sample_rows=np.arange(rows),
    )


def test_only_plain_decode_steps_take_the_static_path():
    core = eager_triton_core(4)
    runner = core.runner
    graphs = DecodeGraphs(runner.model, runner.backend, runner.kv_cache, 4, max_model_len=64)
    assert graphs.supports(batch_of([1, 1, 1]), np.arange(3))
    assert not graphs.supports(batch_of([1, 3]), np.array([0, 3]))  # a prefill chunk
    assert not graphs.supports(batch_of([1] * 5), np.arange(5))  # more rows than captured
    assert not graphs.supports(batch_of([1, 1]), np.array([5, 0, 1]))  # prompt logprobs
    assert not graphs.supports(batch_of([1, 1], width=5), np.arange(2))  # wider than max len


def test_what_cannot_be_captured():
    hf_model = tiny_llama()
    conveyor = build_causal_lm(hf_model, "conveyor")
    device = torch.device(TRITON_DEVICE)
    assert _why_not_capturable(conveyor, get_backend("triton", device)) == ""
    assert "gathers" in _why_not_capturable(conveyor, get_backend("torch", device))
    transformers = build_causal_lm(hf_model, "transformers")
    assert "Hugging Face" in _why_not_capturable(transformers, get_backend("triton", device))
    dynamic = build_causal_lm(
        tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        "conveyor",
    )
    assert "dynamic" in _why_not_capturable(dynamic, get_backend("triton", device))
