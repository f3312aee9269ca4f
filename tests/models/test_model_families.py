"""Other decoder-only families run unchanged through the paged attention, and models load from a
local folder."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    ApertusConfig,
    ArceeConfig,
    AutoModelForCausalLM,
    CwmConfig,
    Ernie4_5Config,
    Exaone4Config,
    Glm4Config,
    GlmConfig,
    GraniteConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    Jais2Config,
    MinistralConfig,
    MistralConfig,
    NanoChatConfig,
    Olmo2Config,
    Olmo3Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SeedOssConfig,
    SmolLM3Config,
    StableLmConfig,
    Starcoder2Config,
)

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.fused_decode import DecodeRoute, why_not_fused
from engine.models import build_causal_lm
from engine.models.llama import PagedLlamaForCausalLM, supports
from tests.helpers import (
    TINY_SHAPE,
    check_prompt_logprobs,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_tokenizer,
    tokens_of,
)

COMMON = dict(
    **TINY_SHAPE | dict(max_position_embeddings=256),
    eos_token_id=0,
    bos_token_id=1,
    pad_token_id=0,
)

FAMILIES = {
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=False),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, use_sliding_window=False),
    # The second layer a NoPE one: no rotary embedding of its q and k.
    "smollm3": lambda: SmolLM3Config(**COMMON, no_rope_layers=[1, 0], use_sliding_window=False),
    # q/k/v and gate/up each one projection; Phi-4-mini's shape rotates 3/4 of each head and
    # ties its embeddings.
    "phi3": lambda: Phi3Config(**COMMON, tie_word_embeddings=False),
    "phi4_mini": lambda: Phi3Config(**COMMON, partial_rotary_factor=0.75, tie_word_embeddings=True),
    # Granite 3's scalars (its 2B's): embeddings, scores, residual adds and logits scaled.
    "granite": lambda: GraniteConfig(
        **COMMON,
        embedding_multiplier=12.0,
        attention_multiplier=0.0078125,
        residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
    # Norms after the attention and the MLP, q and k normed over all their heads.
    "olmo2": lambda: Olmo2Config(**COMMON),
    # OLMo 2's layer, the sliding ones windowed, each layer type rotated by its own frequencies.
    "olmo3": lambda: Olmo3Config(
        **COMMON,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 50.0},
        },
    ),
    # Half of each head turned in neighbouring pairs, gate and up one projection, q/k/v biases;
    # GLM-4-0414's outputs normed again before the residual.
    "glm": lambda: GlmConfig(**COMMON, head_dim=16, attention_bias=True),
    "glm4": lambda: Glm4Config(**COMMON, head_dim=16, attention_bias=True),
    # Windows on some layers only (a few tokens, so the prompts outgrow them).
    "ministral": lambda: MinistralConfig(
        **COMMON, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]
    ),
    "cwm": lambda: CwmConfig(
        **COMMON, head_dim=16, sliding_window=6, layer_types=["full_attention", "sliding_attention"]
    ),
    # Biases on q, k, v and o.
    "seed_oss": lambda: SeedOssConfig(
        **COMMON, head_dim=16, attention_bias=True, attention_out_bias=True
    ),
    # OLMo 2's norms after the attention and the MLP, each q and k head normed; in the hybrid
    # shape, windows on the sliding layers and no rotary on the global ones.
    "exaone4": lambda: Exaone4Config(
        **COMMON, head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]
    ),
    "exaone4_global": lambda: Exaone4Config(
        **COMMON, head_dim=16, sliding_window=None, layer_types=["full_attention"] * 2
    ),
    # Each q and k head normed after the rotary.
    "hunyuan": lambda: HunYuanDenseV1Config(**COMMON, head_dim=16),
    # The whole head turned in neighbouring pairs; biases on every projection.
    "ernie4_5": lambda: Ernie4_5Config(**COMMON, head_dim=16, use_bias=True),
    # The whole head turned in neighbouring pairs; norms scaled in fp32.
    "helium": lambda: HeliumConfig(**COMMON, head_dim=16),
    # MLPs without a gate: ReLU² (Arcee), xIELU with each q and k head normed (Apertus).
    "arcee": lambda: ArceeConfig(**COMMON),
    "apertus": lambda: ApertusConfig(**COMMON, head_dim=16),
    # Norms without weights (the embeddings' too, and each q and k head's after the rotary),
    # fc1 and fc2 without a gate, soft-capped logits.
    "nanochat": lambda: NanoChatConfig(**COMMON, head_dim=16, final_logit_softcapping=2.0),
    # LayerNorms with biases: with a gateless MLP (Jais 2), a quarter of each head rotated and
    # q/k/v biases (StableLM), a gateless MLP and windows (StarCoder 2).
    "jais2": lambda: Jais2Config(**COMMON, head_dim=16),
    "stablelm": lambda: StableLmConfig(**COMMON, partial_rotary_factor=0.25, use_qkv_bias=True),
    "starcoder2": lambda: Starcoder2Config(**COMMON, sliding_window=6, use_bias=True),
}
# Parameters transformers initialises to constants, drawn so that they count (by the end of
# their names: mean and spread): Seed-OSS's biases, Hunyuan's per-head norms (a norm of ones
# commutes with the rotary).
DRAWN = {
    "seed_oss": {"bias": (0.0, 0.2)},
    "ernie4_5": {"bias": (0.0, 0.2)},
    **{family: {"bias": (0.0, 0.2)} for family in ("jais2", "stablelm", "starcoder2")},
    "hunyuan": {"query_layernorm.weight": (1.0, 0.5), "key_layernorm.weight": (1.0, 0.5)},
}


def build(family: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            for suffix, (mean, spread) in DRAWN.get(family, {}).items():
                if name.endswith(suffix):
                    parameter.normal_(mean, spread)
    return model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_greedy_matches_generate(family):
    model = build(family)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 9, 17, 30)]
    core, _ = tiny_core(model, num_blocks=40, max_model_len=128, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = run_all(core, prompts, params)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 10), family
    assert core.scheduler.block_manager.num_used_blocks == 0
    assert isinstance(core.runner.model, PagedLlamaForCausalLM), "on Conveyor's decoder"
    layers = core.runner.model.layers
    windows = [layer.attention.window if layer.attention else None for layer in layers]
    kinds = getattr(model.config, "layer_types", None) or []
    window = getattr(model.config, "sliding_window", None)
    if "sliding_attention" in kinds:  # each layer's own window, or none
        assert windows == [window if kind == "sliding_attention" else None for kind in kinds]


@pytest.mark.parametrize("family", ["arcee", "apertus"])
def test_a_gateless_mlp_decodes_op_by_op_and_adapts_its_up_and_down(family):
    paged = PagedLlamaForCausalLM(build(family))
    layer = paged.layers[0]
    assert not layer.gated and why_not_fused(layer) == "an MLP without a gate"
    shapes = layer.lora_shapes()
    assert "down_proj" in shapes and "up_proj" in shapes and "gate_proj" not in shapes


@pytest.mark.parametrize(
    "family",
    [
        "ministral",
        "cwm",
        "seed_oss",
        "exaone4",
        "hunyuan",
        "ernie4_5",
        "helium",
        "olmo3",
        "arcee",
        "apertus",
        "nanochat",
        "jais2",
        "stablelm",
        "starcoder2",
    ],
)
def test_prompt_logprobs_equal_transformers(family):
    """Finer than greedy tokens: each prompt token's logprob as transformers scores it (past
    the windows; nanochat's through its soft cap)."""
    check_prompt_logprobs(build(family))


@pytest.mark.parametrize(
    ("flag", "reason"),
    [("use_parallel_residual", "parallel residual"), ("qk_layernorm", "LayerNormed")],
)
def test_stablelm_layouts_the_decoder_does_not_compute_are_refused_with_the_reason(flag, reason):
    """StableLM's parallel residual (attention and MLP side by side) and per-head q/k
    LayerNorms are not the Llama layer's: Conveyor's decoder names them, and the start refuses
    the model with the reason rather than failing each request."""
    torch.manual_seed(0)
    config = StableLmConfig(**COMMON, partial_rotary_factor=0.25, **{flag: True})
    model = AutoModelForCausalLM.from_config(config).eval()
    assert reason in supports(model)
    # transformers' StableLM layers cannot take the paged attention either: refused at start-up.
    with pytest.raises(ValueError, match=f"Conveyor's model implementation only.*{reason}"):
        build_causal_lm(model)


def test_qwen2_attention_bias_is_used():
    model = build("qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_model_loads_from_a_local_folder(tmp_path):
    model = build("qwen3")
    tokenizer = tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        device="cpu",
        cache=CacheConfig(num_blocks=64, block_size=8),
    )
    core, loaded, info = create_engine_core(config)
    assert info.model_name == str(tmp_path) and info.max_model_len == 256
    assert info.num_blocks == 64 and info.dtype == "float32"
    prompt = tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = run_all(core, [prompt], params)["req-0"]
    assert tokens_of(outputs) == reference_greedy(model, prompt, 6)
    assert loaded.tokenizer.decode(tokens_of(outputs)) == "".join(o.text for o in outputs)


def test_smollm3s_nope_layers_run_on_conveyors_decoder_and_matter():
    """Prompt logprobs equal transformers' (finer than greedy tokens), on Conveyor's decoder
    (whose fused decode takes the NoPE layer too, `tests/kernels/test_decode_layer.py`); the same
    weights with every layer rotated score otherwise."""
    model = build("smollm3")
    rng = random.Random(3)
    prompt = [rng.randrange(2, 320) for _ in range(24)]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
        roped = build("smollm3")
        roped.config.no_rope_layers = [1, 1]
        for layer in roped.model.layers:
            layer.self_attn.use_rope = True
        rotated = torch.log_softmax(roped(torch.tensor([prompt])).logits[0], dim=-1)
    core, _ = tiny_core(model, max_num_batched_tokens=8)
    assert isinstance(core.runner.model, PagedLlamaForCausalLM)
    nope = core.runner.model.layers[1]
    assert not nope.rotates and why_not_fused(nope) == "projections not in Conveyor's panels"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    entries = [e for o in run_all(core, [prompt], params)["req-0"] for e in o.prompt_logprobs or []]
    got = torch.tensor([e.logprob for e in entries[1:]])
    index = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    torch.testing.assert_close(got, expected[index], atol=1e-4, rtol=1e-4)
    assert (rotated[index] - expected[index]).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("family", "op_by_op"),
    [
        ("phi3", ""),
        ("phi4_mini", ""),
        ("granite", ""),
        ("olmo2", ""),
        ("glm4", ""),
        ("stablelm", "LayerNorms"),
    ],
)
def test_families_load_from_a_folder_into_their_routes(tmp_path, family, op_by_op):
    """From a folder, as served, on Conveyor's decoder over its linear forms: Phi-3's one q/k/v
    and one gate/up projection taken as they are, its full rotary, Phi-4-mini's partial one and
    Granite's scaled residual adds, OLMo 2's moved norms and GLM-4's paired rotary decoding
    through the fused stack where it is built; StableLM's LayerNorms op by op; greedy tokens
    are transformers'."""
    model = build(family)
    tokenizer = tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), dtype="float32", device="cpu")
    core, _, _ = create_engine_core(config)
    layer = core.runner.model.layers[0]
    assert isinstance(core.runner.model, PagedLlamaForCausalLM)
    assert layer.qkv_proj.out_features == (4 + 2 * 2) * 16  # q, k and v heads as held
    reason = why_not_fused(layer)
    if op_by_op:
        assert op_by_op in reason
    elif cpu_ops.has("fused_decode"):
        assert reason == ""
        assert core.runner.model.fused_decode.route is DecodeRoute.STACK
    else:  # a machine without the kernels (no compiler, not x86-64) decodes op by op
        assert reason == "the fused_decode kernels are not built"
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (4, 19)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = run_all(core, prompts, params)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 8)


def test_two_ranks_serve_phi3s_fused_projections(tmp_path):
    """From a folder, each rank reading its share of Phi-3's q/k/v and gate/up part by part;
    greedy tokens are transformers' (every family's share against the whole model's logits:
    `tests/parallel/test_sharding.py`)."""
    model = build("phi3")
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (4, 19, 9)]
    expected = [reference_greedy(model, prompt, 8) for prompt in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        tensor_parallel_size=2,
        cache=CacheConfig(block_size=4, num_blocks=64),
    )
    core, _, _ = create_engine_core(config)
    try:
        layer = core.runner.model.layers[0]
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        outputs = run_all(core, prompts, params)
        assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected
    finally:
        core.close()
