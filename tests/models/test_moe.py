"""Mixtures of experts on Conveyor's decoder (Mixtral, Qwen2-MoE with its shared expert and a
dense layer, Qwen3-MoE, and the families whose router chooses by scores plus a bias: GLM-4.5,
dots.llm1, EXAONE MoE, Solar Open, ERNIE 4.5 MoE, MiniMax M2): greedy tokens equal transformers'
`generate`, in every linear-layer form and across two tensor-parallel ranks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Dots1Config,
    Ernie4_5_MoeConfig,
    ExaoneMoeConfig,
    Glm4MoeConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    HunYuanMoEV1Config,
    MiniMaxM2Config,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    SolarOpenConfig,
)

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu.linear import GatedPanelLinear, PanelLinear
from engine.loading.model_loader import LinearForm, use_linear_form
from engine.lora.adapter import LoRAError
from engine.models import build_causal_lm
from engine.models.experts import SPARSE_ON_HOST, ExpertLinears, SparseMoE, unfuse_experts
from engine.models.llama import PagedLlamaForCausalLM, layer_mlp
from engine.models.routing import BiasedRouter
from engine.parallel.loading import load_share
from engine.worker.compilation import why_not_compiled
from tests.core.test_engine_greedy import record_chunking
from tests.helpers import (
    chat_tokenizer,
    check_prompt_logprobs,
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
GRANITE = dict(
    num_local_experts=8,
    num_experts_per_tok=3,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.2,
    logits_scaling=3.0,
)
ROUTED = dict(intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=3, head_dim=16)
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
    # Routers that choose by their scores plus a (drawn) bias: GLM-4.5's within the best two of
    # four groups, scaled, beside a shared expert, after a dense layer, q/k normed, half of each
    # head rotating.
    "glm4-moe": lambda: Glm4MoeConfig(
        **COMMON,
        **ROUTED,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        n_shared_experts=1,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
    ),
    "dots1": lambda: Dots1Config(
        **COMMON,
        **ROUTED,
        n_routed_experts=8,
        n_shared_experts=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
    ),
    # Windowed layers, and a global one that rotates nothing.
    "exaone-moe": lambda: ExaoneMoeConfig(
        **COMMON,
        **ROUTED,
        num_experts=8,
        num_shared_experts=1,
        mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        routed_scaling_factor=2.5,
    ),
    "solar-open": lambda: SolarOpenConfig(
        **COMMON,
        **ROUTED,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
    ),
    # Over a softmax, with ERNIE's paired rotary.
    "ernie4.5-moe": lambda: Ernie4_5_MoeConfig(
        **COMMON,
        intermediate_size=96,
        moe_intermediate_size=32,
        moe_k=3,
        moe_num_experts=8,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        head_dim=16,
    ),
    # q and k normed over all heads, half of each head rotating.
    "minimax-m2": lambda: MiniMaxM2Config(
        **COMMON,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=3,
        head_dim=16,
        partial_rotary_factor=0.5,
    ),
    # OLMo 2's q/k norms over all heads, clamped after (`clip_qkv`), the top-k probabilities as
    # they are.
    "olmoe": lambda: OlmoeConfig(
        **COMMON,
        intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        clip_qkv=1.5,
    ),
    # A softmax router beside an MLP every token runs; q/k heads normed after the rotary.
    "hunyuan-moe": lambda: HunYuanMoEV1Config(
        **COMMON, intermediate_size=32, num_experts=8, moe_topk=3, head_dim=16
    ),
    # Granite's scalars (embeddings, residuals, attention, logits) over experts weighed by a
    # softmax of their top-k logits; GraniteMoeShared's MLP every token runs beside them.
    "granite-moe": lambda: GraniteMoeConfig(**COMMON, **GRANITE, intermediate_size=32),
    "granite-moe-shared": lambda: GraniteMoeSharedConfig(
        **COMMON, **GRANITE, intermediate_size=32, shared_intermediate_size=48
    ),
}
# The layers that keep a dense MLP, by family (the others' every layer holds experts).
DENSE_LAYERS = {
    "qwen2-moe": {1},
    **{family: {0} for family in ("glm4-moe", "dots1", "exaone-moe", "ernie4.5-moe")},
}
# The width of each family's shared expert (or shared experts together) in FAMILIES.
SHARED_WIDTH = {"qwen2-moe": 48, "glm4-moe": 32, "ernie4.5-moe": 32, "hunyuan-moe": 32}
BIASED = ("glm4-moe", "dots1", "exaone-moe", "solar-open", "ernie4.5-moe", "minimax-m2")
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


# The per-head (or all-heads) q/k norms' weights, by their families' names.
QK_NORMS = ("q_norm.weight", "k_norm.weight", "query_layernorm.weight", "key_layernorm.weight")


def build(name: str, dtype: torch.dtype = torch.float32, **changes: object):
    """A tiny random model of the family (its config with `changes`), its routers' biases and
    its q/k norms drawn (they start as zeros and ones) so that they count."""
    torch.manual_seed(0)
    config = FAMILIES[name]()
    for key, value in changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor_name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.3)
            elif tensor_name.endswith(QK_NORMS):
                tensor.normal_(1.0, 0.5)
    return model.to(dtype)


def sparse_layers(name: str) -> list[bool]:
    return [i not in DENSE_LAYERS.get(name, ()) for i in range(COMMON["num_hidden_layers"])]


def first_block(model) -> object:
    """The first layer's mixture-of-experts block."""
    blocks = (layer_mlp(layer) for layer in model.model.layers)
    return next(block for block in blocks if hasattr(block, "experts"))


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
    assert [layer.moe is not None for layer in paged.layers] == sparse_layers(name)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prompt_logprobs_equal_transformers(name):
    """Finer than greedy tokens: each prompt token's logprob as transformers scores it, the
    prompt in chunks of 8 (past EXAONE MoE's window)."""
    check_prompt_logprobs(build(name))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_block_computes_what_transformers_block_computes(name):
    model = build(name)
    torch.manual_seed(1)
    x = torch.randn(11, COMMON["hidden_size"])
    block = first_block(model)
    ours = SparseMoE(block)
    with torch.inference_mode():
        torch.testing.assert_close(ours(x), block(x[None])[0], rtol=1e-5, atol=1e-5)
        weights, experts = ours.route(x)
    assert experts.shape == (11, ours.top_k)
    assert isinstance(ours.own_router, BiasedRouter) == (name in BIASED)
    if isinstance(ours.own_router, BiasedRouter):  # renormalized, then scaled
        scale = torch.full((11,), ours.own_router.scale)
        torch.testing.assert_close(weights.sum(-1), scale)
    elif ours.renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(11))
    else:  # Qwen2-MoE's default: the top-k probabilities as they are
        assert bool((weights.sum(-1) < 1).all())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_block_in_bf16_equals_transformers_bit_for_bit(name):
    """The same routing in the same dtypes, and each row's weighted outputs summed in fp32 and
    cast once, as transformers' grouped experts do."""
    model = build(name, torch.bfloat16)
    torch.manual_seed(1)
    x = torch.randn(11, COMMON["hidden_size"], dtype=torch.bfloat16)
    block = first_block(model)
    with torch.inference_mode():
        torch.testing.assert_close(SparseMoE(block)(x), block(x[None])[0], rtol=0, atol=0)


def test_a_biased_router_chooses_by_the_bias_within_the_best_groups():
    """GLM-4.5's router: the bias moves the choice (not the weights), and every row's experts lie
    in its best two of four groups."""
    router = BiasedRouter.of(first_block(build("glm4-moe")))
    assert router is not None and (router.groups, router.top_groups) == (4, 2)
    torch.manual_seed(2)
    x = torch.randn(64, COMMON["hidden_size"])
    weights, experts = router.route(x)
    groups = experts // (8 // router.groups)
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    assert any(len(set(row.tolist())) == 2 for row in groups)
    scores = router.scores(x)
    expected = scores.gather(1, experts)
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True) * 2.5)
    bias = router.bias.clone()
    router.bias.zero_()
    unbiased = router.route(x)[1]
    router.bias.copy_(bias)
    assert not torch.equal(unbiased.sort(-1)[0], experts.sort(-1)[0])


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
    stacked = first_block(model).experts.gate_up_proj
    assert unfuse_experts(model) == sum(sparse_layers(name))
    experts = first_block(model).experts
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
    # A layer's experts run as one op in either form (over bf16 panels each expert's gate and
    # up became gated pairs).
    assert experts.grouped
    paired = form is LinearForm.BF16_PANELS
    assert all(isinstance(g, GatedPanelLinear) == paired for g in experts.gate_up)
    assert experts is core.runner.model.layers[0].moe.experts
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


def saved(name: str, folder: Path) -> Path:
    build(name).save_pretrained(folder, max_shard_size="200KB")
    chat_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "name",
    ["qwen2-moe", "glm4-moe"],
)
def test_two_ranks_split_the_experts_and_give_one_ranks_tokens(name, tmp_path):
    """Each rank holds its channels of every expert (read from the per-expert tensors of the
    checkpoint's files) and of the shared expert or experts; every rank routes alike (the other
    families' shares against the whole model's logits: `tests/parallel/test_sharding.py`)."""
    moe_dir = saved(name, tmp_path)
    expected = [reference_greedy(build(name), p, MAX_NEW) for p in prompts()]
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
            block = first_block(loaded.model)
            assert block.experts.intermediate == 32 // size
            shared = SparseMoE(block).shared_expert
            if name in SHARED_WIDTH:
                assert shared.down_proj.in_features == SHARED_WIDTH[name] // size
        finally:
            core.close()


def test_a_ranks_share_keeps_the_routers_bias_and_fp32_weight_as_transformers_loads(tmp_path):
    """A rank's share read from the checkpoint's files holds the routers' biases (buffers) and
    keeps the routers in fp32 in a bf16 model, as `from_pretrained` does."""
    folder = saved("glm4-moe", tmp_path)
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    share, _ = load_share(str(folder), torch.bfloat16, rank=1, size=2)
    ours, theirs = first_block(share).gate, first_block(whole).gate
    assert ours.weight.dtype == theirs.weight.dtype == torch.float32
    assert ours.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(ours.weight, theirs.weight)
    assert torch.equal(ours.e_score_correction_bias, theirs.e_score_correction_bias)
    assert bool(ours.e_score_correction_bias.abs().sum() > 0), "drawn, not the built zeros"
    assert first_block(share).experts.gate_up_proj.dtype == torch.bfloat16


def test_olmoes_clip_counts():
    """OLMoE's clamp of q and k after their norms: without it, other tokens."""
    model = build("olmoe")
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    model.config.clip_qkv = None
    assert [reference_greedy(model, p, MAX_NEW) for p in prompts()] != expected
    model.config.clip_qkv = 1.5
    tokens, core = engine_tokens(model)
    assert tokens == expected and core.runner.model.layers[0].clip == 1.5
