"""Qwen3.5's text models and Qwen3-Next on Conveyor's decoder: Gated DeltaNet layers whose
convolution inputs and recurrent state each request keeps in the state cache, between gated
attention layers; greedy tokens and prompt logprobs equal transformers', under chunked prefill,
preemption and mixed steps."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3NextConfig
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.models.qwen3_5 import (
    GatedAttentionLayer,
    GatedDeltaNetLayer,
    PagedQwen3_5ForCausalLM,
    input_projections,
)
from tests.helpers import (
    check_prompt_logprobs,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_tokenizer,
    tokens_of,
)
from tests.models.recurrent import prompts, served_under_pressure
from tests.models.test_model_families import COMMON

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


# Both kinds' shape: DeltaNet heads of 8 key and 12 value dims, two value heads a key head.
SHAPE = COMMON | dict(
    num_hidden_layers=len(LAYER_TYPES),
    head_dim=16,
    layer_types=LAYER_TYPES,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
# Qwen3.5's experts in every layer (8, 3 a token) beside a gated shared expert.
EXPERTS = dict(
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


# Each kind's config: Qwen3.5 dense and with experts; Qwen3-Next (its DeltaNet's projections
# grouped by key head), experts in every layer but the second.
KINDS = {
    "dense": lambda: Qwen3_5TextConfig(**SHAPE),
    "moe": lambda: Qwen3_5MoeTextConfig(**SHAPE, **EXPERTS),
    "next": lambda: Qwen3NextConfig(**SHAPE, **EXPERTS, mlp_only_layers=[1]),
}
ARCHITECTURES = {
    "dense": "Qwen3_5ForCausalLM",
    "moe": "Qwen3_5MoeForCausalLM",
    "next": "Qwen3NextForCausalLM",
}
SPARSE = {"dense": [False] * 4, "moe": [True] * 4, "next": [True, False, True, True]}


def build(kind: str = "dense"):
    """A tiny random model of the kind, its norms (zero-centred: ones added) and decays drawn so
    they count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(KINDS[kind]()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(0.0, 0.3)
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 1.0)
    return model


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_matches_generate_under_chunking_and_preemption(kind):
    model = build(kind)
    assert type(model).__name__ == ARCHITECTURES[kind]
    core = served_under_pressure(model, MAX_NEW)
    paged = core.runner.model
    assert isinstance(paged, PagedQwen3_5ForCausalLM)
    kinds = [
        GatedDeltaNetLayer if k == "linear_attention" else GatedAttentionLayer for k in LAYER_TYPES
    ]
    assert [type(layer) for layer in paged.layers] == kinds
    assert core.runner.kv_cache.spec.num_layers == 1
    assert [layer.moe is not None for layer in paged.layers] == SPARSE[kind]
    shapes = [tuple(s.shape) for s in core.runner.kv_cache.states.layers]
    assert shapes == [(64, 3, 2 * 16 + 48), (64, 4, 8, 12)] * 3


def test_a_prompt_longer_than_a_chunk_of_the_rule():
    """A prompt run in one step over several of the delta rule's chunks of 64 tokens."""
    model = build()
    prompt = [random.Random(7).randrange(2, 320) for _ in range(150)]
    core, _ = tiny_core(model, max_model_len=200)
    outputs = run_all(core, [prompt], GREEDY)
    assert tokens_of(outputs["req-0"]) == reference_greedy(model, prompt, MAX_NEW)


@pytest.mark.parametrize("kind", ["dense", "next"])
def test_prompt_logprobs_equal_transformers(kind):
    check_prompt_logprobs(build(kind), chunk=7, length=30)


def test_qwen3_next_projections_regrouped_as_qwen3_5s():
    """Qwen3-Next's rows grouped by key head (q, k, v, z; b, a) come out in Qwen3.5's order, each
    part by heads in turn, as transformers' own split orders them."""
    net = build("next").model.layers[0].linear_attn
    hidden = torch.randn(5, SHAPE["hidden_size"])
    parts = [p(hidden) for p in input_projections(net)]
    q, k, v, z, b, a = net.fix_query_key_value_ordering(
        net.in_proj_qkvz(hidden)[None], net.in_proj_ba(hidden)[None]
    )
    expected = [x[0].reshape(5, -1) for x in (q, k, v, z, b, a)]
    for got, want in zip(parts, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_torch_decode_rows_equal_transformers_recurrent_rule():
    """Rows of one token each through the rule in torch's ops (the route off the CPU; the CPU
    kernel's own checks are in tests/kernels/test_delta_rule.py), each over its slot's state,
    against transformers' token-by-token reference (two value heads a key head)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    from engine.models.qwen3_5 import decode_rows_torch

    torch.manual_seed(2)
    rows, key_heads, heads, key_dims, value_dims = 3, 2, 4, 8, 6
    q, k = (torch.randn(rows, key_heads, key_dims) for _ in range(2))
    v = torch.randn(rows, heads, value_dims)
    g, beta = -torch.rand(rows, heads), torch.rand(rows, heads)
    states = torch.randn(rows + 2, heads, key_dims, value_dims)
    slots = [3, 0, 4]  # each row's slot among the states
    expected, held = torch_recurrent_gated_delta_rule(
        *(t[:, None] for t in (q, k, v, g, beta)),
        initial_state=states[slots].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    untouched = states[[1, 2]].clone()
    out = decode_rows_torch(q, k, v, g, beta, states, slots)
    torch.testing.assert_close(out, expected[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[slots], held, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[[1, 2]], untouched)


@pytest.mark.parametrize("tokens", [5, 64, 150])
def test_prompt_rows_equal_transformers_chunked_rule(tokens):
    """A prompt chunk through the rule by chunks of 64 tokens, from a state it updates in
    place, against transformers' chunked reference (two value heads a key head)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from engine.models.qwen3_5 import prompt_rows

    torch.manual_seed(3)
    key_heads, heads, key_dims, value_dims = 2, 4, 8, 6
    q, k = (torch.randn(tokens, key_heads, key_dims) for _ in range(2))
    v = torch.randn(tokens, heads, value_dims)
    g, beta = -2 * torch.rand(tokens, heads), torch.rand(tokens, heads)
    state = torch.randn(heads, key_dims, value_dims)
    expected, held = torch_chunk_gated_delta_rule(
        *(t[None] for t in (q, k, v, g, beta)),
        initial_state=state[None].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out = prompt_rows(q, k, v, g, beta, state)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, held[0], rtol=1e-5, atol=1e-5)


def test_prompts_of_one_length_run_the_rule_together():
    """Prompts of the same length in one step run the chunked rule as one, each row from its own
    state: the same tokens as each alone."""
    model = build()
    rng = random.Random(8)
    same = [[rng.randrange(2, 320) for _ in range(9)] for _ in range(3)]
    expected = [reference_greedy(model, p, MAX_NEW) for p in same]
    core, _ = tiny_core(model)
    outputs = run_all(core, same, GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(3)] == expected


def test_a_saved_qwen3_next_serves_from_its_folder(tmp_path):
    """A Qwen3-Next checkpoint as saved (its experts and grouped projections as written) serves
    from its folder with transformers' tokens."""
    model = build("next")
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
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
