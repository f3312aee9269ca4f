"""DeepSeek V3 (and GLM-4.7-Flash, its layers) and DeepSeek V2 on Conveyor's decoder: multi-head
latent attention over a cache of one latent row a token, in the absorbed form, and experts chosen
by a bias (V3) or within the best groups (V2) beside shared experts. Greedy tokens and prompt
logprobs equal transformers' (its attention over the keys and values expanded from the
latent)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kv.kv_cache import KVCache, KVCacheSpec
from engine.models import build_causal_lm
from engine.models.deepseek import PagedDeepseekForCausalLM, PagedDeepseekLayer
from engine.models.routing import GroupLimitedRouter
from tests.conftest import TRITON_DEVICE, needs_triton
from tests.core.test_engine_greedy import record_chunking
from tests.helpers import (
    chat_tokenizer,
    check_prompt_logprobs,
    reference_greedy,
    run_all,
    tiny_core,
    tokens_of,
)
from tests.models.test_moe import COMMON

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# The latent's width and the rotated part's: a cache row of 64 dims (the C++ prefill kernel's
# multiple of 16), against 4 heads x (16 + 8 key dims + 12 value dims) expanded.
RANK, ROPE = 56, 8


def config(
    q_lora_rank: int | None = None,
    interleave: bool = True,
    yarn: bool = False,
    glm: bool = False,
    v2: str = "",
    rank: int = RANK,
):
    rope = (
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0}
        | {"mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
        if yarn
        else {"rope_type": "default", "rope_theta": 10000.0}
    )
    shape = dict(
        **COMMON | {"num_key_value_heads": COMMON["num_attention_heads"]},
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        n_shared_experts=1,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=rank,
        qk_nope_head_dim=16,
        qk_rope_head_dim=ROPE,
        v_head_dim=12,
        rope_parameters=rope,
    )
    if v2:  # its rotary pairs dims in place; `v2` names its router's method
        return DeepseekV2Config(**shape, head_dim=ROPE, topk_method=v2)
    kind = Glm4MoeLiteConfig if glm else DeepseekV3Config
    return kind(**shape, rope_interleave=interleave)


def build(**options: object):
    """A tiny random DeepSeek V3, its routers' biases and latent norms drawn so they count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(**options)).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.3)
            elif name.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight")):
                tensor.normal_(1.0, 0.3)
    return model


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 9, 17, 30, 1, 24)]


VARIANTS = {
    "q-whole-interleaved": {},
    "q-low-rank-halves": {"q_lora_rank": 24, "interleave": False},
    "yarn": {"q_lora_rank": 24, "yarn": True},
    "glm-4.7-flash": {"q_lora_rank": 24, "glm": True},
    "v2-greedy": {"v2": "greedy"},
    "v2-group-limited": {"q_lora_rank": 24, "v2": "group_limited_greedy"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_generate_under_chunking_and_preemption(variant):
    model = build(**VARIANTS[variant])
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    core, _ = tiny_core(model, num_blocks=24, max_model_len=64, max_num_batched_tokens=10)
    chunked = record_chunking(core)
    outputs = run_all(core, prompts(), GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    assert core.scheduler.num_preemptions > 0 and any(chunked)
    assert core.scheduler.block_manager.num_used_blocks == 0
    paged = core.runner.model
    assert isinstance(paged, PagedDeepseekForCausalLM)
    assert [layer.moe is not None for layer in paged.layers] == [False, True, True]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prompt_logprobs_equal_transformers(variant):
    """Finer than greedy tokens: each prompt token's logprob as transformers scores it, the
    prompt in chunks of 8 over the latent cache."""
    check_prompt_logprobs(build(**VARIANTS[variant]))


def test_the_cache_holds_one_latent_row_a_token():
    """One plane a layer, read as both keys and values, written once."""
    spec = KVCacheSpec.from_hf_config(config(), torch.bfloat16, 16)
    assert (spec.num_kv_heads, spec.head_dim, spec.values_are_keys) == (1, RANK + ROPE, True)
    assert spec.bytes_per_token == 3 * (RANK + ROPE) * 2  # one row, 3 layers, bf16
    cache = KVCache(spec, 4, torch.device("cpu"))
    assert cache.tensor.shape[:2] == (3, 1) and cache.num_bytes == 4 * 16 * spec.bytes_per_token
    assert cache.key(1).data_ptr() == cache.value(1).data_ptr()
    rows = torch.randn(2, 1, RANK + ROPE)
    cache.write(1, torch.tensor([5, 17]), rows, torch.zeros_like(rows))  # the value is not read
    torch.testing.assert_close(
        cache.value(1).view(-1, 1, RANK + ROPE)[[5, 17]].float(), rows, rtol=1e-2, atol=1e-2
    )
    expanded = COMMON["num_attention_heads"] * ((16 + ROPE) + 12)  # each head's key and value
    assert expanded > RANK + ROPE


def test_the_absorbed_scores_equal_the_expanded_ones():
    """Each head's query in the latent's space against the latent row gives transformers'
    `q . k` over the key expanded from the latent (the same sums, grouped otherwise)."""
    model = build(q_lora_rank=24)
    attn = model.model.layers[0].self_attn
    layer = PagedDeepseekLayer(model.model.layers[0], 0)
    torch.manual_seed(4)
    x = torch.randn(5, COMMON["hidden_size"])
    cos, sin = torch.ones(5, 1, ROPE), torch.zeros(5, 1, ROPE)  # position 0: nothing turns
    with torch.no_grad():
        query, key, value = layer.project_qkv(x, cos, sin)
        ours = torch.einsum("thd,sd->hts", query, key[:, 0])
        normed = model.model.layers[0].input_layernorm(x)
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(normed))).view(5, 4, 24)
        latent, k_rot = attn.kv_a_proj_with_mqa(normed).split([RANK, ROPE], dim=-1)
        k_nope = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(5, 4, 28)[..., :16]
        k = torch.cat([k_nope, k_rot[:, None].expand(5, 4, ROPE)], dim=-1)
        theirs = torch.einsum("thd,shd->hts", q, k)
    assert torch.equal(value, key) and key.shape == (5, 1, RANK + ROPE)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    model = build(q_lora_rank=24)
    model.save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    core, _, _ = create_engine_core(
        EngineConfig(
            model=str(tmp_path), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64)
        )
    )
    try:
        assert core.runner.kv_cache.spec.head_dim == RANK + ROPE
        outputs = run_all(core, prompts(), GREEDY)
        tokens = [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))]
        assert tokens == [reference_greedy(build(q_lora_rank=24), p, MAX_NEW) for p in prompts()]
    finally:
        core.close()


def test_transformers_layers_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="Conveyor's model implementation only"):
        build_causal_lm(build(), "transformers")


def test_two_ranks_split_the_heads_and_keep_the_latent_whole(tmp_path):
    """Each rank reads its heads' rows of q and `kv_b_proj` and columns of o from the folder,
    and keeps the latent's projection, norm and cache whole; greedy tokens are transformers'
    (DeepSeek V2's and V3's shares against the whole model's logits:
    `tests/parallel/test_sharding.py`)."""
    model = build(**VARIANTS["glm-4.7-flash"])
    model.save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    engine_config = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        tensor_parallel_size=2,
        cache=CacheConfig(block_size=4, num_blocks=64),
    )
    core, _, _ = create_engine_core(engine_config)
    try:
        layer = core.runner.model.layers[0]
        assert layer.num_heads == 2 and layer.value_rows.shape[0] == 2
        spec = core.runner.kv_cache.spec
        assert (spec.num_kv_heads, spec.head_dim) == (1, RANK + ROPE)
        outputs = run_all(core, prompts(), GREEDY)
        assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    finally:
        core.close()


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2s_router_chooses_and_weighs_as_transformers(method):
    """A softmax's top-k, scaled and not renormalized; limited to each row's best two of four
    groups (by their best score) where the method says so."""
    block = build(v2=method).model.layers[1].mlp
    router = GroupLimitedRouter.of(block)
    assert router is not None and router.groups == (4 if method != "greedy" else 1)
    torch.manual_seed(5)
    x = torch.randn(64, COMMON["hidden_size"])
    weights, experts = router.route(x)
    _, their_weights, their_experts = block.gate(x)
    order, their_order = experts.argsort(-1), their_experts.argsort(-1)
    assert torch.equal(experts.gather(1, order), their_experts.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order))
    assert bool((weights.sum(-1) < 2.5).all()), "scaled top-k probabilities, not renormalized"
    if method != "greedy":
        assert all(len(set((row // 2).tolist())) <= 2 for row in experts)


@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=needs_triton)])
def test_each_attention_backend_attends_over_the_latent_cache(backend):
    """One KV head of latent rows, read as keys and values, on every backend (`triton` on the
    GPU where there is one, else in Triton's interpreter), 48 dims wide (not a power of two, as
    DeepSeek V3's 576 is not)."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    model = build(q_lora_rank=24, rank=40).to(device)
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()[:4]]
    core, _ = tiny_core(
        model,
        num_blocks=24,
        max_model_len=64,
        max_num_batched_tokens=10,
        attention_backend=backend,
        device=device,
    )
    outputs = run_all(core, prompts()[:4], GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(4)] == expected
    assert core.runner.backend.name == backend


def test_a_cached_prefix_is_read_back_from_the_latent_cache():
    """A prompt sharing a long prefix with a finished one reads that prefix's latent rows from
    the cache (its blocks kept by prefix caching) and still gives transformers' tokens."""
    model = build(q_lora_rank=24)
    prefix = prompts()[3]
    first, second = [*prefix, 5, 9], [*prefix, 70, 11, 90]
    core, _ = tiny_core(model, enable_prefix_caching=True)
    outputs = run_all(core, [first], GREEDY)
    assert tokens_of(outputs["req-0"]) == reference_greedy(model, first, MAX_NEW)
    outputs = run_all(core, [second], GREEDY)
    assert outputs["req-0"][-1].num_cached_tokens > 0
    assert tokens_of(outputs["req-0"]) == reference_greedy(model, second, MAX_NEW)
