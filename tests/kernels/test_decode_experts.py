"""Layers of experts in the fused CPU decode: each layer's attention as one op
(`decode_layer` with no MLP weights, stopping after the attention's residual add), its norm,
router and experts between the ops as the layer runs them. A decode step equals the layers op by
op to the bit, and greedy tokens equal transformers'."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.fused_decode import EXPERTS_BETWEEN, DecodeRoute
from engine.models import build_causal_lm
from engine.models.experts import unfuse_experts
from engine.models.llama import PagedLlamaForCausalLM
from tests.helpers import (
    needs_bf16_panels,
    needs_panels,
    reference_greedy,
    run_all,
    tiny_core,
    tokens_of,
)
from tests.kernels.test_decode_layer import PROMPTS, decode_step, op_inputs, packed
from tests.models import test_gpt_oss
from tests.models.test_moe import DENSE_LAYERS, build

pytestmark = needs_panels

BF16 = pytest.param("bf16", marks=needs_bf16_panels)
# Families whose layers of experts decode through the fused layer: softmax routers (Mixtral's,
# Qwen's, OLMoE's with its q/k norms over all heads, Hunyuan's beside its MLP every token runs,
# its q/k norms after the rotary), routers with a bias (GLM-4.5's, dots.llm1's, EXAONE MoE's with
# windows, Solar Open's, ERNIE 4.5's with its paired rotary, MiniMax M2's), dense layers between;
# Granite's with its residual adds scaled (and GraniteMoeShared's MLP every token runs).
FUSED_MOE = [
    "mixtral",
    "qwen2-moe",
    "qwen3-moe",
    "glm4-moe",
    "dots1",
    "exaone-moe",
    "solar-open",
    "ernie4.5-moe",
    "minimax-m2",
    "hunyuan-moe",
    "olmoe",
    "granite-moe",
    "granite-moe-shared",
]


def tiny_moe(family: str):
    """The family's tiny model (OLMoE's without its clamp of q, k and v)."""
    return build(family, **({"clip_qkv": None} if family == "olmoe" else {}))


def in_panels(model, weights: str = "fp32"):
    """`model` as Conveyor serves it on this CPU: each expert a layer of its own, every
    projection in fp32, fp16 or bf16 panels."""
    unfuse_experts(model)
    return packed(model, weights)


def moe_model(family: str, weights: str = "fp32"):
    return in_panels(tiny_moe(family), weights)


@pytest.mark.parametrize("family", FUSED_MOE)
@pytest.mark.parametrize("weights", ["fp32", BF16])  # the experts in one op, either way
def test_a_fused_step_with_experts_equals_the_layers_op_by_op(
    family: str, weights: str, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = moe_model(family, weights)
    paged = build_causal_lm(model)
    assert isinstance(paged, PagedLlamaForCausalLM)
    route = paged.fused_decode
    assert (route.route, route.reason) == (DecodeRoute.LAYERS, EXPERTS_BETWEEN)
    dense = DENSE_LAYERS.get(family, set())
    assert [f.experts is None for f in route.layers] == [i in dense for i in range(3)]
    experts = [layer.moe.experts for layer in paged.layers if layer.moe is not None]
    assert experts and all(e.grouped for e in experts)
    fused_logits, fused_cache = decode_step(model, True, monkeypatch, "float32")
    assert calls == [len(PROMPTS)] * (3 * 3)  # 3 layers, fused on all but the prefill step
    calls.clear()
    plain_logits, plain_cache = decode_step(model, False, monkeypatch, "float32")
    assert calls == [len(PROMPTS)] * (2 * 3)
    assert torch.equal(fused_logits, plain_logits)
    assert torch.equal(fused_cache, plain_cache)
    assert fused_cache.abs().sum() > 0


@pytest.mark.parametrize("family", ["qwen3-moe", "glm4-moe"])
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e5m2"])
def test_experts_layers_write_a_16_or_8_bit_cache_as_op_by_op(
    family: str, kv: str, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = moe_model(family)
    fused_logits, fused_cache = decode_step(model, True, monkeypatch, kv)
    plain_logits, plain_cache = decode_step(model, False, monkeypatch, kv)
    assert calls and torch.equal(fused_logits, plain_logits)
    assert torch.equal(fused_cache, plain_cache)


@pytest.mark.parametrize(
    ("family", "weights"),
    [(family, "fp32") for family in FUSED_MOE] + [("mixtral", "fp16"), ("glm4-moe", "fp16")],
)
def test_greedy_through_fused_experts_layers_equals_generate(
    family: str, weights: str, calls: list[int]
) -> None:
    """The oracle: transformers over the same (for fp16 panels, fp16-rounded) weights."""
    model = tiny_moe(family)
    if weights == "fp16":
        model = model.half().float()
    expected = [reference_greedy(model, p, 10, attention="eager") for p in PROMPTS]
    core, _ = tiny_core(in_panels(model, weights), attention_backend="cpu")
    assert core.runner.model.fused_decode.route is DecodeRoute.LAYERS
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = run_all(core, PROMPTS, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected
    assert len(calls) >= 2 * 3 and max(calls) == len(PROMPTS)


@pytest.mark.parametrize("weights", ["fp32", BF16])
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_gpt_oss_layers_with_their_sinks_decode_as_one_op_each(
    weights: str, kv: str, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss's attention (sinks, q/k/v and output biases, sliding and full layers) in the
    fused layer, its router and experts between the ops: a step equals the layers op by op to
    the bit, and without the sinks it differs."""
    model = in_panels(test_gpt_oss.build(), weights)
    paged = build_causal_lm(model)
    route = paged.fused_decode
    assert (route.route, route.reason) == (DecodeRoute.LAYERS, EXPERTS_BETWEEN)
    assert all(layer.sinks is not None for layer in route.layers)
    assert [layer.window for layer in route.layers] == [6, 0, 6]
    fused_logits, fused_cache = decode_step(model, True, monkeypatch, kv)
    assert calls == [len(PROMPTS)] * (3 * 3)  # 3 layers, fused on all but the prefill step
    plain_logits, plain_cache = decode_step(model, False, monkeypatch, kv)
    assert torch.equal(fused_logits, plain_logits)
    assert torch.equal(fused_cache, plain_cache)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
    unsunk, _ = decode_step(model, True, monkeypatch, kv)
    assert not torch.allclose(unsunk, fused_logits)


def test_gpt_oss_greedy_through_its_fused_layers_equals_generate(calls: list[int]) -> None:
    """The oracle: transformers' eager attention, which computes the sinks."""
    model = test_gpt_oss.build()
    expected = [reference_greedy(model, p, 10, attention="eager") for p in PROMPTS]
    core, _ = tiny_core(in_panels(model), attention_backend="cpu")
    assert core.runner.model.fused_decode.route is DecodeRoute.LAYERS
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = run_all(core, PROMPTS, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected
    assert len(calls) >= 2 * 3 and max(calls) == len(PROMPTS)


def test_sinks_that_are_not_fp32_keep_the_steps_op_by_op() -> None:
    model = in_panels(test_gpt_oss.build())
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.data = layer.self_attn.sinks.data.double()
    paged = build_causal_lm(model)
    assert paged.fused_decode.describe() == "op by op (attention sinks not fp32)"


def test_the_op_refuses_sinks_of_another_shape() -> None:
    args = op_inputs()
    heads = cast(list[int], args["heads"])[0]
    with pytest.raises(RuntimeError, match=r"sinks must be contiguous fp32 \[heads\]"):
        cpu_ops.decode_layer(**(args | {"sinks": torch.zeros(heads + 1)}))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"sinks must be contiguous fp32 \[heads\]"):
        cpu_ops.decode_layer(**(args | {"sinks": torch.zeros(heads, dtype=torch.float64)}))  # type: ignore[arg-type]
    assert cpu_ops.decode_layer(**(args | {"sinks": torch.zeros(heads)})).isfinite().all()  # type: ignore[arg-type]


def test_a_stack_with_sinks_equals_its_layers_one_by_one() -> None:
    """`decode_layers` takes each layer's sinks (or None) as `decode_layer` does: a stack of a
    layer with sinks and one without equals the two ops in turn, and the sinks count."""
    args = op_inputs()
    heads = cast(list[int], args["heads"])[0]
    sinks = torch.linspace(-2.0, 3.0, heads)
    weights = cast(list[torch.Tensor], args["weights"])
    caches = [cast(torch.Tensor, args[name]) for name in ("key_cache", "value_cache")]
    step = {k: v for k, v in args.items() if k not in ("key_cache", "value_cache", "hidden")}

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        return caches[0].clone(), caches[1].clone()

    first, second = fresh(), fresh()
    x = cpu_ops.decode_layer(
        args["hidden"],
        **step,
        key_cache=first[0],
        value_cache=first[1],
        sinks=sinks,  # type: ignore[arg-type]
    )
    x = cpu_ops.decode_layer(x, **step, key_cache=second[0], value_cache=second[1])  # type: ignore[arg-type]
    stack = {k: v for k, v in step.items() if k != "weights"}
    keys, values = zip(fresh(), fresh(), strict=True)
    both = cpu_ops.decode_layers(
        args["hidden"], weights=weights * 2, **stack | {"biases": [None] * 8},  # type: ignore[arg-type]
        key_caches=list(keys), value_caches=list(values), sinks=[sinks, None],
    )  # fmt: skip
    assert torch.equal(both, x)
    keys, values = zip(fresh(), fresh(), strict=True)
    unsunk = cpu_ops.decode_layers(
        args["hidden"], weights=weights * 2, **stack | {"biases": [None] * 8},  # type: ignore[arg-type]
        key_caches=list(keys), value_caches=list(values),
    )  # fmt: skip
    assert not torch.allclose(unsunk, both)


def test_olmoes_clamp_of_q_k_and_v_keeps_the_stack_op_by_op() -> None:
    """OLMoE's clamp (`clip_qkv`) is its own `project_qkv`."""
    paged = build_causal_lm(in_panels(build("olmoe")))
    assert isinstance(paged, PagedLlamaForCausalLM)
    reason = "q, k and v made otherwise than the Llama layer makes them"
    assert paged.fused_decode.describe() == f"op by op ({reason})"


def test_the_op_without_mlp_weights_stops_after_the_attention() -> None:
    """No gate/up and down: the rows after the attention's residual add, which the whole layer
    continues from (its MLP added to them); one of the two alone, or a stack with such a
    layer, is refused."""
    args = op_inputs()
    weights = cast(list[torch.Tensor], args["weights"])
    whole = cpu_ops.decode_layer(**args)  # type: ignore[arg-type]
    key = cast(torch.Tensor, args["key_cache"]).clone()
    no_mlp = [*weights[:4], torch.empty(0), torch.empty(0)]
    attended = cpu_ops.decode_layer(**(args | {"weights": no_mlp}))  # type: ignore[arg-type]
    assert torch.equal(cast(torch.Tensor, args["key_cache"]), key)  # the same K/V again
    assert not torch.equal(attended, whole)
    normed = cpu_ops.rms_norm(attended, weights[3], 1e-6)
    gate_up = cpu_ops.panel_linear(normed, weights[4], None, 96)
    mlp = cpu_ops.panel_linear(cpu_ops.silu_mul(gate_up), weights[5], None, 32)
    assert torch.equal(attended + mlp, whole)
    with pytest.raises(RuntimeError, match="gate/up and down come together"):
        cpu_ops.decode_layer(**(args | {"weights": [*weights[:5], torch.empty(0)]}))  # type: ignore[arg-type]
    stack = {k: v for k, v in args.items() if k not in ("key_cache", "value_cache")}
    with pytest.raises(RuntimeError, match="every layer's MLP is the op's"):
        cpu_ops.decode_layers(
            **stack | {"weights": no_mlp, "key_caches": [key], "value_caches": [key.clone()]}  # type: ignore[arg-type]
        )
