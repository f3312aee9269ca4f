"""Cutting a loaded Llama-family model down to one rank's share, Megatron-style.

q, k, v, gate and up are split by output rows (whole heads, whole intermediate channels); o and
down by input columns, so each rank's product is a partial sum that one all-reduce completes.
The embedding and the LM head are split by vocabulary rows, padded to equal shares. Where the
model has fewer KV heads than ranks, each rank keeps the one KV head its query heads read.
Experts are cut as gated MLPs are, each to the rank's channels, the router kept whole: every
rank routes a token alike, and one all-reduce sums the experts' and shared expert's partials.
In multi-head latent attention (DeepSeek's) the heads are split as q's rows, `kv_b_proj`'s and
o's columns; the latent (its projection, its norm and its cache) is kept whole by every rank.
A Gated DeltaNet (Qwen3.5's, Qwen3-Next's linear attention) is split by its key heads and the
value heads they serve: its projections' rows, its convolution's channels, its decays' and
steps' entries, its output projection's columns; each rank keeps those heads' recurrent states.
LFM2's short convolutions are split by channel (their three projections' rows, the convolution's
channels and its state, the output projection's columns). A Mamba2 mixer (Granite 4's, Bamba's,
Falcon-H1's) is split by heads: its gate's, inputs' and steps' rows, its convolution's channels,
its decays, skips and steps' biases, its norm's weight, its output projection's columns; its
groups of B and C are split with the heads that read them, or kept by every rank where there is
one (its gated norm then adds the ranks' sums of squares). A Mamba1 mixer (Jamba's) is split by
channels, its projection to the step and B and C summed over the ranks. Mamba's own models
(Mamba, Mamba2, Falcon-Mamba), without attention, split their mixers alike.

The cut happens on the plain Hugging Face modules right after loading, before the linear layers
take Conveyor's kernel forms, so every later step sees an ordinary (smaller) model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.parallel.group import ParallelGroup
from engine.parallel.mixer_shares import (
    LinearHeads,
    MambaHeads,
    attends,
    conv_channels,
    count_local_heads,
    why_mixers_do_not_split,
)

# Hugging Face's expert classes that hold gate above up, untransposed, without biases (Conveyor
# runs them: `models.experts`).
FUSED_EXPERTS = frozenset(
    {
        "MixtralExperts",
        "Qwen2MoeExperts",
        "Qwen3MoeExperts",
        "Qwen3VLMoeTextExperts",
        "Glm4MoeExperts",
        "Dots1Experts",
        "ExaoneMoeExperts",
        "SolarOpenExperts",
        "MiniMaxM2Experts",
        "Ernie4_5_MoeExperts",
        "HunYuanMoEV1Experts",
        "OlmoeExperts",
        "DeepseekV3Experts",
        "Glm4MoeLiteExperts",
        "DeepseekV2Experts",
        "GraniteMoeExperts",
        "GraniteMoeSharedExperts",
        "Qwen3_5MoeExperts",
        "Qwen3NextExperts",
        "GraniteMoeHybridExperts",
        "JambaExperts",
    }
)
# Hugging Face's expert classes that hold `x @ W` weights with gate and up interleaved
# (`gate_up_proj [experts, hidden, 2 * inter]`, gate in the even columns), biases beside them,
# and a clamped SwiGLU between (gpt-oss).
TRANSPOSED_EXPERTS = frozenset({"GptOssExperts"})
# Hugging Face's expert classes Conveyor runs and splits, of either kind.
SPLIT_EXPERTS = FUSED_EXPERTS | TRANSPOSED_EXPERTS
# Hugging Face's expert classes without a gate (`up_proj [experts, inter, hidden]`, `down_proj`,
# `down(act(up(x)))`: Nemotron-H's), split by channels too.
GATELESS_EXPERTS = frozenset({"NemotronHExperts"})
# Every expert class Conveyor runs.
HF_EXPERTS = SPLIT_EXPERTS | GATELESS_EXPERTS
# The tensors of a layer's experts, by their names in any kind of class.
EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


# Families whose q and k are each normed over all heads at once (one weight of `heads x
# head_dim`): each rank keeps its heads' part of the norms' weights, and the layer adds the
# ranks' sums of squares (`parallel.layers.SplitHeadsNorms`).
ALL_HEADS_NORMED = frozenset(
    {"Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM", "MiniMaxM2ForCausalLM"}
)


@dataclass(frozen=True, slots=True)
class LatentWidths:
    """Per head, in multi-head latent attention (DeepSeek's): the rows of q (its part that is
    taken into the latent's space and its rotated part), of `kv_b_proj` (its key rows and its
    value rows) and the columns of o (its value dims)."""

    query: int
    key_value: int
    value: int

    @classmethod
    def of(cls, config: Any) -> LatentWidths | None:
        if not getattr(config, "kv_lora_rank", None):
            return None
        nope, value = config.qk_nope_head_dim, config.v_head_dim
        return cls(nope + config.qk_rope_head_dim, nope + value, value)


# The model types whose attention's q projection holds each head's query beside its gate, the
# head's rows twice as many as its dims (Qwen3.5's, Qwen3-Next's).
GATED_QUERY_MODELS = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"})


@dataclass(frozen=True, slots=True)
class ShardShape:
    """What one rank holds of each kind of row."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    # Each expert's intermediate size, and the shared expert's (0: none), in models with experts.
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    # Whether q and k are normed over all heads at once, their norms' weights split by head.
    norms_all_heads: bool = False
    # The widths of each head in multi-head latent attention, whose latent every rank keeps
    # whole (its projection and norm, and the cache); None elsewhere.
    latent: LatentWidths | None = None
    # Whether q's rows hold each head's query and gate (`GATED_QUERY_MODELS`).
    gated_query: bool = False
    # The heads of a Gated DeltaNet's layers; None in a model without.
    linear: LinearHeads | None = None
    # The channels of LFM2's short convolutions (its hidden size); 0 in a model without.
    conv_channels: int = 0
    # The heads and groups of Mamba2 mixers; None in a model without.
    mamba: MambaHeads | None = None

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank keeps: with fewer KV heads than ranks, the one its query
        heads read (query head j reads KV head j * kv // heads)."""
        return self.rank * self.num_kv_heads // self.size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate // self.size

    @property
    def local_vocab(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    @property
    def head_span(self) -> slice:
        """This rank's query heads (of a per-head parameter: gpt-oss's sinks)."""
        return self._heads_of(1)

    @property
    def query_span(self) -> slice:
        """This rank's rows of q."""
        return self._heads_of(self._query_rows)

    @property
    def _query_rows(self) -> int:
        """q's rows a head (in multi-head latent attention, its latent part and rotated part)."""
        if self.latent:
            return self.latent.query
        return 2 * self.head_dim if self.gated_query else self.head_dim

    @property
    def output_span(self) -> slice:
        """This rank's columns of o: its heads' values."""
        return self._heads_of(self.latent.value if self.latent else self.head_dim)

    @property
    def latent_span(self) -> slice:
        """This rank's rows of `kv_b_proj` (multi-head latent attention): its heads' key and
        value rows."""
        assert self.latent is not None
        return self._heads_of(self.latent.key_value)

    def _heads_of(self, per_head: int) -> slice:
        """This rank's part of `per_head` rows (or columns) a head, the heads side by side."""
        width = self.local_heads * per_head
        return _span(self.rank * width, width)

    @property
    def kv_span(self) -> slice:
        """This rank's rows of k and v."""
        return _span(self.first_kv_head * self.head_dim, self.local_kv_heads * self.head_dim)

    @property
    def channel_span(self) -> slice:
        """This rank's rows of gate and up (and columns of down)."""
        return _span(self.rank * self.local_intermediate, self.local_intermediate)

    @property
    def expert_span(self) -> slice:
        """This rank's channels of each expert (rows of its gate and up, columns of its down)."""
        width = self.expert_intermediate // self.size
        return _span(self.rank * width, width)

    @property
    def shared_span(self) -> slice:
        """This rank's channels of the shared expert."""
        width = self.shared_intermediate // self.size
        return _span(self.rank * width, width)

    @property
    def linear_key_span(self) -> slice:
        """This rank's rows of a DeltaNet's q (or k): its key heads'."""
        heads = self._linear
        return self._heads_share(heads.key_heads, heads.key_dim)

    @property
    def linear_value_span(self) -> slice:
        """This rank's rows of a DeltaNet's v and z (columns of its output projection): its
        value heads'."""
        heads = self._linear
        return self._heads_share(heads.value_heads, heads.value_dim)

    @property
    def linear_head_span(self) -> slice:
        """This rank's entries of a DeltaNet's per value head rows and parameters (b, a, the
        decays' logs, the steps' biases)."""
        return self._heads_share(self._linear.value_heads, 1)

    @property
    def linear_group_span(self) -> slice:
        """This rank's rows of Qwen3-Next's `in_proj_qkvz`, whose rows run key head by key head,
        each its q, k, and the v and z of the value heads it serves."""
        heads = self._linear
        rows = 2 * heads.key_dim + 2 * heads.served * heads.value_dim
        return self._heads_share(heads.key_heads, rows)

    @property
    def linear_ba_span(self) -> slice:
        """This rank's rows of Qwen3-Next's `in_proj_ba` (key head by key head, the b and a of
        the value heads it serves)."""
        return self._heads_share(self._linear.key_heads, 2 * self._linear.served)

    @property
    def conv_span(self) -> slice:
        """This rank's channels of LFM2's short convolution (rows of each of its projection's
        three parts, columns of its output projection)."""
        width = self.conv_channels // self.size
        return _span(self.rank * width, width)

    @property
    def mamba_inner_span(self) -> slice:
        """This rank's rows of a Mamba2 mixer's gate `z` and inputs `x` (its heads' dims), of its
        norm's weight and columns of its output projection."""
        heads = self._mamba
        return self._heads_share(heads.heads, heads.head_dim)

    @property
    def mamba_head_span(self) -> slice:
        """This rank's rows of a Mamba2 mixer's steps `dt` and entries of its per-head
        parameters (the decays' logs, the skips, the steps' biases)."""
        return self._heads_share(self._mamba.heads, 1)

    @property
    def mamba_group_span(self) -> slice:
        """This rank's rows of a Mamba2 mixer's B (or C): the groups its heads read (with fewer
        groups than ranks, the one group they all read)."""
        heads = self._mamba
        return _span(
            self.first_mamba_group * heads.state_dims, self.local_mamba_groups * heads.state_dims
        )

    @property
    def local_mamba_groups(self) -> int:
        return max(1, self._mamba.groups // self.size)

    @property
    def first_mamba_group(self) -> int:
        return self.rank * self._mamba.groups // self.size

    @property
    def _mamba(self) -> MambaHeads:
        assert self.mamba is not None, "the model has no Mamba2 mixer"
        return self.mamba

    def _heads_share(self, heads: int, per_head: int) -> slice:
        width = heads // self.size * per_head
        return _span(self.rank * width, width)

    @property
    def _linear(self) -> LinearHeads:
        assert self.linear is not None, "the model has no Gated DeltaNet"
        return self.linear

    def fused_rows(self, parts: tuple[str, ...]) -> list[slice]:
        """This rank's rows of a projection holding several parts one above the other (q, k and
        v; gate and up), each part named by its span (`"query_span"`, ...)."""
        rows, offset = [], 0
        for part in parts:
            span = getattr(self, part)
            rows.append(_span(offset + span.start, span.stop - span.start))
            offset += self._whole_rows(part)
        return rows

    def _whole_rows(self, part: str) -> int:
        whole = {
            "query_span": self.num_heads * self._query_rows,
            "kv_span": self.num_kv_heads * self.head_dim,
            "channel_span": self.intermediate,
            "shared_span": self.shared_intermediate,
            "conv_span": self.conv_channels,
        }
        if part in whole:
            return whole[part]
        if part.startswith("mamba_"):
            mamba = self._mamba
            return {
                "mamba_inner_span": mamba.heads * mamba.head_dim,
                "mamba_group_span": mamba.groups * mamba.state_dims,
                "mamba_head_span": mamba.heads,
            }[part]
        heads = self._linear
        linear = {
            "linear_key_span": heads.key_heads * heads.key_dim,
            "linear_value_span": heads.value_heads * heads.value_dim,
        }
        return linear[part]

    @property
    def vocab_span(self) -> slice:
        """This rank's rows of the embedding and the LM head, past the end on the last rank."""
        return _span(self.vocab_start, self.local_vocab)

    @classmethod
    def of(
        cls, config: Any, rank: int, size: int, vocab_size: int, norms_all_heads: bool = False
    ) -> ShardShape:
        heads = config.num_attention_heads if attends(config) else 0
        return cls(
            rank=rank,
            size=size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=_head_dim(config) if heads else 0,
            intermediate=dense_intermediate(config),
            vocab_size=vocab_size,
            expert_intermediate=_expert_intermediate(config),
            shared_intermediate=_shared_intermediate(config),
            norms_all_heads=norms_all_heads,
            latent=LatentWidths.of(config),
            gated_query=getattr(config, "model_type", "") in GATED_QUERY_MODELS,
            linear=LinearHeads.of(config),
            conv_channels=conv_channels(config),
            mamba=MambaHeads.of(config),
        )


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def dense_intermediate(config: Any) -> int:
    """The intermediate size of a dense MLP: the config's, or as LFM2's MLP adjusts it (two
    thirds, times a multiplier, rounded up to a multiple); 0 in Mamba's own models (no MLP)."""
    if not attends(config):
        return 0
    size = int(config.intermediate_size)
    if not getattr(config, "block_auto_adjust_ff_dim", False):
        return size
    size = int(2 * size / 3)
    if config.block_ffn_dim_multiplier is None:
        return size
    size = int(config.block_ffn_dim_multiplier * size)
    return config.block_multiple_of * -(-size // config.block_multiple_of)


def _expert_intermediate(config: Any) -> int:
    """Each expert's intermediate size (Mixtral's experts take the config's own); 0 without
    experts."""
    counts = ("num_experts", "num_local_experts", "n_routed_experts")
    if not any(getattr(config, count, None) for count in counts):
        return 0
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


# The config fields that count a block's shared experts (DeepSeek's kind: one MLP as wide as
# that many experts), by family.
SHARED_EXPERT_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")


def _shared_intermediate(config: Any) -> int:
    """The intermediate size of a block's shared expert (Qwen2-MoE's) or of its shared experts
    together, or of the MLP every token runs beside the experts (GraniteMoeShared's); 0
    without."""
    names = (
        "shared_expert_intermediate_size",
        "shared_intermediate_size",
        "moe_shared_expert_intermediate_size",  # Nemotron-H's
    )
    size = next((getattr(config, n) for n in names if getattr(config, n, None)), None)
    if size:
        return int(size)
    count = next((getattr(config, f) for f in SHARED_EXPERT_COUNTS if getattr(config, f, None)), 0)
    return int(count) * _expert_intermediate(config) if count else 0


def why_not_shardable(config: Any, size: int) -> str:
    """Empty where a model with this config splits over `size` ranks, else why not."""
    heads = config.num_attention_heads if attends(config) else size
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size:
        return f"its {heads} attention heads do not divide by {size}"
    if kv_heads % size and size % kv_heads:
        return f"its {kv_heads} KV heads neither divide by {size} nor divide {size}"
    sizes = {
        "intermediate size": dense_intermediate(config),
        "short convolutions' channels": conv_channels(config),
        "experts' intermediate size": _expert_intermediate(config),
        "shared expert's intermediate size": _shared_intermediate(config),
    }
    for what, channels in sizes.items():
        if channels % size:
            return f"its {what} {channels} does not divide by {size}"
    return why_mixers_do_not_split(config, size)


def not_shardable(size: int, reason: str) -> ValueError:
    return ValueError(f"tensor parallelism over {size} ranks cannot split this model: {reason}")


def shard_model(hf_model: Any, rank: int, size: int) -> ShardShape:
    """Cut `hf_model` (a Llama-family causal LM) down to rank `rank`'s share in place; return
    the shape of the share. Raises ValueError where the model does not divide."""
    from engine.models import decoder_reason  # it builds on this module

    config = hf_model.config
    reason = decoder_reason(hf_model) or why_not_shardable(config, size)
    if reason:
        raise not_shardable(size, reason)
    head = hf_model.get_output_embeddings()
    norms_all_heads = type(hf_model).__name__ in ALL_HEADS_NORMED
    shape = ShardShape.of(config, rank, size, head.weight.shape[0], norms_all_heads)
    layers = hf_model.base_model.layers
    for name, module in list(layers.named_modules()):
        if name.endswith(BIASED_ONCE) and rank and getattr(module, "bias", None) is not None:
            module.bias = None  # rank 0 adds it: the sum over the ranks adds it once
            continue
        rows, columns = row_share(name, shape), column_share(name, shape)
        if rows is not None and name.endswith((*HEAD_NORM_SHARES, *NORM_SHARES)):
            if getattr(module, "weight", None) is not None:  # (Falcon-H1's may be no norm)
                module.weight = _parameter(module.weight[rows])  # the weight for its channels
            continue
        parts = fused_row_share(name, shape)
        if parts is not None and isinstance(module, nn.Conv1d):
            _shard_channels(module, parts)
            continue
        if parts is not None:
            share = _fused_rows(module, parts)
        elif rows is not None:
            share = _rows(module, rows)
        elif columns is not None:
            share = _columns(module, columns, keep_bias=shape.rank == 0)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(layers.get_submodule(parent), child, share)
    for name, param in list(layers.named_parameters()):
        heads = parameter_share(name, shape)
        if heads is not None:
            owner, _, kind = name.rpartition(".")
            setattr(layers.get_submodule(owner), kind, _parameter(param[heads]))
    for module in layers.modules():
        if type(module).__name__ in HF_EXPERTS:
            _shard_experts(module, shape)
        count_local_heads(module, shape)
    _shard_vocab(hf_model, shape)
    return shape


def _shard_channels(conv: nn.Conv1d, parts: list[slice]) -> None:
    """A depthwise convolution cut to the channels `parts`, one part above the other."""
    conv.weight = _parameter(torch.cat([conv.weight[rows] for rows in parts]))
    if conv.bias is not None:
        conv.bias = _parameter(torch.cat([conv.bias[rows] for rows in parts]))
    channels = conv.weight.shape[0]
    conv.in_channels = conv.out_channels = conv.groups = channels


def _shard_experts(experts: Any, shape: ShardShape) -> None:
    """Every expert cut to the rank's channels, as a gated MLP is. The router stays whole."""
    transposed = type(experts).__name__ in TRANSPOSED_EXPERTS
    for kind in EXPERT_TENSORS:
        whole = getattr(experts, kind, None)
        if whole is not None:
            setattr(experts, kind, _parameter(experts_share(kind, whole, shape, transposed)))


def experts_share(
    kind: str, whole: torch.Tensor, shape: ShardShape, transposed: bool = False
) -> torch.Tensor:
    """The rank's share of the tensor `kind` of a layer's experts, held whole: each expert's
    gate and up rows (held one above the other, `[experts, 2 * inter, hidden]`) and down columns
    (`[experts, hidden, inter]`) for the rank's channels; or, `transposed` (gpt-oss's), each
    channel's gate and up columns side by side with their biases, its down rows, and the down
    bias on rank 0 alone (zeros elsewhere), so that the sum over the ranks adds it once."""
    channels = shape.expert_span
    if kind == "up_proj":  # gateless experts' up (`[experts, inter, hidden]`)
        return whole[:, channels]
    if transposed:
        pairs = _span(2 * channels.start, 2 * (channels.stop - channels.start))
        shares = {
            "gate_up_proj": lambda: whole[:, :, pairs],
            "gate_up_proj_bias": lambda: whole[:, pairs],
            "down_proj": lambda: whole[:, channels],
            "down_proj_bias": lambda: whole if shape.rank == 0 else torch.zeros_like(whole),
        }
        return shares[kind]()
    if kind == "down_proj":
        return whole[:, :, channels]
    inter = whole.shape[1] // 2
    up = slice(inter + channels.start, inter + channels.stop)
    return torch.cat([whole[:, channels], whole[:, up]], dim=1)


# Where each projection of a layer keeps the rank's share, by the end of the module's name: its
# output rows (q, k, v, gate, up), or its input columns (o, down), as `ShardShape` spans.
ROW_SHARES = {
    "self_attn.q_proj": "query_span",
    "self_attn.q_b_proj": "query_span",  # multi-head latent attention's up projection of q
    "self_attn.kv_b_proj": "latent_span",
    "self_attn.k_proj": "kv_span",
    "self_attn.v_proj": "kv_span",
    # (and Hunyuan MoE's `mlp.shared_mlp.*_proj`, as wide as a dense MLP, by the same ends)
    "mlp.gate_proj": "channel_span",
    "mlp.up_proj": "channel_span",
    "mlp.fc1": "channel_span",  # a gateless MLP's up by nanochat's name
    "mlp.c_fc": "channel_span",  # and by StarCoder 2's
    "mlp.shared_expert.gate_proj": "shared_span",
    "mlp.shared_expert.up_proj": "shared_span",
    "mlp.shared_experts.gate_proj": "shared_span",
    "mlp.shared_experts.up_proj": "shared_span",
    # A Gated DeltaNet's z, b and a (Qwen3.5's), and its grouped projections (Qwen3-Next's).
    "linear_attn.in_proj_z": "linear_value_span",
    "linear_attn.in_proj_b": "linear_head_span",
    "linear_attn.in_proj_a": "linear_head_span",
    "linear_attn.in_proj_qkvz": "linear_group_span",
    "linear_attn.in_proj_ba": "linear_ba_span",
    # LFM2's MLP's gate and up.
    "feed_forward.w1": "channel_span",
    "feed_forward.w3": "channel_span",
    # Bamba's and Falcon-H1's MLP's gate and up.
    "feed_forward.gate_proj": "channel_span",
    "feed_forward.up_proj": "channel_span",
    # Nemotron-H's blocks' mixers: attention, a gateless MLP's up, the shared expert's up.
    "mixer.q_proj": "query_span",
    "mixer.k_proj": "kv_span",
    "mixer.v_proj": "kv_span",
    "mixer.up_proj": "channel_span",
    "mixer.shared_experts.up_proj": "shared_span",
    # A Mamba1 mixer's projection of the step up to its channels (and Mamba's own models').
    "mamba.dt_proj": "mamba_head_span",
    "mixer.dt_proj": "mamba_head_span",
}
# A Mamba2 mixer's first projection: z, x, B, C and dt.
MAMBA2_IN_PARTS = (
    "mamba_inner_span",
    "mamba_inner_span",
    "mamba_group_span",
    "mamba_group_span",
    "mamba_head_span",
)
# A Mamba1 mixer's first projection (x and z) and its convolution's channels, in place of a
# Mamba2 mixer's of the same names (Jamba's, and Mamba's own models').
MAMBA1_FUSED = {
    "mamba.in_proj": ("mamba_inner_span", "mamba_inner_span"),
    "mamba.conv1d": ("mamba_inner_span",),
    "mixer.in_proj": ("mamba_inner_span", "mamba_inner_span"),
    "mixer.conv1d": ("mamba_inner_span",),
}
# Projections holding several parts one above the other, each part split as its own projection
# is: Phi-3's q, k and v; Phi-3's and GLM's gate and up; GraniteMoeShared's gate and up of the MLP
# every token runs.
FUSED_ROW_SHARES = {
    "self_attn.qkv_proj": ("query_span", "kv_span", "kv_span"),
    "mlp.gate_up_proj": ("channel_span", "channel_span"),
    "shared_mlp.input_linear": ("shared_span", "shared_span"),
    # A Gated DeltaNet's q, k and v, and its convolution's channels over them.
    "linear_attn.in_proj_qkv": ("linear_key_span", "linear_key_span", "linear_value_span"),
    "linear_attn.conv1d": ("linear_key_span", "linear_key_span", "linear_value_span"),
    # LFM2's short convolution's projection to B, C and x, and its channels.
    "conv.in_proj": ("conv_span", "conv_span", "conv_span"),
    "conv.conv": ("conv_span",),
    # A Mamba2 mixer's z, x, B, C and dt, and its convolution's channels over x, B and C.
    "mamba.in_proj": MAMBA2_IN_PARTS,
    "mamba.conv1d": ("mamba_inner_span", "mamba_group_span", "mamba_group_span"),
    # (and Nemotron-H's Mamba2 blocks' mixers)
    "mixer.in_proj": MAMBA2_IN_PARTS,
    "mixer.conv1d": ("mamba_inner_span", "mamba_group_span", "mamba_group_span"),
}
COLUMN_SHARES = {
    "self_attn.o_proj": "output_span",
    "mlp.down_proj": "channel_span",
    "mlp.fc2": "channel_span",
    "mlp.c_proj": "channel_span",
    "mlp.shared_expert.down_proj": "shared_span",
    "mlp.shared_experts.down_proj": "shared_span",
    "shared_mlp.output_linear": "shared_span",
    "linear_attn.out_proj": "linear_value_span",
    # LFM2's attention's and convolution's output projections, and its MLP's down.
    "self_attn.out_proj": "output_span",
    "conv.out_proj": "conv_span",
    "feed_forward.w2": "channel_span",
    "feed_forward.down_proj": "channel_span",
    "mamba.out_proj": "mamba_inner_span",
    "mixer.o_proj": "output_span",
    "mixer.down_proj": "channel_span",
    "mixer.shared_experts.down_proj": "shared_span",
    "mixer.out_proj": "mamba_inner_span",
    # A Mamba1 mixer's projection of its channels to the step, B and C.
    "mamba.x_proj": "mamba_inner_span",
    "mixer.x_proj": "mamba_inner_span",
}
# Projections every rank keeps whole whose outputs the ranks sum (Nemotron-H's projection out
# of its experts' latent width, after their partial sums): rank 0 alone keeps the bias.
BIASED_ONCE = ("mixer.fc2_latent_proj",)
# (the last two Nemotron-H's and Mamba's own models')
VOCAB_MODULES = ("embed_tokens", "lm_head", "model.embeddings", "backbone.embeddings")
# The weights of q's and k's norms over all heads at once, split as q's and k's rows are.
HEAD_NORM_SHARES = {"self_attn.q_norm": "query_span", "self_attn.k_norm": "kv_span"}
# The weights of norms over a mixer's channels, split as its channels are (a Mamba2 mixer's).
NORM_SHARES = {"mamba.norm": "mamba_inner_span", "mixer.norm": "mamba_inner_span"}


def row_share(module_name: str, shape: ShardShape) -> slice | None:
    """The output rows (the vocabulary rows of the embedding and the LM head) this rank keeps
    of the module so named; None where it keeps no rows apart."""
    if module_name.endswith(VOCAB_MODULES):
        return shape.vocab_span
    if shape.norms_all_heads and module_name.endswith(tuple(HEAD_NORM_SHARES)):
        return _share_in(module_name, HEAD_NORM_SHARES, shape)
    return _share_in(module_name, NORM_SHARES, shape) or _share_in(module_name, ROW_SHARES, shape)


# Per-head parameters, by the end of their names: the rank keeps its heads' entries (gpt-oss's
# sinks, a query head's; a DeltaNet's decays' logs and steps' biases, a value head's).
HEAD_PARAMETERS = {
    "self_attn.sinks": "head_span",
    "linear_attn.A_log": "linear_head_span",
    "linear_attn.dt_bias": "linear_head_span",
    "mamba.A_log": "mamba_head_span",
    "mamba.D": "mamba_head_span",
    "mamba.dt_bias": "mamba_head_span",
    "mixer.A_log": "mamba_head_span",
    "mixer.D": "mamba_head_span",
    "mixer.dt_bias": "mamba_head_span",
}


def parameter_share(name: str, shape: ShardShape) -> slice | None:
    """The entries of the per-head parameter so named this rank keeps; None where the parameter
    is not one."""
    return _share_in(name, HEAD_PARAMETERS, shape)


def fused_row_share(module_name: str, shape: ShardShape) -> list[slice] | None:
    """The rows this rank keeps of each part of the projection so named, where it holds several
    one above the other; None elsewhere."""
    mamba1 = shape.mamba is not None and shape.mamba.mamba1
    for suffix, parts in (
        (FUSED_ROW_SHARES | MAMBA1_FUSED) if mamba1 else FUSED_ROW_SHARES
    ).items():
        if module_name.endswith(suffix):
            return shape.fused_rows(parts)
    return None


def column_share(module_name: str, shape: ShardShape) -> slice | None:
    """The input columns this rank keeps of the module so named; None where not split so."""
    return _share_in(module_name, COLUMN_SHARES, shape)


def _share_in(module_name: str, shares: dict[str, str], shape: ShardShape) -> slice | None:
    for suffix, span in shares.items():
        if module_name.endswith(suffix):
            return getattr(shape, span)
    return None


def _shard_vocab(hf_model: Any, shape: ShardShape) -> None:
    """This rank's vocabulary rows of the embedding and the LM head, zero rows padding the last
    share; a tied head keeps sharing the embedding's (new) weight."""
    embedding = hf_model.get_input_embeddings()
    head = hf_model.get_output_embeddings()
    tied = head.weight is embedding.weight
    rows = shape.vocab_span
    weight = nn.Parameter(_padded_rows(embedding.weight, rows), requires_grad=False)
    new_embedding = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
    new_embedding.weight = weight
    hf_model.set_input_embeddings(new_embedding)
    if tied:
        new_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        new_head.weight = weight
        if head.bias is not None:
            new_head.bias = nn.Parameter(_padded_rows(head.bias, rows), requires_grad=False)
    else:
        new_head = _rows(head, rows, pad=True)
    hf_model.set_output_embeddings(new_head)


def _span(start: int, length: int) -> slice:
    return slice(start, start + length)


def _rows(linear: Any, rows: slice, pad: bool = False) -> nn.Linear:
    """A linear layer computing only the output rows `rows` of `linear`."""
    weight = _padded_rows(linear.weight, rows) if pad else linear.weight[rows]
    bias = linear.bias
    if bias is not None:
        bias = _padded_rows(bias, rows) if pad else bias[rows]
    return _linear(weight, bias)


def _fused_rows(linear: Any, parts: list[slice]) -> nn.Linear:
    """A linear layer computing the rows `parts` of `linear`, one part above the other."""
    weight = torch.cat([linear.weight[rows] for rows in parts])
    bias = linear.bias
    if bias is not None:
        bias = torch.cat([bias[rows] for rows in parts])
    return _linear(weight, bias)


def _columns(linear: Any, columns: slice, keep_bias: bool) -> nn.Linear:
    """A linear layer over the input columns `columns` of `linear`: a partial sum of its output;
    the bias stays with one rank only, so the sum over ranks adds it once."""
    bias = linear.bias if keep_bias else None
    return _linear(linear.weight[:, columns], bias)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A linear layer holding copies of `weight` and `bias`, so that the whole weights they
    were cut from are freed."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = _parameter(weight)
    if bias is not None:
        linear.bias = _parameter(bias)
    return linear


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(
        tensor.detach().clone(memory_format=torch.contiguous_format), requires_grad=False
    )


def _padded_rows(tensor: torch.Tensor, rows: slice) -> torch.Tensor:
    """`tensor[rows]` as a copy, zero rows past the end."""
    return padded_rows(lambda span: tensor[span].detach().clone(), tensor.shape[0], rows)


def padded_rows(read: Callable[[slice], torch.Tensor], length: int, rows: slice) -> torch.Tensor:
    """Rows `rows` of a tensor of `length` rows (`read(span)` gives any span of them), zero
    rows where they run past its end."""
    part = read(slice(min(rows.start, length), min(rows.stop, length)))
    missing = rows.stop - rows.start - part.shape[0]
    if missing == 0:
        return part
    padding = torch.zeros((missing, *part.shape[1:]), dtype=part.dtype, device=part.device)
    return torch.cat([part, padding])


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's share of a model and the group it shares the model with."""

    group: ParallelGroup
    shape: ShardShape
