"""The start-up line that names each route, and pure torch where no kernel loaded."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.build import GROUPS, BuildResult
from engine.kernels.cpu.linear import pack_linears
from tests.helpers import (
    needs_cpu_kernels,
    needs_panels,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tokens_of,
)
from tests.vision_utils import processor_of, tiny_image_text

CACHED = (cpu_ops.panel_linear_available, cpu_ops.bf16_panels_available)


def route_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "engine.factory" and r.getMessage().startswith("routes: ")
    ]


@pytest.fixture
def no_kernels(monkeypatch):
    """The machine as one where nothing built (an arm64 host, or no compiler)."""
    monkeypatch.setattr(
        cpu_ops,
        "build_result",
        lambda: BuildResult(
            (), {group.name: "they are x86-64 code and this is aarch64" for group in GROUPS}
        ),
    )
    for probe in CACHED:
        probe.cache_clear()
    yield
    for probe in CACHED:
        probe.cache_clear()


@needs_cpu_kernels
def test_one_line_names_every_route(caplog):
    with caplog.at_level(logging.INFO, logger="engine.factory"):
        tiny_core(tiny_llama())
    [line] = route_lines(caplog)
    assert "model implementation conveyor" in line
    assert "dtype float32 (compute float32)" in line and "KV cache float32" in line
    assert "attention cpu" in line
    assert "experts:" not in line  # a dense model
    assert "linear layers: 9 torch (float32)" in line
    assert "decode: op by op (projections not in Conveyor's panels)" in line
    groups = "attention, linear, elementwise, fused_decode, recurrent"
    assert f"CPU kernels: {groups} for -march=" in line
    assert "sampling torch (top-p by topk or histogram, draws by a running sum in" in line
    assert "Conveyor's nucleus kernel, a generator per seeded row)" in line


@needs_panels
def test_the_line_names_packed_panels_and_the_fused_decode(caplog):
    model = tiny_llama()
    pack_linears(model)
    with caplog.at_level(logging.INFO, logger="engine.factory"):
        tiny_core(model)
    [line] = route_lines(caplog)
    assert "linear layers: 9 panels (float32)" in line
    assert "decode: whole stack as one op" in line


def test_nothing_built_serves_greedy_tokens_on_pure_torch(no_kernels, caplog):
    model = tiny_llama()
    with caplog.at_level(logging.INFO, logger="engine.factory"):
        core, _ = tiny_core(model)
    [line] = route_lines(caplog)
    assert "attention torch" in line and "decode: op by op" in line
    assert "linear layers: " in line and "torch (float32)" in line and "panels" not in line
    assert "CPU kernels: none (they are x86-64 code and this is aarch64)" in line
    prompts = [[5, 9, 33, 2], list(range(40, 90))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = run_all(core, prompts, params)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 8)


def test_the_sampler_takes_its_triton_kernels_on_a_gpu_only(device):
    """On a GPU the sampler takes its Triton kernels, which need nothing from the host; on a
    CPU the torch route, whose host check costs nothing there."""
    from engine.factory import _sampling_kernels

    assert _sampling_kernels(torch.device(device)) == (device == "cuda")


@pytest.mark.parametrize(
    ("family", "words"),
    [
        ("llava", ["images: encoder in float32"]),
        ("gemma3", ["each image's tokens attend both ways"]),
        ("qwen3_vl", ["positions on three axes", "encoder rows added after the first"]),
    ],
)
def test_the_line_says_how_an_image_text_model_takes_its_images(caplog, family, words):
    processor = processor_of(family)
    with caplog.at_level(logging.INFO, logger="engine.factory"):
        tiny_core(tiny_image_text(family), tokenizer=processor.tokenizer, processor=processor)
        tiny_core(tiny_llama())
    image_line, text_line = route_lines(caplog)
    assert all(word in image_line for word in words)
    assert "images:" not in text_line


@needs_panels
def test_the_line_says_how_each_layer_of_experts_runs(caplog):
    """Experts in Conveyor's panels run as one op a layer; in torch's linear layers, expert by
    expert."""
    from tests.kernels.test_decode_experts import in_panels, tiny_moe

    with caplog.at_level(logging.INFO, logger="engine.factory"):
        tiny_core(in_panels(tiny_moe("mixtral")))
        tiny_core(tiny_moe("mixtral"))
    grouped, looped = route_lines(caplog)
    assert "; experts: 3 layers one op (panels over fp32 rows);" in grouped
    assert "; experts: 3 layers expert by expert;" in looped
