"""Mixtures of experts on Conveyor's decoder (Mixtral, Qwen2-MoE with its shared expert and a
dense layer, Qwen3-MoE): greedy tokens equal transformers' `generate`, in every linear-layer
form and across two tensor-parallel ranks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu.linear import PanelLinear
from engine.loading.model_loader import LinearForm, use_linear_form
from engine.lora.adapter import LoRAError
from engine.models import build_causal_lm
from engine.models.experts import SPARSE_ON_HOST, ExpertLinears, SparseMoE, unfuse_experts
from engine.models.llama import PagedLlamaForCausalLM
from engine.worker.compilation import why_not_compiled
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
from tests.models.test_model_families import COMMON as FAMILY_COMMON

# The other families' tiny shape, three layers deep; each family sets its own MLP sizes.
COMMON = {
    **{key: value for key, value in FAMILY_COMMON.items() if key != "intermediate_size"},
    "num_hidden_layers": 3,
}
FAMILIES = {
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=8),
    # A shared expert behind its sigmoid gate; layer 1 keeps a dense MLP.
    "qwen2-moe": lambda: Qwen2MoeConfig(
        **COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    ),
    "qwen3-moe": lambda: Qwen3MoeConfig(
        **COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        head_dim=16,
    ),
}
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def build(name: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[name]()).to(dtype).eval()


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 9, 17, 30, 1, 24)]


def engine_tokens(model, **options: object) -> tuple[list[list[int]], object]:
    core, _ = tiny_core(model, **options)
    outputs = run_all(core, prompts(), GREEDY)
    assert core.scheduler.block_manager.num_used_blocks == 0
    return [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))], core


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_experts_greedy_matches_generate_under_chunking_and_preemption(name, device):
    model = build(name).to(device)
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    core, _ = tiny_core(
        model, num_blocks=24, max_model_len=64, max_num_batched_tokens=10, device=device
    )
    chunked = record_chunking(core)
    outputs = run_all(core, prompts(), GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    assert core.scheduler.num_preemptions > 0 and any(chunked)
    paged = core.runner.model
    assert isinstance(paged, PagedLlamaForCausalLM) and paged.sparse
    sparse = [layer.moe is not None for layer in paged.layers]
    assert sparse == ([True, False, True] if name == "qwen2-moe" else [True] * 3)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_block_computes_what_transformers_block_computes(name):
    model = build(name)
    torch.manual_seed(1)
    x = torch.randn(11, COMMON["hidden_size"])
    block = model.model.layers[0].mlp
    ours = SparseMoE(block)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), block(x[None])[0], rtol=1e-6, atol=1e-6)
        weights, experts = ours.route(x)
    assert experts.shape == (11, ours.top_k)
    if ours.renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(11))
    else:  # Qwen2-MoE's default: the top-k probabilities as they are
        assert bool((weights.sum(-1) < 1).all())


def test_a_wrong_routing_changes_the_tokens(monkeypatch):
    """The oracle sees the routing: experts shifted by one give other tokens."""
    model = build("qwen3-moe")
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    route = SparseMoE.route

    def shifted(self, x):
        weights, experts = route(self, x)
        return weights, (experts + 1) % self.num_experts

    monkeypatch.setattr(SparseMoE, "route", shifted)
    tokens, _ = engine_tokens(model)
    assert sum(a != b for a, b in zip(tokens, expected, strict=True)) >= len(expected) // 2


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_unfused_experts_are_views_and_the_model_computes_as_before(name):
    model = build(name)
    ids = torch.tensor([[5, 9, 33, 2, 70, 11]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    stacked = model.model.layers[0].mlp.experts.gate_up_proj
    assert unfuse_experts(model) == (2 if name == "qwen2-moe" else 3)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertLinears) and experts.num_experts == 8
    for expert, linear in enumerate(experts.gate_up):
        assert linear.weight.data_ptr() == stacked[expert].data_ptr()
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(LinearForm.FP32_PANELS, marks=needs_panels),
        pytest.param(LinearForm.BF16_PANELS, marks=needs_bf16_panels),
    ],
)
def test_experts_take_the_models_linear_form(form):
    """Each expert's projections become Conveyor's panels as every other projection does; the
    loaded model runs over them, and Conveyor's decoder gives its tokens."""
    dtype = torch.bfloat16 if form is LinearForm.BF16_PANELS else torch.float32
    model = build("qwen2-moe", dtype)
    use_linear_form(model, form)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, ExpertLinears)
    assert all(isinstance(m, PanelLinear) for m in [*experts.gate_up, *experts.down])
    storage = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    assert experts.gate_up[0].panels.dtype == storage
    assert isinstance(model.model.layers[0].mlp.shared_expert.down_proj, PanelLinear)
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    tokens, core = engine_tokens(model)
    assert tokens == expected
    assert "mixture-of-experts" in core.runner.model.fused_decode.describe()
    # transformers' own model runs over the same experts.
    tokens, core = engine_tokens(model, model_impl="transformers")
    assert not isinstance(core.runner.model, PagedLlamaForCausalLM)
    assert tokens == expected


def test_compile_and_graphs_refuse_experts_with_the_reason():
    paged = build_causal_lm(build("mixtral"))
    assert why_not_compiled(paged) == SPARSE_ON_HOST


def test_lora_adapters_of_the_attention_are_served_and_of_the_experts_refused(tmp_path):
    """A PEFT adapter of the attention's projections (the experts are 3-d tensors PEFT's
    LoRA layers do not target): greedy tokens equal PEFT's merged model."""
    pytest.importorskip("peft", reason="peft is not installed on this host")
    from tests.lora.adapters import merged, save_adapter

    path = save_adapter(
        tmp_path / "attn", ["q_proj", "v_proj", "o_proj"], seed=3, base=lambda: build("qwen3-moe")
    )
    expected = [reference_greedy(merged(path, build("qwen3-moe")), p, MAX_NEW) for p in prompts()]
    core, _ = tiny_core(
        build("qwen3-moe"), enable_lora=True, lora_modules=(("attn", str(tmp_path / "attn")),)
    )
    lora = core.loras.get("attn")
    for i, prompt in enumerate(prompts()):
        core.add_request(f"r{i}", prompt, GREEDY, lora=lora)
    outputs = {f"r{i}": [] for i in range(len(prompts()))}
    while core.has_unfinished():
        for output in core.step():
            outputs[output.request_id].append(output)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(prompts()))] == expected
    base = [reference_greedy(build("qwen3-moe"), p, MAX_NEW) for p in prompts()]
    assert expected != base, "the adapter acts"
    # An adapter of a projection a layer of experts does not have is refused by name.
    stored = tmp_path / "attn" / "adapter_model.safetensors"
    tensors = load_file(str(stored))
    a = torch.zeros(4, COMMON["hidden_size"])
    b = torch.zeros(32, 4)
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = a
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = b
    save_file(tensors, str(stored))
    with pytest.raises(LoRAError, match="layer 0 has no gate_proj to adapt"):
        core.read_lora("mlp", str(tmp_path / "attn"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-moe")
    build("qwen2-moe").save_pretrained(folder, max_shard_size="200KB")
    chat_tokenizer().save_pretrained(folder)
    return folder


def test_two_ranks_split_the_experts_and_give_one_ranks_tokens(moe_dir):
    """Each rank holds its channels of every expert (read from the per-expert tensors of the
    checkpoint's files) and of the shared expert."""
    expected = [reference_greedy(build("qwen2-moe"), p, MAX_NEW) for p in prompts()]
    for size in (1, 2):
        config = EngineConfig(
            model=str(moe_dir),
            dtype="float32",
            tensor_parallel_size=size,
            cache=CacheConfig(block_size=4, num_blocks=128),
        )
        core, loaded, _ = create_engine_core(config)
        try:
            outputs = run_all(core, prompts(), GREEDY)
            tokens = [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))]
            assert tokens == expected, f"tensor parallel {size}"
            experts = loaded.model.model.layers[0].mlp.experts
            assert experts.intermediate == 32 // size
        finally:
            core.close()
