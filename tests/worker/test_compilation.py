"""`--compile`: what each layer does between attention calls runs through torch.compile, compiled
at start-up only, and computes what the eager layers compute."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu.linear import convert_linears, pack_linears
from engine.models.llama import PagedLlamaForCausalLM
from engine.worker import compilation
from engine.worker.compilation import compile_layers, is_compiled, why_not_compiled
from tests.helpers import (
    needs_bf16_panels,
    needs_panels,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tokens_of,
)
from tests.models.test_model_families import build as build_family

# Inductor writes C++ for a CPU, and builds it with the compiler Conveyor's kernels use.
pytestmark = pytest.mark.skipif(
    cpu_build.compiler() is None, reason="no C++ compiler for inductor's CPU code"
)

# Short and long prompts: with 24 tokens a step, the long ones are prefilled in chunks beside
# other rows' decode steps.
PROMPTS = [[5, 9, 33, 2], list(range(40, 100)), [7] * 13, list(range(200, 237))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def route_line(caplog: pytest.LogCaptureFixture) -> str:
    [line] = [
        r.getMessage()
        for r in caplog.records
        if r.name == "engine.factory" and r.getMessage().startswith("routes: ")
    ]
    return line


def test_compiled_layers_give_transformers_greedy_tokens(device, caplog):
    """Mixed steps of prompt chunks and decode rows, compiled once at start-up: serving adds
    no graph (every shape a step brings was compiled), and the tokens are transformers'."""
    model = tiny_llama().to(device)
    with caplog.at_level(logging.INFO, logger="engine.factory"):
        core, _ = tiny_core(model, device=device, compile=True, max_num_batched_tokens=24)
    runner_model = core.runner.model
    assert isinstance(runner_model, PagedLlamaForCausalLM)
    assert all(is_compiled(layer) for layer in runner_model.layers)
    assert "layers torch.compile (inductor) between attention calls" in route_line(caplog)
    graphs = compiled_graphs()
    outputs = run_all(core, PROMPTS, GREEDY)
    assert compiled_graphs() == graphs
    for i, prompt in enumerate(PROMPTS):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 10)


def test_eager_layers_by_default():
    core, _ = tiny_core(tiny_llama())
    assert not any(is_compiled(layer) for layer in core.runner.model.layers)


@pytest.mark.parametrize(
    "weights",
    [
        pytest.param("fp32", marks=needs_panels),
        pytest.param("bf16", marks=needs_bf16_panels),
        pytest.param("qwen3", marks=needs_panels),
    ],
)
def test_compiled_pieces_run_conveyors_kernels_as_the_eager_ones_do(weights):
    """Over Conveyor's panels (the C++ products, norms and rotary traced as opaque ops; qwen3:
    each q and k head's norm too) the compiled layers give the eager layers' logits to the bit,
    at each step."""
    model = tiny_llama() if weights != "qwen3" else build_family("qwen3")
    if weights != "bf16":
        pack_linears(model)
    else:
        convert_linears(model, torch.bfloat16)
    eager, _ = tiny_core(copy.deepcopy(model), max_num_batched_tokens=24)
    counters["graph_break"].clear()
    compiled, _ = tiny_core(copy.deepcopy(model), max_num_batched_tokens=24, compile=True)
    assert all(is_compiled(layer) for layer in compiled.runner.model.layers)
    with torch.inference_mode():  # as the steps run
        hidden = torch.randn(7, 64)
        cos, sin = compiled.runner.model.rotary(hidden, torch.arange(7))
        pairs = zip(compiled.runner.model.layers, eager.runner.model.layers, strict=True)
        for ours, theirs in pairs:
            mine, other = ours.project_qkv(hidden, cos, sin), theirs.project_qkv(hidden, cos, sin)
            assert all(torch.equal(a, b) for a, b in zip(mine, other, strict=True))
            out = torch.randn(7, ours.num_heads, ours.head_dim)
            assert torch.equal(
                ours.after_attention(out, hidden), theirs.after_attention(out, hidden)
            )
    assert not counters["graph_break"], "every op traced whole (each with its fake)"
    outputs = [run_all(core, PROMPTS, GREEDY) for core in (eager, compiled)]
    for i in range(len(PROMPTS)):
        assert tokens_of(outputs[1][f"req-{i}"]) == tokens_of(outputs[0][f"req-{i}"])


def test_a_failed_compile_leaves_the_layers_eager(monkeypatch, caplog):
    """Where inductor cannot build (no working compiler, an op it cannot trace) the engine
    still starts, eager, and says why once."""

    def broken(fn):
        def run(*args, **kwargs):
            raise RuntimeError("inductor: the C++ compiler failed\nmore detail")

        return run

    monkeypatch.setattr(compilation.torch, "compile", broken)
    model = tiny_llama()
    with caplog.at_level(logging.INFO):
        core, _ = tiny_core(model, compile=True)
    assert not any(is_compiled(layer) for layer in core.runner.model.layers)
    line = route_line(caplog)
    assert "layers off (compiling failed: inductor: the C++ compiler failed)" in line
    warned = [
        r for r in caplog.records if r.levelno == logging.WARNING and "--compile" in r.getMessage()
    ]
    assert len(warned) == 1
    outputs = run_all(core, PROMPTS[:2], GREEDY)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 10)


def test_what_is_not_compiled_says_why():
    class Plain(torch.nn.Module):
        pass

    assert why_not_compiled(Plain()) == "the Hugging Face model implementation is not compiled"
    model = PagedLlamaForCausalLM(tiny_llama())
    assert why_not_compiled(model) == ""
    model.shard = object()  # type: ignore[assignment]
    assert why_not_compiled(model) == "steps across tensor-parallel ranks are not compiled"
    assert compile_layers(model) == "off (steps across tensor-parallel ranks are not compiled)"


def test_a_recurrent_model_is_not_compiled_and_says_why():
    from engine.models import build_causal_lm
    from tests.models.test_lfm2 import build

    model = build_causal_lm(build(), "conveyor")
    reason = "layers that keep recurrent states (LFM2's, Qwen3.5's) are not compiled"
    assert why_not_compiled(model) == reason
    assert compile_layers(model) == f"off ({reason})"


def test_the_flag_reaches_the_engine():
    from server.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["serve", "--compile"])).compile
    assert not engine_config(build_parser().parse_args(["serve"])).compile
