"""Attention beyond plain causal attention, as Hugging Face's models compute it: sliding
windows (Mistral, Qwen2's sliding layers, Gemma 2, gpt-oss), soft-capped scores (Gemma 2) and
sinks (gpt-oss). The C++ kernels and the torch backend compute them all, the Triton kernels
windows, over the whole context; greedy tokens equal transformers' `generate`."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    MistralConfig,
    Qwen2Config,
)

from engine.attention import resolve_backend_name
from engine.core.sampling_params import SamplingParams
from engine.factory import _why_not_capturable
from engine.kernels.cpu import ops as cpu_ops
from engine.models.experts import SPARSE_ON_HOST
from engine.models.llama import PagedLlamaForCausalLM
from tests.conftest import TRITON_DEVICE, needs_triton
from tests.core.test_engine_greedy import record_chunking
from tests.helpers import reference_greedy, run_all, tiny_core, tokens_of
from tests.models.test_model_families import COMMON

needs_kernels = pytest.mark.skipif(
    not cpu_ops.has("attention"), reason="Conveyor's C++ kernels do not build on this machine"
)

WINDOW = 6
MODELS = {
    # Conveyor's decoder, every layer windowed.
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=WINDOW),
    # Conveyor's decoder, the first layer full and the second windowed.
    "qwen2": lambda: Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    # Gemma's layer: soft-capped scores, windowed and full layers in turn.
    "gemma2": lambda: Gemma2Config(
        **{**COMMON, "initializer_range": 0.05},  # wider, and its scaled embeddings saturate
        head_dim=16,
        sliding_window=WINDOW,
        attn_logit_softcapping=1.0,
        query_pre_attn_scalar=4,
    ),
    # Gemma's layer: windowed and full layers (every sixth full), per-head q/k norms.
    "gemma3": lambda: Gemma3TextConfig(
        **{**COMMON, "initializer_range": 0.05, "num_hidden_layers": 3},
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # gpt-oss's layer: sinks, windowed and full layers in turn, experts.
    "gpt-oss": lambda: GptOssConfig(
        **{**COMMON, "intermediate_size": 32},
        head_dim=16,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
}
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def build(name: str, **overrides: object):
    torch.manual_seed(0)
    config = MODELS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith("sinks"):  # initialised to zero: make them count
                parameter.normal_(0, 2.0)
    return model


def prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 9, 17, 30, 24)]


def engine_tokens(model, **options: object) -> tuple[list[list[int]], object]:
    core, info = tiny_core(model, **options)
    outputs = run_all(core, prompts(), GREEDY)
    assert core.scheduler.block_manager.num_used_blocks == 0
    return [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))], (core, info)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_matches_generate_past_the_window(name):
    model = build(name)
    expected = [reference_greedy(model, p, MAX_NEW, attention="eager") for p in prompts()]
    tokens, (core, info) = engine_tokens(model, num_blocks=64, max_num_batched_tokens=64)
    assert tokens == expected
    # The whole context is served, on the usual backend: the C++ kernels take every feature.
    assert info.max_model_len == 256
    assert core.runner.backend.name == resolve_backend_name("auto", torch.device("cpu"))
    # Conveyor's decoder runs each of them; transformers' model, asked for, attends alike.
    assert isinstance(core.runner.model, PagedLlamaForCausalLM)
    tokens, (core, _) = engine_tokens(
        model, num_blocks=64, max_num_batched_tokens=64, model_impl="transformers"
    )
    assert tokens == expected
    assert not isinstance(core.runner.model, PagedLlamaForCausalLM)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma2", "gpt-oss"])
def test_the_torch_backend_computes_the_features_as_the_kernels_do(name):
    model = build(name)
    expected = [reference_greedy(model, p, MAX_NEW, attention="eager") for p in prompts()]
    tokens, (core, _) = engine_tokens(model, attention_backend="torch")
    assert core.runner.backend.name == "torch" and tokens == expected


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3", "gpt-oss"])
def test_windows_hold_under_chunked_prefill_prefix_hits_and_preemption(name):
    model = build(name)
    shared = list(range(40, 60))
    cases = [[*shared, 7, 8], [*shared, 9], *prompts()[:3]]
    expected = [reference_greedy(model, p, MAX_NEW, attention="eager") for p in cases]
    core, _ = tiny_core(model, num_blocks=18, max_model_len=64, max_num_batched_tokens=8)
    chunked = record_chunking(core)
    outputs = run_all(core, cases, GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(cases))] == expected
    assert any(chunked)
    assert core.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    ("name", "plain"),
    [
        ("mistral", {"sliding_window": None}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma3", {"sliding_window": 200}),  # wider than every prompt here
    ],
)
def test_the_features_change_the_tokens(name, plain):
    """The oracle sees them: without the window (or the cap) the same weights answer
    otherwise."""
    featured, _ = engine_tokens(build(name))
    without, _ = engine_tokens(build(name, **plain))
    assert featured != without


@pytest.mark.parametrize("name", ["qwen2", "gpt-oss"])
def test_the_triton_kernels_compute_windows_and_sinks_as_transformers(name):
    """On the GPU where there is one, else in Triton's interpreter: decode rows and prompt
    chunks past the window, with gpt-oss's sinks."""
    pytest.importorskip("triton", reason="triton is not installed on this platform")
    model = build(name).to(TRITON_DEVICE)
    cases = prompts()[:3]
    expected = [reference_greedy(model, p, 6, attention="eager") for p in cases]
    core, _ = tiny_core(
        model, attention_backend="triton", device=TRITON_DEVICE, max_num_batched_tokens=8
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = run_all(core, cases, params)
    assert core.runner.backend.name == "triton"
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(cases))] == expected
    # On CUDA such steps run eagerly: no graph holds a windowed layer (nor experts).
    reason = _why_not_capturable(core.runner.model, core.runner.backend)
    windows = "sliding-window layers are not captured"
    assert reason == (SPARSE_ON_HOST if name == "gpt-oss" else windows)


@needs_triton
def test_a_backend_that_cannot_compute_them_is_refused_with_the_reason():
    """The Triton kernels take windows and sinks, not soft caps."""
    with pytest.raises(ValueError, match=r"soft-capped attention scores.*--attention-backend"):
        tiny_core(build("gemma2"), attention_backend="triton", device=TRITON_DEVICE)


@needs_kernels
@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_the_cpu_kernels_decode_capped_and_sunk_layers(name):
    """Decode rows of such layers go through the C++ kernel (prompt chunks the torch path)."""
    model = build(name)
    core, _ = tiny_core(model, attention_backend="cpu")
    calls = []
    kernel = cpu_ops.paged_decode

    def counted(*args, **kwargs):
        calls.append(kwargs.get("softcap", args[7] if len(args) > 7 else 0.0))
        return kernel(*args, **kwargs)

    cpu_ops.paged_decode = counted
    try:
        outputs = run_all(core, prompts()[:2], GREEDY)
    finally:
        cpu_ops.paged_decode = kernel
    expected = [reference_greedy(model, p, MAX_NEW, attention="eager") for p in prompts()[:2]]
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(2)] == expected
    assert calls and (name != "gemma2" or all(cap == 1.0 for cap in calls))


def test_sinks_change_the_tokens():
    with_sinks = build("gpt-oss")
    without = build("gpt-oss")
    with torch.no_grad():
        for name, parameter in without.named_parameters():
            if name.endswith("sinks"):
                parameter.fill_(-30.0)  # exp(-30): as if there were none
    assert engine_tokens(with_sinks)[0] != engine_tokens(without)[0]
    expected = [reference_greedy(without, p, MAX_NEW, attention="eager") for p in prompts()]
    assert engine_tokens(without)[0] == expected


def test_the_routes_line_names_the_features(caplog):
    with caplog.at_level(logging.INFO, logger="engine.factory"):
        tiny_core(build("gemma2"))
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("routes: ")]
    usual = resolve_backend_name("auto", torch.device("cpu"))
    assert f"attention {usual} (sliding window of 6 tokens, soft-capped attention scores)" in line


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemmas_prompt_logprobs_equal_transformers(name):
    """Finer than greedy tokens: every prompt token's logprob as transformers scores it. The
    config also names a `hidden_act` of silu, as a config converted from another family may;
    Gemma's MLP runs GELU whatever it says, and so does Conveyor's layer."""
    model = build(name, hidden_act="silu")
    prompt = prompts()[3]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    core, _ = tiny_core(model, num_blocks=64, max_num_batched_tokens=8)
    assert isinstance(core.runner.model, PagedLlamaForCausalLM)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    outputs = run_all(core, [prompt], params)
    entries = [e for o in outputs["req-0"] for e in (o.prompt_logprobs or [])]
    got = torch.tensor([e.logprob for e in entries[1:]])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_lora_adapters_over_gemma_score_as_peft_merged_models(tmp_path):
    """An adapter of every projection, written by PEFT: each prompt token's logprob under it
    as PEFT's merged model scores it (the adapter's deltas go through Gemma's own layer)."""
    pytest.importorskip("peft", reason="peft is not installed on this host")
    from tests.lora.adapters import ATTENTION, MLP, merged, save_adapter

    path = save_adapter(tmp_path / "adapter", ATTENTION + MLP, seed=5, base=lambda: build("gemma3"))
    prompt = prompts()[3]
    with torch.no_grad():
        logits = merged(path, build("gemma3"))(torch.tensor([prompt])).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1)
    core, _ = tiny_core(
        build("gemma3"),
        enable_lora=True,
        lora_modules=(("adapter", path),),
        max_num_batched_tokens=8,
    )
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    core.add_request("r", prompt, params, lora=core.loras.get("adapter"))
    entries = []
    while core.has_unfinished():
        for output in core.step():
            entries += output.prompt_logprobs or []
    got = torch.tensor([e.logprob for e in entries[1:]])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
