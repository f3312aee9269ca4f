"""Nemotron-H (`NemotronHForCausalLM`) on Conveyor's decoder: blocks that each add one mixer to the
residual (Mamba2 with its states in the state cache, NoPE attention over the paged cache, a
gateless squared-ReLU MLP, or gateless experts chosen by sigmoid scores plus a bias beside a
shared expert, in a latent width where the config names one); greedy tokens and prompt logprobs
equal transformers', under chunked prefill, preemption and mixed steps."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, NemotronHConfig

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.models import build_causal_lm
from engine.models.experts import ExpertLinears, SparseMoE
from engine.models.nemotron_h import (
    NemotronAttentionBlock,
    NemotronMambaBlock,
    NemotronMlpBlock,
    PagedNemotronHForCausalLM,
)
from engine.models.routing import BiasedRouter
from engine.worker.compilation import why_not_compiled
from tests.helpers import (
    check_prompt_logprobs,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_tokenizer,
    tokens_of,
)
from tests.models.recurrent import drawn_mamba2, prompts, served_under_pressure
from tests.models.test_model_families import COMMON

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
M, ATTN, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"

# Mamba2 of 8 heads of 16 dims (twice the hidden size), two groups of 8 state dims; eight
# experts in two groups, two a token.
SHAPE = {k: v for k, v in COMMON.items() if k != "num_hidden_layers"} | dict(
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=8,
    conv_kernel=4,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    routed_scaling_factor=1.5,
)
# Nemotron-H's and Nemotron Nano 2's blocks (Mamba2, MLPs, attention), Nemotron 3 Nano's
# (experts in the MLPs' place) and Nemotron 3 Super's (its experts in a latent width).
BLOCKS = {
    "dense": [M, MLP, ATTN, MLP, M, M, MLP],
    "experts": [M, MOE, ATTN, MOE, M, M, MOE],
    "latent": [M, MOE, ATTN, MOE, M, M, MOE],
}
KINDS = {
    "dense": lambda: NemotronHConfig(**SHAPE, layers_block_type=BLOCKS["dense"]),
    "experts": lambda: NemotronHConfig(**SHAPE, layers_block_type=BLOCKS["experts"]),
    "latent": lambda: NemotronHConfig(
        **SHAPE, layers_block_type=BLOCKS["latent"], moe_latent_size=24
    ),
}


def build(kind: str = "experts"):
    """A tiny random Nemotron-H, its norms, steps, decays, skips and routers' biases drawn so
    they count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(KINDS[kind]()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return drawn_mamba2(model)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_matches_generate_under_chunking_and_preemption(kind):
    model = build(kind)
    core = served_under_pressure(model, MAX_NEW)
    paged = core.runner.model
    assert isinstance(paged, PagedNemotronHForCausalLM)
    classes = {M: NemotronMambaBlock, ATTN: NemotronAttentionBlock}
    assert [type(layer) for layer in paged.layers] == [
        classes.get(b, NemotronMlpBlock) for b in BLOCKS[kind]
    ]
    assert [layer.moe is not None for layer in paged.layers] == [b == MOE for b in BLOCKS[kind]]
    # One attention block's K/V in the cache; three Mamba2 blocks' states.
    assert core.runner.kv_cache.spec.num_layers == 1
    shapes = [tuple(s.shape) for s in core.runner.kv_cache.states.layers]
    # The convolution's last 3 inputs of x, B and C (128 + 2 * 2 * 8 channels); 8 x 16 x 8.
    assert shapes == [(64, 3, 160), (64, 8, 16, 8)] * 3


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prompt_logprobs_equal_transformers(kind):
    check_prompt_logprobs(build(kind), chunk=7, length=30)


def test_experts_run_without_a_gate_from_a_biased_router_in_the_latent_width():
    """Nemotron 3's experts: an up projection alone in each expert, chosen within the best group
    by sigmoid scores plus a bias, over the rows projected into the latent width; the block's
    output is transformers' block's."""
    model = build("latent")
    block = model.model.layers[1].mixer
    moe = SparseMoE(block)
    assert isinstance(moe.own_router, BiasedRouter) and moe.own_router.groups == 2
    assert isinstance(moe.experts, ExpertLinears) and not moe.experts.gated
    assert moe.into_latent is block.fc1_latent_proj and moe.from_latent is block.fc2_latent_proj
    rows = torch.randn(11, 64)
    with torch.no_grad():
        torch.testing.assert_close(moe(rows), block(rows[None])[0], atol=1e-5, rtol=1e-5)


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    """A Nemotron 3 Nano-shaped checkpoint as published (its tensors under `backbone.`, each
    expert's apart; its blocks as a `hybrid_override_pattern`) serves from its folder with
    transformers' tokens."""
    model = build()
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in saved.keys()  # noqa: SIM118
    written = json.loads((tmp_path / "config.json").read_text())
    assert written.pop("layers_block_type") == BLOCKS["experts"]
    written["hybrid_override_pattern"] = "ME*EMME"
    (tmp_path / "config.json").write_text(json.dumps(written))
    config = EngineConfig(
        model=str(tmp_path), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64)
    )
    core, _, _ = create_engine_core(config)
    try:
        outputs = run_all(core, prompts(), GREEDY)
        tokens = [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))]
        assert tokens == [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    finally:
        core.close()


def test_blocks_without_mamba_serve_uncompiled_on_one_device():
    """Attention and MLP blocks alone: no recurrent state, each attention block's K/V in the
    cache; the MLP blocks are no layer an attention call cuts, so the layers are not compiled;
    transformers' layers cannot take the paged attention."""
    config = NemotronHConfig(**SHAPE, layers_block_type=[ATTN, MLP, ATTN, MLP])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    core, _ = tiny_core(model)
    outputs = run_all(core, prompts(), GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    assert core.runner.kv_cache.spec.num_layers == 2
    paged = core.runner.model
    assert isinstance(paged, PagedNemotronHForCausalLM) and not paged.state_specs()
    assert "not cut at an attention call" in why_not_compiled(paged)
    with pytest.raises(ValueError, match="Conveyor's model implementation only"):
        build_causal_lm(model, "transformers")
