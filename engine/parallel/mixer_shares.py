"""What tensor parallelism splits of the recurrent mixers: the heads of a Gated DeltaNet
(Qwen3.5's, Qwen3-Next's) and of a Mamba2 mixer (Granite 4's, Bamba's, Falcon-H1's,
Nemotron-H's, Mamba2's own models'), the channels of a Mamba1 mixer (Jamba's, Mamba's and
Falcon-Mamba's own models') and of LFM2's short convolutions, as a config counts them; whether
they divide; and each Hugging Face mixer's counts set to its share's once it is cut
(`sharding.shard_model`), so that Conveyor's layer reads a smaller mixer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.parallel.sharding import ShardShape


@dataclass(frozen=True, slots=True)
class LinearHeads:
    """A Gated DeltaNet's heads (Qwen3.5's linear attention): its key heads and value heads
    (each key head serves `value_heads // key_heads` consecutive ones) and their dims."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def of(cls, config: Any) -> LinearHeads | None:
        if not getattr(config, "linear_num_value_heads", None):
            return None
        return cls(
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )

    @property
    def served(self) -> int:
        """The value heads each key head serves."""
        return self.value_heads // self.key_heads


@dataclass(frozen=True, slots=True)
class MambaHeads:
    """A Mamba2 mixer's heads (of `head_dim` dims each) and its groups of B and C (of
    `state_dims` each), which the heads read in equal runs (Granite 4's, Bamba's, Falcon-H1's
    config names, Nemotron-H's or Mamba2's own); or a Mamba1 mixer's channels (Jamba's, Mamba's,
    Falcon-Mamba's), each a head of one dim, reading B and C whole (`mamba1`)."""

    heads: int
    head_dim: int
    groups: int
    state_dims: int
    mamba1: bool = False

    @classmethod
    def of(cls, config: Any) -> MambaHeads | None:
        kind = getattr(config, "model_type", "")
        if kind in MAMBA1_MODELS:  # Mamba's own models' names
            return cls(config.intermediate_size, 1, 0, config.state_size, mamba1=True)
        if kind == "mamba2":
            return cls(config.num_heads, config.head_dim, config.n_groups, config.state_size)
        if getattr(config, "mamba_dt_rank", None):  # Jamba's Mamba1
            channels = int(config.mamba_expand * config.hidden_size)
            return cls(channels, 1, 0, config.mamba_d_state, mamba1=True)
        if getattr(config, "mamba_num_heads", None):  # Nemotron-H's names
            heads, head_dim = config.mamba_num_heads, config.mamba_head_dim
            return cls(heads, head_dim, config.n_groups, config.ssm_state_size)
        if not getattr(config, "mamba_n_heads", None):
            return None
        return cls(
            config.mamba_n_heads,
            config.mamba_d_head,
            config.mamba_n_groups,
            config.mamba_d_state,
        )


# The model types of Mamba's own models whose mixers are Mamba1.
MAMBA1_MODELS = frozenset({"mamba", "falcon_mamba"})


def attends(config: Any) -> bool:
    """Whether the config's model has attention heads (Mamba's own models have none)."""
    return bool(getattr(config, "num_attention_heads", None))


def conv_channels(config: Any) -> int:
    """The channels of LFM2's short convolutions (its hidden size); 0 in another model."""
    return int(config.hidden_size) if getattr(config, "conv_L_cache", None) else 0


def why_mixers_do_not_split(config: Any, size: int) -> str:
    """Empty where the config's recurrent mixers split over `size` ranks, else why not."""
    mamba = MambaHeads.of(config)
    if mamba is not None:
        if mamba.heads % size:
            what = "Mamba channels" if mamba.mamba1 else "Mamba2 heads"
            return f"its {mamba.heads} {what} do not divide by {size}"
        if mamba.groups % size and mamba.groups != 1:
            return f"its {mamba.groups} Mamba2 groups neither divide by {size} nor are one"
    linear = LinearHeads.of(config)
    if linear is not None:
        for what, heads in (("key", linear.key_heads), ("value", linear.value_heads)):
            if heads % size:
                return f"its {heads} linear attention {what} heads do not divide by {size}"
    return ""


def count_local_heads(module: Any, shape: ShardShape) -> None:
    """A Hugging Face recurrent mixer's counts of heads (or channels) and widths as its share
    holds them; other modules are left as they are."""
    kind = type(module).__name__
    if kind in GATED_DELTA_NETS:
        _count_delta_net(module, shape.size)
    elif kind in MAMBA2_MIXERS or kind in MAMBA1_MIXERS:
        whole = shape.mamba
        assert whole is not None, "a Mamba mixer's share is cut by its config's heads"
        if kind in MAMBA1_MIXERS:
            module.intermediate_size = whole.heads // shape.size
        else:
            _count_local_mamba(module, whole, shape)


# Hugging Face's Gated DeltaNet classes, whose head counts and widths a share updates.
GATED_DELTA_NETS = frozenset(
    {"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet"}
)


def _count_delta_net(net: Any, size: int) -> None:
    """A Gated DeltaNet's counts of heads and widths as its share holds them."""
    net.num_k_heads //= size
    net.num_v_heads //= size
    net.key_dim = net.num_k_heads * net.head_k_dim
    net.value_dim = net.num_v_heads * net.head_v_dim
    net.conv_dim = 2 * net.key_dim + net.value_dim


# Hugging Face's Mamba2 mixers that a share splits by heads, whose counts it updates.
MAMBA2_MIXERS = frozenset(
    {
        "GraniteMoeHybridMambaLayer",
        "BambaMixer",
        "FalconH1Mixer",
        "NemotronHMamba2Mixer",
        "Mamba2Mixer",
    }
)


# Hugging Face's Mamba1 mixers that a share splits by channels.
MAMBA1_MIXERS = frozenset({"JambaMambaMixer", "MambaMixer", "FalconMambaMixer"})


def _count_local_mamba(mixer: Any, whole: MambaHeads, shape: ShardShape) -> None:
    """A Mamba2 mixer's counts of heads, groups and widths as its share holds them, and how many
    ranks share each of its norm's groups (`norm_ranks`: more than one where the ranks keep the
    one group whole, so that the norm's one group of channels lies across them)."""
    mixer.num_heads = whole.heads // shape.size
    mixer.intermediate_size = mixer.num_heads * whole.head_dim
    mixer.n_groups = shape.local_mamba_groups
    mixer.conv_dim = mixer.intermediate_size + 2 * mixer.n_groups * whole.state_dims
    mixer.norm_ranks = max(1, shape.size // whole.groups)
    if hasattr(mixer.norm, "n_groups"):  # Falcon-H1's norm counts its groups
        mixer.norm.n_groups = whole.groups // shape.size if whole.groups > 1 else 1
