"""The fused CPU decode layer (`csrc/fused_decode/decode_layer.cpp`): a step of decode rows through
one op per layer equals the layer op by op, to the bit, and the greedy oracle holds through it."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM, MistralConfig

from engine.attention.backend import LayerAttention
from engine.attention.cpu_paged import CpuPagedAttention
from engine.core.sampling_params import SamplingParams
from engine.factory import cache_dtype_named
from engine.kernels.cpu import fused_decode
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.fused_decode import DecodeRoute, FusedDecode
from engine.kernels.cpu.linear import GatedPanelLinear, convert_linears, pack_linears
from engine.models import build_causal_lm
from engine.models.gemma import PagedGemmaForCausalLM
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.worker.input_batch import build_input_batch
from tests.helpers import (
    needs_bf16_panels,
    needs_panels,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tokens_of,
)
from tests.kernels.test_cpu_small_ops import reference_head_norm as reference_norm
from tests.models.test_attention_features import build as build_windowed
from tests.models.test_model_families import COMMON as FAMILY_COMMON
from tests.models.test_model_families import build as build_family

pytestmark = needs_panels

PROMPTS = [[5, 9, 33, 2], list(range(40, 120)), [7] * 13, list(range(200, 223))]


def packed(model: LlamaForCausalLM, weights: str = "fp32") -> LlamaForCausalLM:
    """The model as Conveyor serves it on this CPU: fp32, fp16 or bf16 panels."""
    if weights == "fp32":
        pack_linears(model)
    else:
        convert_linears(model, torch.bfloat16 if weights == "bf16" else torch.float16)
    return model


def stack_of(model: LlamaForCausalLM) -> FusedDecode:
    """The fused decode Conveyor's model chooses for `model`: the whole stack as one op."""
    paged = build_causal_lm(model)
    assert isinstance(paged, PagedLlamaForCausalLM)
    fused = paged.fused_decode
    assert fused.route is DecodeRoute.STACK, fused.describe()
    return fused


def stack_args(
    fused: FusedDecode,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]]:
    """The stack's weights, biases and heads, as `decode_layers` takes them."""
    return list(fused.weights), list(fused.biases), fused.layers[0].heads


def build(family: str) -> LlamaForCausalLM:
    """A tiny model of the family: Gemma's with windows on some layers (`test_attention_features`),
    the others as `test_model_families` builds them."""
    return build_windowed(family) if family.startswith("gemma") else build_family(family)


# bf16 panels, whose gate/up pairs run the MLP's activation in the same op.
BF16 = pytest.param("bf16", marks=needs_bf16_panels)
# The Llama layer's kin that decode through the fused stack, each with a form of its own.
FUSED_KIN = [
    "qwen3",
    "phi4_mini",
    "smollm3",
    "gemma2",
    "gemma3",
    "granite",
    "olmo2",
    "olmo3",
    "exaone4",
    "glm4",
    "ernie4_5",
    "helium",
    "hunyuan",
]


def decode_step(
    model: LlamaForCausalLM,
    fused: bool,
    monkeypatch: pytest.MonkeyPatch,
    kv: str = "auto",
    prompts: list[list[int]] = PROMPTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and cache after one decode step of sequences of different lengths."""
    core, _ = tiny_core(
        model,
        attention_backend="cpu",
        kv_cache_dtype=kv,
        with_tokenizer=model.config.vocab_size >= 320,
    )
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    for _ in range(3):
        core.step()
    scheduled = core.scheduler.schedule()
    batch = build_input_batch(scheduled.scheduled, core.runner.kv_cache.block_size)
    assert list(batch.query_lens) == [1] * len(prompts)
    with monkeypatch.context() as patch, torch.inference_mode():
        if not fused:
            patch.setattr(CpuPagedAttention, "decode_step", lambda self, metadata: None)
        logits = core.runner.forward(batch, batch.sample_token_indices)
    return logits, core.runner.kv_cache.tensor.clone()


@pytest.mark.parametrize("family", ["llama", "qwen2", *FUSED_KIN])
@pytest.mark.parametrize("weights", ["fp32", "fp16", BF16])
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16", "fp8_e5m2"])
def test_fused_step_equals_the_layers_op_by_op(
    family: str, weights: str, kv: str, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same kernels in the same order, K/V rounded alike to a 16-bit cache: the logits and
    every K/V written are equal to the bit (qwen2 has q/k/v biases, qwen3 per-head q/k norms,
    phi4_mini a rotary of 3/4 of each head, smollm3 a layer without rotary, gemma3 four norms a
    layer, GELU, windowed layers and a rotary table per layer type, gemma2 soft-capped scores,
    granite its outputs scaled before the residual adds, olmo3 no norm before the attention or
    the MLP, their outputs normed, q's and k's heads each normed as one row, windows and a
    rotary table per layer type, exaone4 the same norms with each q and k head normed, a window
    on one layer and no rotary on the other, glm4 half of each head turned as neighbouring pairs
    with its outputs normed, ernie4_5 the whole head turned as pairs, hunyuan each q and k head
    normed after the rotary; over bf16 panels, the stack in one region)."""
    model = packed(tiny_llama() if family == "llama" else build(family), weights)
    paged = build_causal_lm(model)
    assert isinstance(paged, PagedLlamaForCausalLM)
    gated = isinstance(paged.layers[0].gate_up_proj, GatedPanelLinear)
    assert gated == (weights == "bf16")  # Phi-3's one gate/up layer split into pairs
    fused_logits, fused_cache = decode_step(model, True, monkeypatch, kv)
    layers = model.config.num_hidden_layers
    # One prefill step, two decode steps, then the step compared: fused on all but the first.
    assert calls == [len(PROMPTS)] * (3 * layers)
    calls.clear()
    plain_logits, plain_cache = decode_step(model, False, monkeypatch, kv)
    assert calls == [len(PROMPTS)] * (2 * layers)
    assert fused_logits.shape == (len(PROMPTS), model.config.vocab_size)
    assert torch.equal(fused_logits, plain_logits)
    assert fused_cache.dtype == cache_dtype_named(kv)
    assert torch.equal(fused_cache, plain_cache)
    assert fused_cache.float().abs().sum() > 0


@pytest.mark.parametrize("weights", ["fp32", BF16])  # bf16: the stack in one region
def test_a_windowed_stack_equals_the_layers_op_by_op(
    weights: str, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral's sliding window (6 tokens, shorter than every prompt but one) in the fused
    stack: the decode kernel starts each row at its window in both, so the logits and every K/V
    written are equal to the bit."""
    model = mistral(weights, window=6)
    fused = PagedLlamaForCausalLM(model).fused_decode
    assert fused.route is DecodeRoute.STACK and fused.layers[0].window == 6
    fused_logits, fused_cache = decode_step(model, True, monkeypatch, "bfloat16")
    assert len(calls) == 3 * model.config.num_hidden_layers
    plain_logits, plain_cache = decode_step(model, False, monkeypatch, "bfloat16")
    assert torch.equal(fused_logits, plain_logits)
    assert torch.equal(fused_cache, plain_cache)
    wide_logits, _ = decode_step(mistral(weights, window=None), True, monkeypatch, "bfloat16")
    assert not torch.equal(fused_logits, wide_logits), "the window changed the answer"


def mistral(weights: str, window: int | None) -> LlamaForCausalLM:
    """A tiny Mistral with a sliding window (the same weights whatever the window), packed."""
    torch.manual_seed(0)
    config = MistralConfig(**FAMILY_COMMON, sliding_window=window)
    return packed(AutoModelForCausalLM.from_config(config).eval(), weights)


@pytest.mark.parametrize("family", ["llama", "ministral", "gemma3"])
def test_the_stack_in_one_op_equals_one_op_a_layer(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`decode_layers` runs the layers' ops in the same order as a `decode_layer` call a layer:
    the same logits and cache to the bit, in one call a step (ministral: a window on one layer
    of two; gemma3: Gemma's layer, windows on two of three and a rotary table per layer
    type)."""
    stacks: list[int] = []
    original = cpu_ops.decode_layers
    monkeypatch.setattr(
        cpu_ops, "decode_layers", lambda *args: stacks.append(len(args[6])) or original(*args)
    )
    model = packed(tiny_llama() if family == "llama" else build(family))
    windows = stack_of(model).windows
    assert (len(set(windows)) > 1) == (family != "llama")
    stacked_logits, stacked_cache = decode_step(model, True, monkeypatch, "bfloat16")
    layers = model.config.num_hidden_layers
    assert stacks == [layers] * 3  # the two decode steps before, and the one compared
    monkeypatch.setattr(PagedLlamaForCausalLM, "__init__", _without_stack)
    layer_logits, layer_cache = decode_step(model, True, monkeypatch, "bfloat16")
    assert stacks == [layers] * 3
    assert torch.equal(stacked_logits, layer_logits)
    assert torch.equal(stacked_cache, layer_cache)


@needs_bf16_panels
@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen3",
        "phi4_mini",
        "smollm3",
        "ministral",
        "gemma2",
        "gemma3",
        "granite",
        "olmo3",
        "exaone4",
        "glm4",
        "hunyuan",
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("sequences", [4, 13])
def test_the_stack_in_one_region_equals_the_layers_op_by_op(
    family: str,
    threads: int,
    sequences: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over bf16 panels the stack runs in one parallel region
    (`csrc/fused_decode/decode_stack.cpp`): with a few sequences' kv heads shared out or many whole
    sequences taken as threads free up, on any number of threads, the logits and every K/V written
    equal the layers op by op (qwen3: each q and k head normed in the region; smollm3: a layer
    not rotated; phi4_mini: one gate/up projection split into pairs, a partial rotary;
    ministral: a window on one layer of two; gemma3: its output norms, GELU,
    windows and two rotary tables; gemma2: capped scores; granite: its scaled residual
    adds; olmo3 and exaone4: rows taken to q/k/v and gate/up without a norm, q/k norms over
    all heads (olmo3) or head by head (exaone4); glm4: a rotary of neighbouring pairs; hunyuan:
    q/k norms after the rotary)."""
    prompts = [list(range(5 + 11 * i, 9 + 11 * i + (7 * i) % 19)) for i in range(sequences)]
    model = packed(tiny_llama() if family == "llama" else build(family), "bf16")
    stack = stack_of(model)
    cos = sin = torch.zeros(sequences, 1, stack.layers[0].heads[2])
    width = model.config.hidden_size
    forms = (list(stack.qk_norms), list(stack.out_norms), list(stack.gelu))
    assert cpu_ops.stack_region_applies(width, *stack_args(stack), cos, sin, *forms)
    assert (family in ("smollm3", "exaone4")) == (False in stack.rotates)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        region_logits, region_cache = decode_step(model, True, monkeypatch, "bfloat16", prompts)
        plain_logits, plain_cache = decode_step(model, False, monkeypatch, "bfloat16", prompts)
    finally:
        torch.set_num_threads(saved)
    assert region_logits.shape == (sequences, model.config.vocab_size)
    assert torch.equal(region_logits, plain_logits)
    assert torch.equal(region_cache, plain_cache)


@needs_bf16_panels
def test_only_stacks_of_bf16_panels_run_in_one_region() -> None:
    """fp32 or fp16 panels, a bias that does not fit its panels, or rotary tables wider than
    the heads or of an odd width keep the stack op by op (narrower: a partial rotary)."""
    cos = sin = torch.zeros(3, 1, 16)

    def applies(args: tuple, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> bool:
        return cpu_ops.stack_region_applies(64, *args, cos, sin)

    stacks = {w: stack_args(stack_of(packed(tiny_llama(), w))) for w in ("bf16", "fp16", "fp32")}
    weights, biases, heads = bf16 = stacks["bf16"]
    assert applies(bf16)
    assert not applies(stacks["fp16"]) and not applies(stacks["fp32"])
    biases = list(biases)
    biases[4] = torch.zeros(7)  # the second layer's q/k/v bias
    assert not applies((weights, biases, heads))
    assert applies(bf16, torch.zeros(3, 1, 8), torch.zeros(3, 1, 8))  # half of each head turns
    assert not applies(bf16, torch.zeros(3, 1, 32), torch.zeros(3, 1, 32))
    assert not applies(bf16, torch.zeros(3, 1, 7), torch.zeros(3, 1, 7))
    # A layer's own rotary rows: the first layer's of another width.
    assert applies(bf16, [torch.zeros(3, 1, 8), cos], [torch.zeros(3, 1, 8), sin])
    assert not applies(bf16, [torch.zeros(3, 1, 7), cos], [torch.zeros(3, 1, 7), sin])


@needs_bf16_panels
def test_gemmas_stack_runs_in_one_region_with_its_output_norms() -> None:
    """Gemma 3's output norms and GELU gate pairs run in the region too; an output norm that is
    not fp32 `[hidden]` keeps the stack a layer at a time."""
    fused = stack_of(packed(build("gemma3"), "bf16"))
    assert all(f.gelu and f.out_norms is not None for f in fused.layers)
    width, dim = fused.layers[0].weights[0].shape[0], fused.layers[0].heads[2]
    rows = torch.zeros(3, 1, dim)
    args = (*stack_args(fused), rows, rows, list(fused.qk_norms))
    out_norms = list(fused.out_norms)
    assert cpu_ops.stack_region_applies(width, *args, out_norms, list(fused.gelu))
    first = out_norms[0]
    assert first is not None
    out_norms[0] = (first[0][:-1], first[1])
    assert not cpu_ops.stack_region_applies(width, *args, out_norms, list(fused.gelu))


@needs_bf16_panels
def test_the_region_refuses_rows_without_their_rotary_rows() -> None:
    """The region reads cos/sin by row: tables for another number of rows are refused before
    any thread starts, as the op-by-op rotary refuses them."""
    stack = stack_of(packed(tiny_llama(), "bf16"))
    weights, biases, heads = stack_args(stack)
    caches = [torch.zeros(8, 4, 2, 16, dtype=torch.bfloat16) for _ in range(4)]
    args = dict(
        hidden=torch.randn(2, 64),
        weights=weights,
        biases=biases,
        heads=heads,
        cos=torch.ones(3, 1, 16),
        sin=torch.zeros(3, 1, 16),
        key_caches=caches[:2],
        value_caches=caches[2:],
        slots=torch.tensor([1, 5]),
        block_table=torch.tensor([[0], [1]]),
        seq_lens=torch.tensor([2, 2]),
        eps=stack.layers[0].eps,
        scale=stack.layers[0].scale,
    )
    with pytest.raises(RuntimeError, match="rotary"):
        cpu_ops.decode_layers(**args)
    assert all(not c.any() for c in caches)
    out = cpu_ops.decode_layers(
        **(args | dict(cos=torch.ones(2, 1, 16), sin=torch.zeros(2, 1, 16)))
    )
    assert out.shape == (2, 64) and torch.isfinite(out).all()
    assert caches[0][0, 1].any() and caches[0][1, 1].any()  # slots 1 and 5


_build_paged = PagedLlamaForCausalLM.__init__


def _without_stack(self: PagedLlamaForCausalLM, *args: object) -> None:
    _build_paged(self, *args)
    self.fused_decode = FusedDecode.of(DecodeRoute.LAYERS, self.fused_decode.layers)


def paged_layers() -> list[PagedLlamaLayer]:
    return list(PagedLlamaForCausalLM(packed(tiny_llama())).layers)  # type: ignore[arg-type]


def test_the_route_is_chosen_for_all_the_layers_at_once() -> None:
    """The stack as one op where every layer fuses alike, one op a layer where their shapes
    differ, and op by op, with the reason, where any one layer does not fuse."""
    layers = paged_layers()
    stack = fused_decode.choose(layers)
    assert stack.route is DecodeRoute.STACK and len(stack.layers) == len(layers)
    assert [layer.index for layer in stack.layers] == list(range(len(layers)))
    layers[1].scaling *= 2
    assert fused_decode.choose(layers).route is DecodeRoute.LAYERS
    layers = paged_layers()
    layers[1].o_proj = nn.Linear(layers[1].o_proj.in_features, layers[1].o_proj.out_features)
    ops = fused_decode.choose(layers)
    assert ops.route is DecodeRoute.OPS and not ops.layers
    assert ops.describe() == "op by op (projections not in Conveyor's panels)"
    layers = paged_layers()
    layers[1].o_proj.bf16_blocks = True  # the fused op would take the blocks' fp32 product
    assert fused_decode.choose(layers).describe() == (
        "op by op (blocks multiplied in bf16 dot products)"
    )


@pytest.mark.parametrize("weights", ["fp32", "fp16"])
def test_greedy_through_the_fused_layer_equals_generate(weights: str, calls: list[int]) -> None:
    """The oracle: transformers over the same (for fp16 panels, fp16-rounded) weights."""
    model = tiny_llama(dtype=torch.float32 if weights == "fp32" else torch.bfloat16).float()
    expected = [reference_greedy(model, p, 12) for p in PROMPTS]
    core, _ = tiny_core(packed(model, weights), attention_backend="cpu")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = run_all(core, PROMPTS, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected
    assert len(calls) >= 2 * 10 and max(calls) == len(PROMPTS)


@pytest.mark.parametrize("family", FUSED_KIN)
@pytest.mark.parametrize("weights", ["fp32", "fp16"])
def test_greedy_through_the_llama_layers_kin_equals_generate(
    family: str, weights: str, calls: list[int]
) -> None:
    """Qwen3's q and k heads normed, Phi-4-mini's partial rotary, SmolLM3's NoPE layers,
    Gemma 3's layer (its outputs normed, GELU, windows, two rotary tables), Gemma 2's capped
    scores, Granite's scaled residual adds, OLMo 2's and 3's layers (their outputs normed and
    not their inputs, q and k normed over all heads), EXAONE 4's (the same norms, each q and
    k head normed, NoPE global layers), GLM-4's, ERNIE 4.5's and Helium's rotary of neighbouring
    pairs and Hunyuan's q/k norms after the rotary inside the fused decode: greedy tokens are
    transformers' over the same (for fp16 panels, fp16-rounded) weights."""
    model = build(family)
    if weights == "fp16":
        model = model.half().float()
    expected = [reference_greedy(model, p, 10, attention="eager") for p in PROMPTS]
    core, _ = tiny_core(packed(model, weights), attention_backend="cpu")
    route = core.runner.model.fused_decode
    assert route.route is DecodeRoute.STACK, route.describe()
    if family == "gemma3":  # each layer with its window and rotary table
        assert [(f.window, f.rotary) for f in route.layers] == [
            (6, "sliding_attention"),
            (0, "full_attention"),
            (6, "sliding_attention"),
        ]
        assert all(f.gelu and f.out_norms is not None for f in route.layers)
    assert (route.residual_scales[0] != 1.0) == (family == "granite")
    assert (route.softcaps[0] != 0.0) == (family == "gemma2")
    assert (route.qk_norms[0] is not None) == (
        family not in ("phi4_mini", "smollm3", "gemma2", "granite", "glm4", "ernie4_5", "helium")
    )
    assert route.pairs[0] == (family in ("glm4", "ernie4_5", "helium"))
    assert route.norms_rotated[0] == (family == "hunyuan")
    assert (route.layers[0].weights[0].numel() == 0) == family.startswith(("olmo", "exaone"))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = run_all(core, PROMPTS, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected
    assert len(calls) >= 2 * 8 and max(calls) == len(PROMPTS)


def test_gemmas_layers_and_sinks_fuse_and_other_epsilons_keep_a_stack_op_by_op() -> None:
    """Gemma 2's capped scores and Gemma 3's sandwich norms and GELU fuse, each the whole stack
    in one call; attention sinks (gpt-oss's) go into the stack's call with their layer, sinks
    not in fp32 and norms of another epsilon keep a stack op by op."""
    gemma2 = list(PagedGemmaForCausalLM(packed(build("gemma2"))).layers)
    stack = fused_decode.choose(gemma2)
    assert stack.route is DecodeRoute.STACK and stack.softcaps == (1.0, 1.0)
    assert stack.sinks == (None, None)
    sinks = torch.zeros(4)
    gemma2[1].attention = LayerAttention.of(None, sinks=sinks)
    sunk = fused_decode.choose(gemma2)
    assert sunk.route is DecodeRoute.STACK and sunk.sinks == (None, sinks)
    gemma2[1].attention = LayerAttention.of(None, sinks=sinks.double())
    assert fused_decode.choose(gemma2).describe() == "op by op (attention sinks not fp32)"
    gemma3 = list(PagedGemmaForCausalLM(packed(build("gemma3"))).layers)
    assert fused_decode.choose(gemma3).route is DecodeRoute.STACK
    gemma3[2].post_mlp_norm.variance_epsilon *= 10
    assert fused_decode.choose(gemma3).describe() == "op by op (two norm epsilons in a layer)"


def test_q_and_k_norms_of_another_epsilon_keep_the_layer_op_by_op() -> None:
    layers = list(PagedLlamaForCausalLM(packed(build("qwen3"))).layers)
    assert fused_decode.choose(layers).route is DecodeRoute.STACK
    layers[1].qk_norm_eps *= 10  # type: ignore[operator]
    assert fused_decode.choose(layers).describe() == "op by op (a q/k norm epsilon of its own)"


def test_steps_with_a_prompt_run_op_by_op(calls: list[int]) -> None:
    """A step that carries a prefill chunk has rows of several tokens: no fused layer."""
    core, _ = tiny_core(packed(tiny_llama()), attention_backend="cpu")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    run_all(core, PROMPTS, params)
    assert calls == []


@pytest.mark.parametrize("case", ["layer_norm", "gelu", "unpacked", "torch_backend"])
def test_what_the_fused_layer_does_not_compute_runs_op_by_op(case: str, calls: list[int]) -> None:
    """LayerNorms (StableLM's), another activation, torch's own linear layers and another
    attention backend all keep the layer op by op, and greedy still equals generate."""
    if case == "layer_norm":
        model = build("stablelm")
    elif case == "gelu":
        config = tiny_llama().config
        config.hidden_act = "gelu"
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
    else:
        model = tiny_llama()
    expected = [reference_greedy(model, p, 6) for p in PROMPTS[:2]]
    if case != "unpacked":
        pack_linears(model)
    backend = "torch" if case == "torch_backend" else "cpu"
    core, _ = tiny_core(model, attention_backend=backend)
    route = core.runner.model.fused_decode
    assert (route.route is DecodeRoute.OPS) == (case != "torch_backend")
    assert (
        route.reason
        == {
            "layer_norm": "LayerNorms",
            "gelu": "the activation is neither silu nor GELU's tanh approximation",
            "unpacked": "projections not in Conveyor's panels",
            "torch_backend": "",
        }[case]
    )
    outputs = run_all(
        core, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(2)] == expected
    assert calls == []


def op_inputs(rows: int = 2) -> dict[str, object]:
    """Valid arguments for one small layer: hidden 32, 4 heads of 8, 2 kv heads, inter 48."""
    generator = torch.Generator().manual_seed(0)

    def panels(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(-(-out_features // 16), in_features, 16, generator=generator)

    cache = torch.randn(2, 8, 4, 2, 8, generator=generator)
    return dict(
        hidden=torch.randn(rows, 32, generator=generator),
        weights=[
            torch.ones(32),
            panels(64, 32),
            panels(32, 32),
            torch.ones(32),
            panels(96, 32),
            panels(32, 48),
        ],
        biases=[None, None, None, None],
        heads=[4, 2, 8],
        cos=torch.ones(rows, 1, 8),
        sin=torch.zeros(rows, 1, 8),
        key_cache=cache[0],
        value_cache=cache[1],
        slots=torch.arange(rows, dtype=torch.int64) * 4 + 3,
        block_table=torch.arange(rows, dtype=torch.int64)[:, None],
        seq_lens=torch.full((rows,), 4, dtype=torch.int64),
        eps=1e-6,
        scale=0.35,
    )


def test_the_op_writes_each_rows_kv_at_its_slot() -> None:
    inputs = op_inputs()
    before = {name: inputs[name].clone() for name in ("key_cache", "value_cache")}
    out = cpu_ops.decode_layer(**inputs)
    assert out.shape == (2, 32) and torch.isfinite(out).all()
    for name, cache in before.items():
        changed = (inputs[name] != cache).reshape(-1, 16).any(1).nonzero().flatten()
        assert changed.tolist() == [3, 7], name


def unpacked(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight `[out, in]` that fp32 panels `[ceil(out / 16), in, 16]` hold."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features]


def gemma_layer_in_torch(
    inputs: dict[str, object], out_norms: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """`op_inputs`' layer as Gemma computes it, in torch's own ops: the attention's and the
    MLP's outputs normed before each residual add, GELU (tanh) gating. cos 1 and sin 0 leave q
    and k unturned; the cache holds what the op stored."""
    w = cast_tensors(inputs["weights"])
    hidden, eps = cast(torch.Tensor, inputs["hidden"]), cast(float, inputs["eps"])
    heads, kv_heads, dim = cast(list[int], inputs["heads"])
    key, value = cast(torch.Tensor, inputs["key_cache"]), cast(torch.Tensor, inputs["value_cache"])
    table, lens = cast(torch.Tensor, inputs["block_table"]), cast(torch.Tensor, inputs["seq_lens"])
    qkv = reference_norm(hidden, w[0], eps) @ unpacked(w[1], (heads + 2 * kv_heads) * dim).T
    query = qkv[:, : heads * dim].view(-1, heads, dim)
    rows = []
    for r in range(hidden.shape[0]):
        block, length = int(table[r, 0]), int(lens[r])
        k = key[block, :length].repeat_interleave(heads // kv_heads, dim=1)
        v = value[block, :length].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[r], k) * cast(float, inputs["scale"])
        rows.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v).reshape(-1))
    width, inter = hidden.shape[1], w[5].shape[1]
    hidden = hidden + reference_norm(torch.stack(rows) @ unpacked(w[2], width).T, out_norms[0], eps)
    gate_up = reference_norm(hidden, w[3], eps) @ unpacked(w[4], 2 * inter).T
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    activated = torch.nn.functional.gelu(gate, approximate="tanh") * up
    return hidden + reference_norm(activated @ unpacked(w[5], width).T, out_norms[1], eps)


def cast_tensors(value: object) -> list[torch.Tensor]:
    return cast(list[torch.Tensor], value)


def test_gemmas_layer_equals_torchs_ops() -> None:
    """With its outputs normed and GELU gating, the op computes what Gemma's layer computes in
    torch's own ops over the same weights; the Llama layer over them computes something else."""
    inputs = op_inputs()
    generator = torch.Generator().manual_seed(1)
    out_norms = (1 + torch.rand(32, generator=generator), 1 + torch.rand(32, generator=generator))
    out = cpu_ops.decode_layer(**inputs, out_norms=out_norms, gelu=True)  # type: ignore[arg-type]
    torch.testing.assert_close(out, gemma_layer_in_torch(inputs, out_norms), rtol=1e-5, atol=1e-5)
    llama = cpu_ops.decode_layer(**op_inputs())  # type: ignore[arg-type]
    assert not torch.allclose(llama, out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(slots=torch.tensor([3, 64])), "slot out of range"),
        (dict(slots=torch.tensor([3])), "one int64 slot per row"),
        (dict(heads=[4, 4, 8]), "head shapes"),
        (dict(hidden=torch.randn(2, 32).double()), "contiguous fp32"),
        (dict(biases=[None]), "6 weights, 4 biases"),
        (dict(seq_lens=torch.tensor([4, 9])), "sequence length outside its block table"),
        (dict(out_norms=(torch.ones(32), torch.ones(31))), "output norm must be contiguous fp32"),
        (dict(out_norms=(torch.ones(32).double(),) * 2), "output norm must be contiguous fp32"),
    ],
)
def test_the_op_rejects_bad_inputs(change: dict[str, object], message: str) -> None:
    inputs = op_inputs() | change
    cache_before = inputs["key_cache"].clone()
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.decode_layer(**inputs)
    if "slot" in message:
        assert torch.equal(inputs["key_cache"], cache_before)


def test_the_stack_op_takes_each_layers_arguments_back_to_back() -> None:
    """Two layers in one call equal two `decode_layer` calls; lists that do not match the
    number of caches are refused."""
    inputs = op_inputs()
    first, second = inputs["key_cache"], inputs["value_cache"]
    caches = [c.clone() for c in (first, second, second, first)]  # K, V of layer 1, then 2
    alone = [c.clone() for c in caches]
    stack = {k: v for k, v in inputs.items() if k not in ("key_cache", "value_cache")}
    stack |= dict(
        weights=inputs["weights"] * 2,
        biases=inputs["biases"] * 2,
        key_caches=[caches[0], caches[2]],
        value_caches=[caches[1], caches[3]],
    )
    out = cpu_ops.decode_layers(**stack)
    once = cpu_ops.decode_layer(**(inputs | dict(key_cache=alone[0], value_cache=alone[1])))
    twice = cpu_ops.decode_layer(
        **(inputs | dict(hidden=once, key_cache=alone[2], value_cache=alone[3]))
    )
    assert torch.equal(out, twice)
    assert all(torch.equal(a, b) for a, b in zip(caches, alone, strict=True))
    assert not torch.equal(caches[0], first)  # the new K/V were written
    with pytest.raises(RuntimeError, match="6 weights, 4 biases"):
        cpu_ops.decode_layers(**(stack | dict(weights=inputs["weights"])))
    with pytest.raises(RuntimeError, match="one key and one value cache"):
        cpu_ops.decode_layers(**(stack | dict(value_caches=[caches[1]])))


def test_the_stack_op_checks_every_layer_before_running_any() -> None:
    """A bad second layer, or a slot outside the cache, is refused with no K/V written."""
    inputs = op_inputs()
    stack = {k: v for k, v in inputs.items() if k not in ("key_cache", "value_cache")}
    caches = [inputs["key_cache"], inputs["value_cache"]]
    before = [c.clone() for c in caches]
    small = [c[:-1].clone() for c in caches]
    two_layers = stack | dict(weights=inputs["weights"] * 2, biases=inputs["biases"] * 2)
    with pytest.raises(RuntimeError, match="caches of one size"):
        cpu_ops.decode_layers(
            **(
                two_layers
                | dict(key_caches=[caches[0], small[0]], value_caches=[caches[1], small[1]])
            )
        )
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_ops.decode_layers(
            **(
                stack
                | dict(slots=torch.tensor([3, 64]), key_caches=caches[:1], value_caches=caches[1:])
            )
        )
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


def test_layer_cache_views_are_made_once() -> None:
    core, _ = tiny_core(packed(tiny_llama()), attention_backend="cpu")
    cache = core.runner.kv_cache
    assert cache.key(1) is cache.key(1)
    assert cache.key(1).data_ptr() == cache.tensor[1, 0].data_ptr()
    assert np.array_equal(cache.value(0).shape, cache.tensor[0, 1].shape)
