"""gpt-oss on Conveyor's decoder: sinks, biases, sliding and full layers in turn, a router that
softmaxes its top-k logits and experts with a clamped SwiGLU; greedy tokens and prompt logprobs
equal transformers' (eager attention, which computes the sinks)."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import PanelLinear
from engine.kernels.cpu.ops import panel_linear_available
from engine.loading import gguf_blocks, model_loader
from engine.loading.gguf_blocks import MXFP4
from engine.loading.model_loader import (
    PANEL_FORMS,
    LinearForm,
    choose_linear_form,
    load_weights,
    use_linear_form,
)
from engine.loading.mxfp4_experts import gguf_rows
from engine.loading.quantized_checkpoint import check_requested
from engine.models.experts import ExpertLinears, SparseMoE
from engine.models.gpt_oss import PagedGptOssForCausalLM
from engine.models.layers import rms_norm, scaled_in_fp32
from tests.core.test_engine_greedy import record_chunking
from tests.helpers import (
    chat_tokenizer,
    needs_bf16_panels,
    needs_panels,
    reference_greedy,
    run_all,
    tiny_core,
    tokens_of,
)
from tests.models.test_model_families import COMMON

LIMIT = 2.0  # low enough that the tiny model's gates and ups reach it
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def config() -> GptOssConfig:
    return GptOssConfig(
        **{**COMMON, "intermediate_size": 32, "num_hidden_layers": 3},
        head_dim=16,
        sliding_window=6,
        num_local_experts=8,
        num_experts_per_tok=2,
        swiglu_limit=LIMIT,
    )


def build(dtype: torch.dtype = torch.float32):
    """A tiny gpt-oss whose sinks and biases (zero as initialised) count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.normal_(0, 2.0)
            elif "bias" in name:
                parameter.normal_(0, 0.2)
    return model.to(dtype)


def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 9, 17, 30, 1, 24)]


def expected_tokens(model) -> list[list[int]]:
    return [reference_greedy(model, p, MAX_NEW, attention="eager") for p in prompts()]


def engine_tokens(model, **options: object) -> tuple[list[list[int]], object]:
    core, _ = tiny_core(model, **options)
    outputs = run_all(core, prompts(), GREEDY)
    assert core.scheduler.block_manager.num_used_blocks == 0
    return [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))], core


def test_greedy_matches_generate_under_chunking_and_preemption(device):
    model = build().to(device)
    expected = expected_tokens(model)
    core, _ = tiny_core(
        model, num_blocks=24, max_model_len=64, max_num_batched_tokens=10, device=device
    )
    chunked = record_chunking(core)
    outputs = run_all(core, prompts(), GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    assert core.scheduler.num_preemptions > 0 and any(chunked)
    paged = core.runner.model
    assert isinstance(paged, PagedGptOssForCausalLM) and paged.sparse
    assert [layer.attention.window for layer in paged.layers] == [6, None, 6]
    assert all(layer.attention.sinks is not None for layer in paged.layers)
    # The tiny model's projections are torch's here (the fused decode with sinks:
    # tests/kernels/test_decode_experts.py).
    assert paged.fused_decode.describe() == "op by op (projections not in Conveyor's panels)"


def test_prompt_logprobs_equal_transformers_and_each_part_counts():
    """Finer than greedy tokens; and the same weights with a part left out (the sinks, the
    clamp, the router's bias) score otherwise, so each part is exercised."""
    model = build()
    prompt = prompts()[3]
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    index = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    core, _ = tiny_core(model, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)

    def scored() -> torch.Tensor:
        request = f"r{scored.calls}"
        scored.calls += 1
        core.add_request(request, prompt, params)
        entries = []
        while core.has_unfinished():
            for output in core.step():
                entries.extend(output.prompt_logprobs or [])
        return torch.tensor([e.logprob for e in entries[1:]])

    scored.calls = 0
    torch.testing.assert_close(scored(), expected[index], atol=1e-4, rtol=1e-4)
    layers = core.runner.model.layers
    features = [layer.attention for layer in layers]
    for layer in layers:
        layer.attention = replace(layer.attention, sinks=None)
    assert (scored() - expected[index]).abs().max() > 1e-2, "the sinks count"
    for layer, feature in zip(layers, features, strict=True):
        layer.attention = feature
    for layer in layers:
        layer.moe.experts.clamped.limit = 1e6
    assert (scored() - expected[index]).abs().max() > 1e-2, "the clamp counts"
    biases = [layer.moe.router_bias for layer in layers]
    for layer in layers:
        layer.moe.experts.clamped.limit = LIMIT
        layer.moe.router_bias = None
    assert (scored() - expected[index]).abs().max() > 1e-2, "the router's bias counts"
    for layer, bias in zip(layers, biases, strict=True):
        layer.moe.router_bias = bias
    torch.testing.assert_close(scored(), expected[index], atol=1e-4, rtol=1e-4)


def test_the_block_computes_what_transformers_block_computes():
    model = build()
    torch.manual_seed(1)
    x = torch.randn(11, COMMON["hidden_size"])
    block = model.model.layers[0].mlp
    ours = SparseMoE(block)
    with torch.inference_mode():
        theirs, _ = block(x[None])  # and the router's scores
        torch.testing.assert_close(ours(x), theirs[0], rtol=1e-6, atol=1e-6)
        weights, experts = ours.route(x)
        gate_up = torch.cat([linear(x) for linear in ours.experts.gate_up])
    assert experts.shape == (11, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(11))
    # The tiny model's gates and ups reach the limit, where the clamp acts.
    assert float(gate_up.abs().max()) > LIMIT
    # gpt-oss's experts are copied once into Conveyor's layout, biases and all.
    assert isinstance(ours.experts, ExpertLinears) and ours.experts.num_experts == 8
    assert ours.experts.gate_up[0].bias is not None and ours.experts.down[0].bias is not None


def test_its_norm_scales_16_bit_rows_in_fp32_as_transformers_does():
    torch.manual_seed(2)
    norm = GptOssRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = torch.randn(32, 64).to(torch.bfloat16)
    ours = scaled_in_fp32(x, norm.weight, norm.variance_epsilon)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, norm(x))
    # The Llama norm rounds before it scales: other bits, so the difference is real.
    llama = rms_norm(x, norm.weight.to(torch.bfloat16), norm.variance_epsilon)
    assert not torch.equal(llama, ours)


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(LinearForm.FP32_PANELS, marks=needs_panels),
        pytest.param(LinearForm.BF16_PANELS, marks=needs_bf16_panels),
    ],
)
def test_experts_take_the_models_linear_form_with_their_biases(form):
    dtype = torch.bfloat16 if form is LinearForm.BF16_PANELS else torch.float32
    model = build(dtype)
    use_linear_form(model, form)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertLinears)
    assert all(isinstance(m, PanelLinear) for m in [*experts.gate_up, *experts.down])
    expected = expected_tokens(model)
    tokens, core = engine_tokens(model)
    assert isinstance(core.runner.model, PagedGptOssForCausalLM)
    assert tokens == expected
    # transformers' own model runs over the same experts.
    tokens, core = engine_tokens(model, model_impl="transformers")
    assert not isinstance(core.runner.model, PagedGptOssForCausalLM)
    assert tokens == expected


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    model = build()
    expected = expected_tokens(model)
    build().save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    engine_config = EngineConfig(
        model=str(tmp_path), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=128)
    )
    core, loaded, _ = create_engine_core(engine_config)
    try:
        assert isinstance(core.runner.model, PagedGptOssForCausalLM)
        # The loaded 3-d expert tensors were swapped for Conveyor's layout, not kept beside it.
        assert isinstance(loaded.model.model.layers[0].mlp.experts, ExpertLinears)
        outputs = run_all(core, prompts(), GREEDY)
        assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    finally:
        core.close()


# MXFP4's 4-bit values (E2M1), by code: the low nibble of a byte holds the first of two.
FP4_VALUES = torch.tensor(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32
)


def mxfp4_weight(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`[experts, out, in]` from MXFP4 blocks `[experts, out, in / 32, 16]` (two codes a byte)
    and their E8M0 scales `[experts, out, in / 32]`, decoded here by the format's definition."""
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).long()
    values = FP4_VALUES[codes].flatten(-2) * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2)


def save_mxfp4(folder: Path) -> torch.nn.Module:
    """A tiny gpt-oss saved as published (experts in MXFP4 blocks, the rest bf16); returns the
    fp32 model it stands for, experts decoded by `mxfp4_weight`."""
    model = build(torch.bfloat16)
    model.save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    reference = model.float()
    generator = torch.Generator().manual_seed(5)
    inter, hidden = reference.config.intermediate_size, reference.config.hidden_size
    for i, layer in enumerate(reference.model.layers):
        for name, (rows, columns) in {
            "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter),
        }.items():
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            shape = (8, rows, columns // 32)
            blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.uint8)
            scales = torch.randint(122, 126, shape, generator=generator, dtype=torch.uint8)
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
            weight = mxfp4_weight(blocks, scales).transpose(1, 2)  # transformers' `x @ W`
            getattr(layer.mlp.experts, name).data = weight.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return reference


def test_an_mxfp4_checkpoint_serves_its_experts_from_their_blocks(tmp_path):
    """gpt-oss as published, in fp32 on a CPU whose panel kernel runs: each expert's layer holds
    the checkpoint's MXFP4 blocks (no fp32 weight of the experts, no converted copy, no kernel
    fetched), and greedy tokens equal transformers' on the weights the blocks stand for."""
    reference = save_mxfp4(tmp_path)
    expected = expected_tokens(reference)
    check_requested(str(tmp_path), "mxfp4")  # vLLM's flag names the checkpoint's method
    with pytest.raises(ValueError, match=r"\(mxfp4\)"):
        check_requested(str(tmp_path), "awq")
    engine_config = EngineConfig(
        model=str(tmp_path), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=128)
    )
    core, _, _ = create_engine_core(engine_config)
    try:
        assert isinstance(core.runner.model, PagedGptOssForCausalLM)
        held = [
            m
            for m in core.runner.model.modules()
            if isinstance(m, PanelLinear) and m.block_format is gguf_blocks.MXFP4
        ]
        experts = config().num_hidden_layers * config().num_local_experts
        assert len(held) == (2 * experts if panel_linear_available() else 0)
        outputs = run_all(core, prompts(), GREEDY)
        assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    finally:
        core.close()
    assert expected != expected_tokens(build()), "the blocks' weights are the ones served"


def held_experts(model: torch.nn.Module) -> list[PanelLinear]:
    return [m for m in model.modules() if isinstance(m, PanelLinear) and m.block_format is MXFP4]


def test_a_16_bit_model_holds_its_mxfp4_experts_as_blocks(tmp_path):
    """Served in bf16 or fp16 where Conveyor's panels run, the checkpoint's experts stay in its
    MXFP4 blocks beside the 16-bit panels of the other layers, 17 bytes a 32 weights. Beside
    fp16 panels they multiply the fp32 activations exactly as in an fp32 model; beside bf16
    panels, as bf16 panels of the same weights multiply (to the bit)."""
    save_mxfp4(tmp_path)
    cpu = torch.device("cpu")
    full = load_weights(str(tmp_path), torch.float32, cpu)[0].model.layers[0].mlp.experts
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(5, config().hidden_size, generator=generator)
    chosen = torch.randint(0, config().num_local_experts, (5, 2), generator=generator)
    weights = torch.rand(5, 2, generator=generator)
    for dtype in (torch.bfloat16, torch.float16):
        model = load_weights(str(tmp_path), dtype, cpu)[0]
        held = held_experts(model)
        form = choose_linear_form(dtype, cpu)
        if form not in PANEL_FORMS or not panel_linear_available():
            assert not held  # torch's own products: dequantized to `dtype` as the model loads
            continue
        assert len(held) == 2 * config().num_hidden_layers * config().num_local_experts
        weight_count = sum(m.out_features * m.in_features for m in held)
        assert sum(m.panels.numel() for m in held) < weight_count * 17 / 32 * 1.1
        attention = model.model.layers[0].self_attn.q_proj
        assert isinstance(attention, PanelLinear) and attention.panels.dtype == dtype
        in_bf16 = form is LinearForm.BF16_PANELS
        assert all(m.bf16_blocks is in_bf16 for m in held)
        experts = model.model.layers[0].mlp.experts
        reference = full
        if in_bf16:  # the same weights in bf16 panels, multiplied in dot products as these
            reference = copy.deepcopy(full)
            for layers in (reference.gate_up, reference.down):
                for i, layer in enumerate(layers):
                    layers[i] = PanelLinear(layer.weight, layer.bias, torch.bfloat16)
        before = cpu_ops.use_bf16_tiles(False)
        try:
            with torch.inference_mode():
                expected = reference(x, chosen, weights)
                torch.testing.assert_close(experts(x, chosen, weights), expected, rtol=0, atol=0)
        finally:
            cpu_ops.use_bf16_tiles(before)


@needs_bf16_panels
def test_a_bf16_model_over_mxfp4_experts_serves_its_dequantized_experts_tokens(
    tmp_path, monkeypatch
):
    """In bf16 on a CPU with AVX-512 BF16, the experts held as MXFP4 blocks give the greedy
    tokens of the same model with its experts dequantized into bf16 panels (both in dot
    products: AMX tiles round apart in the last bits)."""
    save_mxfp4(tmp_path)
    engine_config = EngineConfig(
        model=str(tmp_path), dtype="bfloat16", cache=CacheConfig(block_size=4, num_blocks=128)
    )
    before = cpu_ops.use_bf16_tiles(False)
    tokens = {}
    try:
        for held in (True, False):
            monkeypatch.setattr(model_loader, "is_mxfp4", lambda path, held=held: held)
            core, _, _ = create_engine_core(engine_config)
            try:
                assert bool(held_experts(core.runner.model)) is held
                outputs = run_all(core, prompts(), GREEDY)
                tokens[held] = [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))]
            finally:
                core.close()
    finally:
        cpu_ops.use_bf16_tiles(before)
    assert tokens[True] == tokens[False]


@needs_panels
def test_an_fp16_model_over_mxfp4_experts_serves_transformers_tokens(tmp_path):
    """In fp16 (16-bit panels computing in fp32, which hold every bf16 weight exactly) greedy
    tokens equal transformers' in fp32 on the weights the checkpoint stands for."""
    if choose_linear_form(torch.float16, torch.device("cpu")) is LinearForm.TORCH:
        pytest.skip("this CPU multiplies fp16 natively (AVX-512 FP16): torch's own products")
    expected = expected_tokens(save_mxfp4(tmp_path))
    engine_config = EngineConfig(
        model=str(tmp_path), dtype="float16", cache=CacheConfig(block_size=4, num_blocks=128)
    )
    core, _, info = create_engine_core(engine_config)
    try:
        assert info.dtype == "float16" and held_experts(core.runner.model)
        outputs = run_all(core, prompts(), GREEDY)
        assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    finally:
        core.close()


def test_mxfp4_blocks_become_gguf_rows_of_the_same_values():
    """A checkpoint's blocks (two codes a byte, in input order) as GGUF's MXFP4 rows (a block's
    first 16 inputs in the low halves): they widen to the values the format defines, every
    code under scales either side of 1."""
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 24, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(100, 150, (2, 24, 4), generator=generator, dtype=torch.uint8)
    rows = gguf_rows(blocks, scales)
    assert rows.shape == (2, 24, 4 * gguf_blocks.MXFP4.block_bytes)
    for expert in range(2):
        widened = gguf_blocks.dequantize_rows(gguf_blocks.MXFP4, rows[expert])
        assert torch.equal(widened, mxfp4_weight(blocks, scales)[expert])


def test_two_ranks_serve_an_mxfp4_checkpoint_dequantized(tmp_path):
    """Each rank of two cuts its share from the model loaded with its experts' blocks
    dequantized (the checkpoint holds no plain tensor of them to slice)."""
    expected = expected_tokens(save_mxfp4(tmp_path))
    engine_config = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        tensor_parallel_size=2,
        cache=CacheConfig(block_size=4, num_blocks=128),
    )
    core, _, _ = create_engine_core(engine_config)
    try:
        experts = core.runner.model.layers[0].moe.inner.experts
        assert experts.intermediate == config().intermediate_size // 2
        outputs = run_all(core, prompts(), GREEDY)
        assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    finally:
        core.close()
