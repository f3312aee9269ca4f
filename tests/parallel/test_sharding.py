"""One rank's share of a model, and the sharded layers against the whole model: the ranks run
as threads of this process over a real gloo group, so the collectives are the ones served."""

from __future__ import annotations

import copy
import importlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Exaone4Config,
    FalconH1Config,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4Config,
    GlmConfig,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeHybridConfig,
    GraniteMoeSharedConfig,
    HunYuanDenseV1Config,
    JambaConfig,
    Lfm2Config,
    LlamaConfig,
    MiniMaxM2Config,
    MixtralConfig,
    NanoChatConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoeConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Starcoder2Config,
)

from engine.core.config import CacheConfig, EngineConfig
from engine.factory import build_rank
from engine.loading.model_loader import wrap_model
from engine.models import build_causal_lm
from engine.parallel.group import ParallelGroup, connect
from engine.parallel.layers import SplitHeadsNorms
from engine.parallel.loading import load_share
from engine.parallel.sharding import Shard, ShardShape, shard_model, why_not_shardable
from engine.worker.input_batch import InputBatch
from engine.worker.model_runner import model_inputs
from tests.models import test_mamba

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=0,
    bos_token_id=1,
    pad_token_id=0,
)
LATENT = dict(
    vocab_size=320,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    n_shared_experts=1,
    kv_lora_rank=56,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)


# vocab_size 321 leaves the last rank's vocabulary share one row of padding; one KV head is
# kept by both ranks; Qwen2 has q/k/v biases, Qwen3 per-head q/k norms.
def family(name: str, make: Callable[[Any], Any], **overrides: Any) -> Callable[[], Any]:
    """A config of the shape the family's own tests use (`make(tests.models.test_<name>)`),
    with `overrides` set on it."""

    def config() -> Any:
        made = make(importlib.import_module(f"tests.models.test_{name}"))
        for key, value in overrides.items():
            setattr(made, key, value)
        return made

    return config


def falcon_h1(kind: str) -> Callable[[Any], Any]:
    return lambda m: FalconH1Config(**m.SHAPE, **m.KINDS[kind])


MODELS = {
    "llama": lambda: LlamaConfig(**COMMON, vocab_size=320, num_key_value_heads=2),
    "llama-odd-vocab": lambda: LlamaConfig(**COMMON, vocab_size=321, num_key_value_heads=2),
    "llama-one-kv-head": lambda: LlamaConfig(**COMMON, vocab_size=320, num_key_value_heads=1),
    "llama-tied": lambda: LlamaConfig(
        **COMMON, vocab_size=320, num_key_value_heads=4, tie_word_embeddings=True
    ),
    "qwen2-biases": lambda: Qwen2Config(
        **COMMON, vocab_size=320, num_key_value_heads=2, use_sliding_window=False
    ),
    "qwen3": lambda: Qwen3Config(
        **COMMON, vocab_size=320, num_key_value_heads=2, head_dim=16, use_sliding_window=False
    ),
    # Experts: Mixtral's; Qwen2-MoE's with a shared expert and a dense layer; Qwen3-MoE's.
    "mixtral": lambda: MixtralConfig(
        **COMMON, vocab_size=320, num_key_value_heads=2, num_local_experts=4
    ),
    "qwen2-moe": lambda: Qwen2MoeConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    ),
    "qwen3-moe": lambda: Qwen3MoeConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=True,
    ),
    # Granite's multipliers ride on every rank (the residual's after the all-reduce).
    "granite": lambda: GraniteConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        embedding_multiplier=12.0,
        attention_multiplier=0.0078125,
        residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
    # Gateless MLPs by other names: StarCoder 2's (with LayerNorms and biases), nanochat's
    # (weightless norms); Hunyuan's per-head q/k norms after the rotary; EXAONE 4's norms after
    # the attention and the MLP.
    "starcoder2": lambda: Starcoder2Config(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        use_bias=True,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "nanochat": lambda: NanoChatConfig(
        **COMMON, vocab_size=320, num_key_value_heads=2, head_dim=16
    ),
    "hunyuan": lambda: HunYuanDenseV1Config(
        **COMMON, vocab_size=320, num_key_value_heads=2, head_dim=16
    ),
    "exaone4": lambda: Exaone4Config(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=None,
        layer_types=["full_attention"] * 2,
    ),
    # q and k normed over all heads at once: OLMo 2's (scaled in fp32; with one KV head, which
    # both ranks keep), OLMo 3's (some layers windowed), OLMoE's (clamped after, experts) and
    # MiniMax M2's (a partial rotary, experts chosen by their scores plus a bias).
    "olmo2": lambda: Olmo2Config(**COMMON, vocab_size=320, num_key_value_heads=2),
    "olmo2-one-kv-head": lambda: Olmo2Config(**COMMON, vocab_size=320, num_key_value_heads=1),
    "olmo3": lambda: Olmo3Config(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "olmoe": lambda: OlmoeConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        clip_qkv=1.5,
    ),
    "minimax-m2": lambda: MiniMaxM2Config(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        head_dim=16,
        partial_rotary_factor=0.5,
    ),
    # Projections holding several parts one above the other: Phi-3's q/k/v and gate/up (and
    # Phi-4-mini's with one KV head, which both ranks keep, and a partial rotary); GLM's gate/up
    # (GLM-4-0414's outputs normed again); GraniteMoeShared's gate/up of the MLP every token
    # runs beside the experts.
    "phi3": lambda: Phi3Config(
        **COMMON, vocab_size=320, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "phi4-mini-one-kv-head": lambda: Phi3Config(
        **COMMON, vocab_size=320, num_key_value_heads=1, partial_rotary_factor=0.75
    ),
    "glm": lambda: GlmConfig(**COMMON, vocab_size=320, num_key_value_heads=2, head_dim=16),
    "glm4": lambda: Glm4Config(
        **COMMON, vocab_size=320, num_key_value_heads=2, head_dim=16, attention_bias=True
    ),
    "granite-moe-shared": lambda: GraniteMoeSharedConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        shared_intermediate_size=48,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        logits_scaling=8.0,
    ),
    # Granite 4's models that attend in every layer: experts beside the shared MLP (NoPE), and
    # the shared MLP alone (rotated).
    "granite-4": lambda: GraniteMoeHybridConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        layer_types=["attention"] * COMMON["num_hidden_layers"],
        num_local_experts=6,
        num_experts_per_tok=2,
        shared_intermediate_size=48,
        residual_multiplier=0.5,
    ),
    "granite-4-dense": lambda: GraniteMoeHybridConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        layer_types=["attention"] * COMMON["num_hidden_layers"],
        num_local_experts=0,
        shared_intermediate_size=48,
        position_embedding_type="rope",
        embedding_multiplier=3.0,
    ),
    # Gemma's layer (scaled embeddings, four norms of one plus their weights): Gemma 2's capped
    # scores and logits, Gemma 3's per-head q/k norms and local and global layers.
    "gemma2": lambda: Gemma2Config(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=5.0,
        query_pre_attn_scalar=4,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # gpt-oss's sinks per head and experts held `x @ W`, gate and up interleaved, with biases.
    "gpt-oss": lambda: GptOssConfig(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        num_local_experts=6,
        num_experts_per_tok=2,
    ),
    # Multi-head latent attention, the heads split and the latent kept whole: DeepSeek V3's
    # with q's low-rank projection, V2's with q whole.
    "deepseek-v3": lambda: DeepseekV3Config(**COMMON, **LATENT, q_lora_rank=24),
    "deepseek-v2": lambda: DeepseekV2Config(**COMMON, **LATENT, head_dim=8),
    # Qwen3.5's Gated DeltaNet (split by its key heads and the two value heads each serves)
    # beside gated attention layers (q's rows each head's query and gate); with experts; and
    # Qwen3-Next's DeltaNet projections grouped by key head.
    "qwen3.5": family("qwen3_5", lambda m: m.KINDS["dense"]()),
    "qwen3.5-moe": family("qwen3_5", lambda m: m.KINDS["moe"]()),
    "qwen3-next": family("qwen3_5", lambda m: m.KINDS["next"]()),
    # LFM2's short convolution (split by channel) before an attention layer, its MLP's width
    # adjusted from the config's (128 -> 85 -> 96).
    "lfm2": lambda: Lfm2Config(
        **COMMON,
        vocab_size=320,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
        conv_L_cache=3,
        conv_bias=True,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=16,
    ),
    # Mamba2 mixers split by heads: Granite 4's hybrid with one group of B and C that both
    # ranks keep (its gated norm's one group across them), Bamba's two groups (one a rank).
    "granite-4-hybrid": family("granite_hybrid", lambda m: m.KINDS["experts"](), mamba_n_groups=1),
    "bamba": family("bamba", lambda m: BambaConfig(**m.SHAPE)),
    # Falcon-H1's attention beside Mamba2 in every layer, its norm over one group normed before
    # the gate or after it, or only gated with two groups.
    "falcon-h1-norm-then-gate": family("falcon_h1", falcon_h1("norm-then-gate"), mamba_n_groups=1),
    "falcon-h1-gate-then-norm": family("falcon_h1", falcon_h1("gate-then-norm"), mamba_n_groups=1),
    "falcon-h1-gated": family("falcon_h1", falcon_h1("gated")),
    # Nemotron-H's blocks (Mamba2, NoPE attention, gateless MLPs or experts beside a shared one,
    # in a latent width), each mixer split as its kind is.
    "nemotron-h-dense": family("nemotron_h", lambda m: m.KINDS["dense"]()),
    "nemotron-h-experts": family("nemotron_h", lambda m: m.KINDS["experts"]()),
    "nemotron-h-latent": family("nemotron_h", lambda m: m.KINDS["latent"]()),
    "nemotron-h-latent-biases": family("nemotron_h", lambda m: m.KINDS["latent"](), mlp_bias=True),
    # Jamba's Mamba1 split by channels (its projection to the step, B and C summed), experts in
    # every other layer.
    "jamba": family("jamba", lambda m: JambaConfig(**m.SHAPE, num_experts=4)),
    # Mamba's own models, without attention: Mamba's channels (its embedding tied to its head),
    # Falcon-Mamba's (its step, B and C normed), Mamba2's heads in two groups.
    "mamba": family("mamba", lambda m: m.KINDS["mamba"](), tie_word_embeddings=True),
    "falcon-mamba": family("mamba", lambda m: m.KINDS["falcon_mamba"]()),
    "mamba2": family("mamba", lambda m: m.KINDS["mamba2"]()),
}


def build(name: str) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODELS[name]()).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)  # initialised to zero: make them count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1, 0.3)  # initialised to ones: make each channel's own count
            elif name.endswith(("sinks", "_proj_bias", "dt_bias", ".D")):
                # gpt-oss's sinks and experts' biases, recurrent mixers' steps and skips
                param.normal_(0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.5)
    return model


def run_ranks(size: int, work: Callable[[ParallelGroup], Any]) -> list[Any]:
    """`work(group)` on `size` threads, one per rank of a fresh gloo group; the results in rank
    order (a rank's exception is raised here)."""
    store = dist.HashStore()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = work(connect(store, rank, size, torch.device("cpu")))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def prefill_batch(prompt: list[int], block_size: int) -> InputBatch:
    n = len(prompt)
    blocks = -(-n // block_size)
    return InputBatch(
        requests=[],
        input_ids=np.asarray(prompt, dtype=np.int64),
        positions=np.arange(n, dtype=np.int64),
        slot_mapping=np.arange(n, dtype=np.int64),
        query_starts=np.zeros(1, dtype=np.int64),
        query_lens=np.asarray([n], dtype=np.int64),
        context_lens=np.zeros(1, dtype=np.int64),
        block_table=np.arange(blocks, dtype=np.int64)[None],
        sample_rows=np.zeros(1, dtype=np.int64),
        state_slots=np.zeros(1, dtype=np.int64),  # a recurrent model's states: slot 0
    )


def rank_logits(hf_model: Any, group: ParallelGroup, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of `prompt`, from this rank's share of `hf_model`."""
    model = copy.deepcopy(hf_model)
    shape = shard_model(model, group.rank, group.size)
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=16), dtype="float32")
    loaded = wrap_model(model, None, name="tiny")
    cpu = torch.device("cpu")
    parts = build_rank(loaded, config, cpu, torch.float32, Shard(group, shape))
    batch = prefill_batch(prompt, 4)
    indices = np.arange(len(prompt), dtype=np.int64)
    with torch.inference_mode():
        return parts.model(*model_inputs(parts.backend, parts.kv_cache, batch, indices))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_ranks_compute_the_whole_models_logits(name):
    hf_model = build(name)
    prompt = [5, 17, 200, 3, 64, 9, 300, 11, 42]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    both = run_ranks(2, lambda group: rank_logits(hf_model, group, prompt))
    # fp32 sums in another order than transformers': an error in proportion to the logits'
    # size (those of the recurrent delta rule's families, about 11, differ by up to 1.6e-4 on
    # a Zen 4 on one rank already).
    tolerance = 2e-5 * expected.abs().max().item()
    for rank, logits in enumerate(both):
        assert logits.shape == expected.shape, rank
        torch.testing.assert_close(logits, expected, atol=tolerance, rtol=1e-4)


def test_a_share_holds_its_heads_channels_and_vocabulary_rows():
    model = build("llama-odd-vocab")
    whole = copy.deepcopy(model)
    shape = shard_model(model, 1, 2)
    layer, full = model.model.layers[0], whole.model.layers[0]
    assert (shape.local_heads, shape.local_kv_heads, shape.local_vocab) == (2, 1, 161)
    assert torch.equal(layer.self_attn.q_proj.weight, full.self_attn.q_proj.weight[32:])
    assert torch.equal(layer.self_attn.k_proj.weight, full.self_attn.k_proj.weight[16:])
    assert torch.equal(layer.self_attn.o_proj.weight, full.self_attn.o_proj.weight[:, 32:])
    assert torch.equal(layer.mlp.gate_proj.weight, full.mlp.gate_proj.weight[64:])
    assert torch.equal(layer.mlp.down_proj.weight, full.mlp.down_proj.weight[:, 64:])
    embedding = model.get_input_embeddings().weight
    assert embedding.shape == (161, 64)
    assert torch.equal(embedding[:160], whole.get_input_embeddings().weight[161:])
    assert not embedding[160].any(), "the padding row is zero"


def test_a_tied_head_keeps_sharing_the_embedding():
    model = build("llama-tied")
    shard_model(model, 0, 2)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_row_parallel_biases_are_added_once():
    model = Qwen2Config(**COMMON, vocab_size=320, num_key_value_heads=2)
    assert why_not_shardable(model, 2) == ""
    hf_model = build("qwen2-biases")
    with torch.no_grad():
        hf_model.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.ones(64))
    ranks = [copy.deepcopy(hf_model) for _ in range(2)]
    for rank, share in enumerate(ranks):
        shard_model(share, rank, 2)
    biases = [share.model.layers[0].self_attn.o_proj.bias for share in ranks]
    assert biases[0] is not None and biases[1] is None


@pytest.mark.parametrize(
    ("overrides", "size", "reason"),
    [
        (dict(num_attention_heads=4, num_key_value_heads=2), 3, "4 attention heads"),
        (dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8), 8, ""),
        (dict(num_attention_heads=12, num_key_value_heads=3, hidden_size=96), 4, "3 KV heads"),
        (dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=130), 4, "130"),
    ],
)
def test_what_does_not_divide_is_named(overrides, size, reason):
    config = LlamaConfig(**{**COMMON, "vocab_size": 320, **overrides})
    found = why_not_shardable(config, size)
    assert (reason in found and found) if reason else found == ""


@pytest.mark.parametrize(
    ("kind", "size", "reason"),
    [
        ("mamba", 3, "its 128 Mamba channels do not divide by 3"),
        ("mamba2", 3, "its 8 Mamba2 heads do not divide by 3"),
        ("mamba2", 4, "its 2 Mamba2 groups neither divide by 4 nor are one"),
        ("mamba2", 2, ""),
    ],
)
def test_what_of_mamba_own_models_does_not_divide_is_named(kind, size, reason):
    assert why_not_shardable(test_mamba.KINDS[kind](), size) == reason


def test_a_model_that_does_not_divide_is_refused_before_loading_its_share():
    model = build("llama")
    with pytest.raises(ValueError, match="cannot split this model: its 4 attention heads"):
        shard_model(model, 0, 3)


def test_replicated_kv_heads_follow_the_query_heads():
    config = LlamaConfig(**{**COMMON, "vocab_size": 320, "num_key_value_heads": 2})
    shapes = [ShardShape.of(config, rank, 4, 320) for rank in range(4)]
    # Query heads 0..3 read KV heads 0, 0, 1, 1: one query head and its KV head per rank.
    assert [(s.local_heads, s.local_kv_heads, s.first_kv_head) for s in shapes] == [
        (1, 1, 0),
        (1, 1, 0),
        (1, 1, 1),
        (1, 1, 1),
    ]


def test_the_transformers_implementation_is_refused_for_a_share():
    group = ParallelGroup()
    model = build("llama")
    shape = shard_model(model, 0, 2)
    with pytest.raises(ValueError, match="Conveyor's model implementation only"):
        build_causal_lm(model, "transformers", Shard(group, shape))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_share_read_from_the_files_equals_the_share_cut_from_the_whole(
    name, tmp_path, monkeypatch
):
    """The loader reads each rank's slices from the safetensors files (split over several
    here) and never loads the whole model."""
    whole = build(name)
    whole.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *args, **kwargs: pytest.fail("loaded the whole model"),
    )
    for rank in range(2):
        loaded, shape = load_share(str(tmp_path), torch.float32, rank, 2)
        cut = copy.deepcopy(whole)
        assert shard_model(cut, rank, 2) == shape
        ours, theirs = dict(loaded.named_parameters()), dict(cut.named_parameters())
        assert ours.keys() == theirs.keys()
        for key, param in ours.items():
            assert torch.equal(param, theirs[key]), key
        tied = loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
        assert tied == (whole.get_output_embeddings().weight is whole.get_input_embeddings().weight)
        buffers = dict(loaded.named_buffers())
        assert all(not b.is_meta for b in buffers.values())
        for key, buffer in cut.named_buffers():
            assert torch.equal(buffers[key], buffer), key


def test_a_folder_without_safetensors_is_loaded_whole_and_cut(tmp_path):
    whole = build("llama")
    whole.config.save_pretrained(tmp_path)
    torch.save(whole.state_dict(), tmp_path / "pytorch_model.bin")
    loaded, shape = load_share(str(tmp_path), torch.float32, 1, 2)
    cut = copy.deepcopy(whole)
    shard_model(cut, 1, 2)
    assert shape.local_heads == 2
    for key, param in cut.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[key], param), key


@pytest.mark.parametrize("name", ["olmo2", "olmoe"])
def test_split_norms_scale_as_their_familys_norm_does(name):
    """Over one rank the split norms are the whole norms, bit for bit in bf16: OLMo 2's scales
    by its weight in fp32 before the cast back, OLMoE's after it (the other order differs)."""
    attn = build(name).to(torch.bfloat16).model.layers[0].self_attn
    torch.manual_seed(1)
    q = torch.randn(7, attn.q_norm.weight.shape[0]).to(torch.bfloat16)
    k = torch.randn(7, attn.k_norm.weight.shape[0]).to(torch.bfloat16)
    norms = SplitHeadsNorms(attn.q_norm, attn.k_norm, ParallelGroup())
    with torch.inference_mode():
        q_ours, k_ours = norms(q, k)
        assert torch.equal(q_ours, attn.q_norm(q)) and torch.equal(k_ours, attn.k_norm(k))
        norms.in_fp32 = not norms.in_fp32
        assert not torch.equal(norms(q, k)[0], attn.q_norm(q))


@pytest.mark.parametrize("name", ["glm4-moe", "ernie4.5-moe", "hunyuan-moe", "granite-moe"])
def test_two_ranks_compute_each_mixture_of_experts_logits(name):
    """The mixtures of experts of `tests/models/test_moe.py` (routers chosen by a bias, within
    groups, softmaxed over their top logits; shared experts, dense first layers) across two
    ranks: the whole model's logits (the engine serves two of them across ranks there)."""
    from tests.models.test_moe import build as build_moe

    hf_model = build_moe(name)
    prompt = [5, 17, 200, 3, 64, 9, 300, 11, 42]
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    for logits in run_ranks(2, lambda group: rank_logits(hf_model, group, prompt)):
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_logits_of_no_rows_gather_to_no_rows():
    """A step that samples no row (a prompt's chunk alone) gathers its ranks' empty logits."""
    gathered = run_ranks(2, lambda group: group.all_gather_columns(torch.zeros(0, 3)))
    assert all(logits.shape == (0, 6) for logits in gathered)
