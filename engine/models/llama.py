"""Conveyor's own decoder for the Llama family (Llama, Mistral, Ministral, Qwen2, Qwen3, SmolLM3,
whose NoPE layers rotate nothing, CWM, Seed-OSS), and its mixture-of-experts kin (Mixtral,
Qwen2-MoE, Qwen3-MoE), whose layers differ only in the MLP.

It takes its weights from the loaded Hugging Face model and computes the same thing with fewer
kernel launches: q, k and v come from one fused projection and gate and up from another, rotary
embeddings rotate q and k in one pass, and the layers call the paged attention directly. Each
block (`layers.py`) picks its own kernel; the route decode steps take (the whole stack or each
layer as one C++ op, or op by op: `kernels/cpu/fused_decode.py`) is chosen once, when the model
is built. The Hugging Face model stays the oracle: greedy tokens from both must agree.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata, DecodeStep, LayerAttention
from engine.attention.hf import layer_window
from engine.kernels.cpu import fused_decode
from engine.kernels.cpu.fused_decode import DecodeRoute
from engine.kernels.cpu.linear import (
    CPU_LINEAR_TYPES,
    GatedPanelLinear,
    PanelLinear,
    takes_bf16_rows,
)
from engine.kv.state_cache import StateSpec
from engine.lora.adapter import Shapes
from engine.lora.slots import LoRASlots
from engine.models.base import ImageRows, with_image_rows, with_layer_rows
from engine.models.experts import SparseMoE, is_sparse
from engine.models.layer_kinds import attending_layers
from engine.models.layers import (
    add_projected,
    fuse,
    gated_activation,
    is_gelu_tanh,
    is_silu,
    rms_norm,
    rotate,
    rotate_pairs,
    scaled_in_fp32,
)
from engine.models.rotary_table import NoRotary, RotaryTable, typed_rotary_tables
from engine.parallel.layers import VocabParallelEmbedding, VocabParallelHead, reduced
from engine.parallel.sharding import Shard
from engine.worker.sampler import row_argmax

ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        # Experts chosen by their scores plus a bias (DeepSeek V3's router) beside shared
        # experts, after dense first layers.
        "Glm4MoeForCausalLM",
        "Dots1ForCausalLM",
        "ExaoneMoeForCausalLM",
        "SolarOpenForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "MiniMaxM2ForCausalLM",
        "OlmoeForCausalLM",
        "HunYuanMoEV1ForCausalLM",
        # Multi-head latent attention over a latent cache (`deepseek`).
        "DeepseekV3ForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "DeepseekV2ForCausalLM",
        "SmolLM3ForCausalLM",
        "Phi3ForCausalLM",
        "GraniteForCausalLM",
        # Granite's scalars over experts chosen by a softmax of their top-k logits, beside an MLP
        # every token runs (GraniteMoeShared's).
        "GraniteMoeForCausalLM",
        "GraniteMoeSharedForCausalLM",
        "Olmo2ForCausalLM",
        "Olmo3ForCausalLM",
        "GlmForCausalLM",
        "Glm4ForCausalLM",
        "GptOssForCausalLM",
        # The Llama layer as it is: Ministral's and CWM's windows on some layers, Seed-OSS's
        # biases (q/k/v, and o where its config says).
        "MinistralForCausalLM",
        "CwmForCausalLM",
        "SeedOssForCausalLM",
        "Exaone4ForCausalLM",
        "HunYuanDenseV1ForCausalLM",
        "Ernie4_5ForCausalLM",
        "HeliumForCausalLM",
        # An MLP without a gate (`down(act(up(x)))`: Arcee's ReLU², Apertus' xIELU); Apertus'
        # norms by other names, and each q and k head normed as Qwen3's.
        "ArceeForCausalLM",
        "ApertusForCausalLM",
        "NanoChatForCausalLM",
        # LayerNorms (a mean subtracted, a bias added) in place of RMSNorms: Jais 2's with a
        # gateless MLP, StableLM's with a partial rotary, StarCoder 2's with both and windows.
        "Jais2ForCausalLM",
        "StableLmForCausalLM",
        "Starcoder2ForCausalLM",
    }
)
LINEAR_TYPES = (nn.Linear, *CPU_LINEAR_TYPES)


def supports(hf_model: Any) -> str:
    """Empty when this module can run the model, else why not."""
    name = type(hf_model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {', '.join(sorted(ARCHITECTURES))}"
    config = hf_model.config
    if getattr(config, "use_parallel_residual", False):
        return "its attention and MLP run side by side (a parallel residual)"
    if getattr(config, "qk_layernorm", False):
        return "its q and k heads are LayerNormed"
    return plain_projections(hf_model.model.layers)


def norm_eps(norm: Any) -> float:
    """An RMSNorm's epsilon, by either name transformers' families give it."""
    found = getattr(norm, "variance_epsilon", None)
    return float(found if found is not None else norm.eps)


def plain_projections(layers: Any) -> str:
    """Empty where every layer's projections are plain linear layers (in any of Conveyor's
    forms), else why not."""
    for layer in layers:
        attn, mlp = layer.self_attn, layer_mlp(layer)
        projections = query_projections(attn)
        if not is_sparse(mlp):
            if getattr(mlp, "experts", None) is not None:
                return f"its experts ({type(mlp.experts).__name__}) are not ones Conveyor runs"
            projections += gate_projections(mlp)
        reason = not_plain(projections)
        if reason:
            return reason
    return ""


def not_plain(projections: list[Any]) -> str:
    """Empty where every one of `projections` is a plain linear layer (in any of Conveyor's
    forms), else why not."""
    if all(type(p) in LINEAR_TYPES for p in projections):
        return ""
    return "its projections are not plain linear layers (quantized weights?)"


def layer_mlp(layer: Any) -> Any:
    """A decoder layer's MLP or mixture of experts (Granite MoE's `block_sparse_moe`)."""
    found = getattr(layer, "mlp", None)
    return found if found is not None else layer.block_sparse_moe


def partial_rotary(config: Any) -> float:
    """The share of each head's dims that rotate (1.0 but for Phi-4-mini, GLM and the like), a
    config field or one of its rope parameters."""
    found = getattr(config, "partial_rotary_factor", None)
    if found is None:
        rope = getattr(config, "rope_parameters", None)
        found = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(found or 1.0)


def query_projections(attn: Any) -> list[Any]:
    """q, k and v's projections, or the one that holds all three (Phi-3's `qkv_proj`), or
    latent attention's (DeepSeek's: q's, or its two low-rank ones, and the latent's)."""
    fused = getattr(attn, "qkv_proj", None)
    if fused is not None:
        return [fused]
    if getattr(attn, "kv_a_proj_with_mqa", None) is not None:
        names = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
        return [p for p in (getattr(attn, name, None) for name in names) if p is not None]
    return [attn.q_proj, attn.k_proj, attn.v_proj]


def gate_projections(mlp: Any) -> list[Any]:
    """Gate and up's projections, or the one that holds both, gate first (Phi-3's), or up's
    alone where the MLP has no gate (Arcee's, Apertus')."""
    fused = getattr(mlp, "gate_up_proj", None)
    if fused is not None:
        return [fused]
    if not_gated(mlp):
        return [mlp_part(mlp, UP_NAMES)]
    return [mlp.gate_proj, mlp.up_proj]


def not_gated(mlp: Any) -> bool:
    """Whether the MLP computes `down(act(up(x)))`, with no gate."""
    return getattr(mlp, "gate_proj", None) is None and getattr(mlp, "gate_up_proj", None) is None


# A gateless MLP's projections and activation by each family's names (Llama's, nanochat's,
# StarCoder 2's; Phi-3's activation).
UP_NAMES = ("up_proj", "fc1", "c_fc")
DOWN_NAMES = ("down_proj", "fc2", "c_proj")
ACT_NAMES = ("act_fn", "activation_fn", "act")


def mlp_part(mlp: Any, names: tuple[str, ...]) -> Any:
    """The MLP's module by the first of `names` it has."""
    for name in names:
        part = getattr(mlp, name, None)
        if part is not None:
            return part
    raise AttributeError(f"{type(mlp).__name__} has none of {', '.join(names)}")


def layer_norm(norm: Any, x: torch.Tensor) -> torch.Tensor | None:
    """`x` through `norm` itself where it is a LayerNorm (Jais 2's, StableLM's, StarCoder 2's:
    a mean subtracted, a bias added), else None: the caller's RMSNorm applies."""
    return norm(x) if isinstance(norm, nn.LayerNorm) else None


class PagedLlamaLayer(nn.Module):
    """One decoder layer; under tensor parallelism (`shard`) it holds the rank's heads and
    channels, and the o and down projections sum their partial products over the ranks."""

    # Whether per-head q/k norms come after the rotary (HunYuan's) rather than before (Qwen3's).
    norms_rotated = False
    # Whether the MLP has a gate (`down(act(gate(x)) * up(x))`), else `down(act(up(x)))`.
    gated = True
    # Whether its activation is GELU's tanh approximation (Gemma's).
    gelu_tanh = False
    # Whether 16-bit q and k heads are normed and scaled in fp32, cast after (Gemma's), rather
    # than normed in fp32 and scaled in their dtype (fp32 heads: the same either way).
    qk_scaled_in_fp32 = False
    # The norms of the attention's and the MLP's outputs before they join the residual
    # (Gemma's, OLMo 2's), or None.
    output_norms: tuple[Any, Any] | None = None
    # Whether q and k are each normed over all their heads at once by `_qk_norm` (OLMo 2's, whose
    # norm the fused CPU decode computes too), rather than head by head.
    qk_norm_all_heads = False
    # Whether the rotary turns neighbouring dims as pairs (GLM's, ERNIE 4.5's, Helium's) rather
    # than each head's two halves.
    paired_rotary = False
    # Whether 16-bit q and k heads rotate in fp32, cast back after (ERNIE 4.5's).
    rotary_in_fp32 = False

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, layer_mlp(hf_layer)
        self.index = index
        # The layer's place in the decoder, where its adapters' weights are kept (`index` is
        # its place in the KV cache, or among the states, in a model with both kinds).
        self.lora_index = index
        group = shard.group if shard is not None else None
        self._attention_parts(attn, group)
        # A mixture of experts in place of the gated MLP (summed over the ranks as a whole).
        self.moe = reduced(SparseMoE(mlp), group) if is_sparse(mlp) else None
        if self.moe is None:
            self._dense_mlp(mlp, group)
        else:
            self.silu = self.gelu_tanh = False
        # None where nothing is normed before the attention (OLMo 2 norms after it instead).
        self.input_norm = getattr(hf_layer, "input_layernorm", None)
        self.post_attention_norm: Any = getattr(hf_layer, "post_attention_layernorm", None)
        if self.post_attention_norm is None:  # Apertus' names for the same two norms
            self.input_norm = hf_layer.attention_layernorm
            self.post_attention_norm = hf_layer.feedforward_layernorm
        # LoRA adapters' slots (`--enable-lora`), shared by every layer.
        self.lora: LoRASlots | None = None
        self._lora_shapes = self._target_shapes()

    def _attention_parts(self, attn: Any, group: Any) -> None:
        """The attention's heads, projections (q, k and v fused), features and q/k norms."""
        self.head_dim = attn.head_dim
        fused_qkv = getattr(attn, "qkv_proj", None)
        if fused_qkv is not None:  # Phi-3: q, k and v in one projection already
            # (a rank's share of it: its query heads, and its KV heads twice)
            self.num_heads = attn.config.num_attention_heads // (group.size if group else 1)
            rows = fused_qkv.out_features // self.head_dim
            self.num_kv_heads = (rows - self.num_heads) // 2
        else:
            self.num_heads = attn.q_proj.out_features // self.head_dim
            self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = attn.scaling
        # Dims of each head that rotate, the first ones (Phi-4-mini's partial rotary).
        self.rotary_dim = int(self.head_dim * partial_rotary(getattr(attn, "config", None)))
        # A sliding window (Mistral's, Qwen2's sliding layers, gpt-oss's), and gpt-oss's sinks.
        self.attention = LayerAttention.of(layer_window(attn), sinks=getattr(attn, "sinks", None))
        # SmolLM3's NoPE layers rotate neither q nor k.
        self.rotates = bool(getattr(attn, "use_rope", True))
        # The layer's type (sliding or full attention), whose rotary it takes where the
        # frequencies differ by type.
        layer_types = getattr(getattr(attn, "config", None), "layer_types", None)
        self.layer_type: str | None = layer_types[self.index] if layer_types else None
        self.qkv_proj = fused_qkv or fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = reduced(attn.o_proj, group)
        self.qk_norm_weight = self._qk_norm_weight(attn)
        norms = self._qk_norms(attn)
        self.qk_norm_eps = norm_eps(norms[0]) if self.qk_norm_weight is not None and norms else 0.0

    def _dense_mlp(self, mlp: Any, group: Any) -> None:
        # By the module the MLP runs, not a config field (a family may name its own field).
        self.act_fn = mlp_part(mlp, ACT_NAMES)
        self.silu = is_silu(self.act_fn)
        self.gelu_tanh = is_gelu_tanh(self.act_fn)
        self.down_proj = reduced(mlp_part(mlp, DOWN_NAMES), group)
        if not_gated(mlp):  # `down(act(up(x)))`: up stands where gate and up would
            self.gated = False
            self.gate_up_proj = mlp_part(mlp, UP_NAMES)
            self.intermediate = int(self.gate_up_proj.out_features)
            return
        projections = gate_projections(mlp)
        self.intermediate = int(projections[0].out_features) // (3 - len(projections))
        if len(projections) == 1:  # Phi-3: gate and up in one projection already
            halves = (
                projections[0].split(self.intermediate)
                if isinstance(projections[0], PanelLinear)
                else None
            )
            self.gate_up_proj = (halves and self._gated_pairs(*halves)) or projections[0]
            return
        # With gated pairs, one op computes silu(gate) * up (or GELU's); else gate and up side
        # by side.
        gated = self._gated_pairs(mlp.gate_proj, mlp.up_proj)
        self.gate_up_proj = gated or fuse([mlp.gate_proj, mlp.up_proj])

    def _gated_pairs(self, gate: nn.Module, up: nn.Module) -> GatedPanelLinear | None:
        """Gate and up as one op that writes only the activation, where the panels and the
        activation allow."""
        if not (self.silu or self.gelu_tanh):
            return None
        return GatedPanelLinear.of(gate, up, gelu=self.gelu_tanh)

    def lora_shapes(self) -> Shapes:
        """`(in, out)` of each projection an adapter may target."""
        return self._lora_shapes

    def _target_shapes(self) -> Shapes:
        hidden = cast(int, self.qkv_proj.in_features)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
        }
        return shapes | self._mlp_shapes(hidden)

    def _mlp_shapes(self, hidden: int) -> Shapes:
        """The dense MLP's projections an adapter may target (none where it is experts)."""
        if self.moe is not None:
            return {}
        inter = self.intermediate
        shapes = {"up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        return shapes | ({"gate_proj": (hidden, inter)} if self.gated else {})

    def _qk_norms(self, attn: Any) -> tuple[Any, Any] | None:
        """The norms of each q and of each k head (Qwen3's `q_norm` and `k_norm`), or None."""
        q_norm = getattr(attn, "q_norm", None)
        return None if q_norm is None else (q_norm, attn.k_norm)

    def _qk_norm_weight(self, attn: Any) -> torch.Tensor | None:
        """Qwen3 normalises each q and k head; one `[q heads + kv heads, dim]` weight does both
        in one pass."""
        norms = self._qk_norms(attn)
        if norms is None:
            return None
        return torch.cat(
            [
                norms[0].weight.expand(self.num_heads, -1),
                norms[1].weight.expand(self.num_kv_heads, -1),
            ]
        )

    def state_specs(self) -> list[StateSpec]:
        """The per-request states the layer keeps (none: it attends, its K/V in the cache)."""
        return []

    def active_lora(self) -> LoRASlots | None:
        """The adapters' slots where the step runs some adapter, else None."""
        return self.lora if self.lora is not None and self.lora.active else None

    # Whether a layer that keeps states splits them under tensor parallelism (each rank its
    # heads' states), and whether it takes LoRA adapters (of its MLP).
    states_split = False
    adapted = False

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        lora = self.active_lora()
        # Eagerly (the class's own methods, not compiled ones set on the layer): compiled pieces
        # and graphs run the base model only.
        if lora is not None:
            query, key, value = type(self).project_qkv(self, hidden, cos, sin, lora)
        else:
            query, key, value = self.project_qkv(hidden, cos, sin)
        out = metadata.backend.forward(
            self.index, query, key, value, self.scaling, metadata, self.attention
        )
        if lora is not None:
            return type(self).after_attention(self, out, hidden, lora)
        return self.after_attention(out, hidden)

    @staticmethod
    def _norm(norm: Any, hidden: torch.Tensor, projection: nn.Module) -> torch.Tensor:
        """The normalized rows for `projection`: in bf16 where it takes bf16 rows."""
        normed = layer_norm(norm, hidden)
        if normed is not None:
            return normed
        return rms_norm(hidden, norm.weight, norm.variance_epsilon, takes_bf16_rows(projection))

    def project_qkv(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoRASlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the layer does before attention: query, key and value of each row, normed,
        projected (plus the step's adapters' deltas) and rotated. Every op is row by row
        (piecewise CUDA graphs capture it)."""
        normed = hidden
        if self.input_norm is not None:  # None: normed after the attention instead
            normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        tokens = normed.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(normed)
        if lora is not None and lora.adapts(self.lora_index, "qkv"):
            qkv += lora.delta(self.lora_index, "qkv", normed).to(qkv.dtype)
        qk = qkv[:, : qk_heads * self.head_dim].view(tokens, qk_heads, self.head_dim)
        if self.qk_norm_weight is not None and not self.norms_rotated:
            qk = self._qk_norm(qk)
        if self.rotates:
            qk = self._rotate(qk, cos, sin)
        if self.qk_norm_weight is not None and self.norms_rotated:
            qk = self._qk_norm(qk)
        value = qkv[:, qk_heads * self.head_dim :].view(tokens, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], value

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q and k heads rotated: each head's halves (Hugging Face's layout) or, for a layer of
        `paired_rotary`, its neighbouring pairs; 16-bit heads in fp32 where `rotary_in_fp32`."""
        turn = rotate_pairs if self.paired_rotary else rotate
        if self.rotary_in_fp32 and qk.dtype != torch.float32:
            return turn(qk.float(), cos.float(), sin.float()).to(qk.dtype)
        return turn(qk, cos, sin)

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """Each q and k head normalised (`[tokens, q heads + kv heads, head_dim]`)."""
        assert self.qk_norm_weight is not None
        if self.qk_scaled_in_fp32 and qk.dtype != torch.float32:
            return scaled_in_fp32(qk, self.qk_norm_weight, self.qk_norm_eps)
        return rms_norm(qk, self.qk_norm_weight, self.qk_norm_eps)

    @property
    def mlp_norm(self) -> Any:
        """The norm of the MLP's input."""
        return self.post_attention_norm

    @property
    def qkv_as_llama(self) -> bool:
        """Whether this layer makes its q, k and v by the Llama layer's own `project_qkv`,
        `_qk_norm` (or OLMo 2's over all heads) and `_rotate`, as the fused CPU decode computes
        them (a family's own rotary or norms keep its decode steps op by op)."""
        cls = type(self)
        norm_as_llama = cls._qk_norm is PagedLlamaLayer._qk_norm or self.qk_norm_all_heads
        return norm_as_llama and all(
            getattr(cls, name) is getattr(PagedLlamaLayer, name)
            for name in ("project_qkv", "_rotate")
        )

    # Whether a family's own `after_attention` is still the attention's output joined to the
    # residual as the fused CPU decode joins it (Granite's, scaled), then `mlp_block`.
    joins_then_mlp_block = False

    @property
    def experts_as_llama(self) -> bool:
        """Whether this is a layer of experts whose `after_attention` is the output projection
        onto the residual (as the fused CPU decode computes it), then `mlp_block`: the fused
        decode can run its attention and leave the rest to that block."""
        cls = type(self)
        split = cls.after_attention is PagedLlamaLayer.after_attention or cls.joins_then_mlp_block
        return self.moe is not None and split and self.output_norms is None

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        """What the layer does after attention (`out`, `[tokens, heads, head_dim]`): the
        output projection onto `residual`, then the MLP block. Row by row too."""
        attended = self._attended(out)
        hidden = add_projected(self.o_proj, attended, residual)
        if lora is not None and lora.adapts(self.lora_index, "o"):
            hidden += lora.delta(self.lora_index, "o", attended).to(hidden.dtype)
        return self.mlp_block(hidden, lora)

    def mlp_block(self, hidden: torch.Tensor, lora: LoRASlots | None = None) -> torch.Tensor:
        """`hidden` (the rows after the attention's residual add) plus the MLP's (or the
        experts') output for them normed: what `after_attention` does after the output
        projection, and what the fused CPU decode runs after a layer of experts' attention."""
        mlp_input = self.gate_up_proj if self.moe is None else self.moe
        normed = self._norm(self.post_attention_norm, hidden, mlp_input)
        return self._mlp(normed, hidden, lora)

    def _mlp(
        self, hidden: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        """`residual` plus the MLP's output."""
        if self.moe is not None:
            return residual + self.moe(hidden)
        activated = self._activation(hidden, lora)
        out = add_projected(self.down_proj, activated, residual)
        if lora is not None and lora.adapts(self.lora_index, "down"):
            out += lora.delta(self.lora_index, "down", activated).to(out.dtype)
        return out

    def _attention_output(self, out: torch.Tensor, lora: LoRASlots | None = None) -> torch.Tensor:
        """The output projection of the attention's `out` (`[tokens, heads, head_dim]`), with
        the step's adapters' deltas: what a family that norms or scales it before the residual
        (Gemma, Granite, OLMo 2, GLM) adds."""
        attended = self._attended(out)
        projected = self.o_proj(attended)
        if lora is not None and lora.adapts(self.lora_index, "o"):
            projected = projected + lora.delta(self.lora_index, "o", attended).to(projected.dtype)
        return projected

    def _attended(self, out: torch.Tensor) -> torch.Tensor:
        """The attention's `out` (`[tokens, heads, head_dim]`) as the output projection takes
        it: each row's heads side by side."""
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def _mlp_output(self, normed: torch.Tensor, lora: LoRASlots | None = None) -> torch.Tensor:
        """The gated MLP's (or the experts') output for its normed input, with the step's
        adapters' deltas."""
        if self.moe is not None:
            return cast(torch.Tensor, self.moe(normed))
        activated = self._activation(normed, lora)
        out = self.down_proj(activated)
        if lora is not None and lora.adapts(self.lora_index, "down"):
            out = out + lora.delta(self.lora_index, "down", activated).to(out.dtype)
        return out

    def _activation(self, hidden: torch.Tensor, lora: LoRASlots | None = None) -> torch.Tensor:
        if not self.gated:
            up = self.gate_up_proj(hidden)
            if lora is not None and lora.adapts(self.lora_index, "up"):
                up = up + lora.delta(self.lora_index, "up", hidden).to(up.dtype)
            return self.act_fn(up)
        if lora is not None and lora.adapts(self.lora_index, "gate_up"):
            gate_up = self._gate_up(hidden)
            gate_up += lora.delta(self.lora_index, "gate_up", hidden).to(gate_up.dtype)
            return self._gated(gate_up)
        if isinstance(self.gate_up_proj, GatedPanelLinear):
            # bf16 down panels take the rows rounded as they leave the gated product.
            return self.gate_up_proj(hidden, bf16_out=takes_bf16_rows(self.down_proj))
        return self._gated(self.gate_up_proj(hidden))

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The activation of gate and up side by side."""
        return gated_activation(gate_up, self.act_fn, self.intermediate, self.silu, self.gelu_tanh)

    def _gate_up(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gate and up side by side, before the activation (the gated op never writes them)."""
        if isinstance(self.gate_up_proj, GatedPanelLinear):
            return self.gate_up_proj.gate_and_up(hidden)
        return self.gate_up_proj(hidden)


class PagedLlamaForCausalLM(nn.Module):
    name = "conveyor"
    # The layer each of the model's decoder layers becomes (a family may have its own).
    layer_class: type[PagedLlamaLayer] = PagedLlamaLayer
    # Why a family's decode steps run op by op whatever its layers (the fused C++ stack computes
    # the Llama layer only), or None: the layers decide.
    op_by_op: str | None = None
    # Whether each layer is the part before an attention call and the part after (what compiled
    # pieces and piecewise CUDA graphs cut a step at); Nemotron-H's blocks are not.
    splits_at_attention = True

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        """`shard`: `hf_model` holds one rank's share of the weights (`parallel.sharding`)."""
        super().__init__()
        base = hf_model.model
        self.shard = shard
        self.embed_tokens = base.embed_tokens
        self.lm_head = hf_model.lm_head
        if shard is not None:
            self.embed_tokens = VocabParallelEmbedding(
                base.embed_tokens, shard.shape.vocab_start, shard.group
            )
            self.lm_head = VocabParallelHead(hf_model.lm_head, shard.shape.vocab_size, shard.group)
        self.rotary_emb = base.rotary_emb if base.rotary_emb is not None else NoRotary()
        positions = getattr(hf_model.config, "max_position_embeddings", 0)
        self.rotary = RotaryTable(self.rotary_emb, positions)
        # One table per layer type where the frequencies differ by type (Gemma 3, OLMo 3).
        self.typed_rotaries = typed_rotary_tables(base.rotary_emb, positions)
        layers = self._decoder_layers(base, shard)
        self.layers = nn.ModuleList(layers)
        self.norm = self._final_norm(base)
        if self.op_by_op is not None:
            self.fused_decode = fused_decode.FusedDecode(DecodeRoute.OPS, reason=self.op_by_op)
        elif shard is not None:
            self.fused_decode = fused_decode.FusedDecode(DecodeRoute.OPS, reason="tensor parallel")
        else:
            self.fused_decode = fused_decode.choose(
                cast(list[PagedLlamaLayer], layers), self.typed_rotaries.keys()
            )
        self.lora: LoRASlots | None = None

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        """Conveyor's layer for each of the Hugging Face model's decoder layers."""
        return [self.layer_class(layer, i, shard) for i, layer in enumerate(base.layers)]

    @staticmethod
    def _final_norm(base: Any) -> Any:
        """The norm of the last layer's rows."""
        return base.norm

    def state_specs(self) -> list[StateSpec]:
        """The per-request states of the layers that keep one, in order (none: every layer
        attends)."""
        return [spec for layer in self._paged_layers for spec in layer.state_specs()]

    def states_split(self) -> bool:
        """Whether every layer that keeps states splits them under tensor parallelism."""
        return all(layer.states_split for layer in self._paged_layers if layer.state_specs())

    def states_adapted(self) -> bool:
        """Whether every layer that keeps states takes LoRA adapters."""
        return all(layer.adapted for layer in self._paged_layers if layer.state_specs())

    def attach_lora(self, slots: LoRASlots) -> None:
        """Serve LoRA adapters from `slots`: a step that runs any takes the layers op by op."""
        self.lora = slots
        for layer in self._paged_layers:
            layer.lora = slots

    def lora_shapes(self) -> list[Shapes]:
        return [layer.lora_shapes() for layer in self._paged_layers]

    @property
    def sparse(self) -> bool:
        """Whether some layer's MLP is a mixture of experts."""
        return any(layer.moe is not None for layer in self._paged_layers)

    @property
    def _paged_layers(self) -> list[PagedLlamaLayer]:
        return [cast(PagedLlamaLayer, layer) for layer in self.layers]

    @property
    def vocab_size(self) -> int:
        """The logits' width (the whole vocabulary under tensor parallelism)."""
        head = self.lm_head
        if isinstance(head, VocabParallelHead):
            return head.vocab_size
        return getattr(head, "out_features", None) or head.weight.shape[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        image_features: ImageRows | None = None,
    ) -> torch.Tensor:
        """Logits of the step; `image_features` (an image-text model's: the flattened indices
        of the tokens they stand for, and the rows) replace those tokens' embeddings."""
        hidden = self._last_hidden(input_ids, positions, metadata, image_features)
        return self.logits(hidden, logits_indices)

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The LM head over the last layer's rows at `logits_indices`, normalized."""
        return self.lm_head(self._normed(hidden, logits_indices))

    def greedy_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        image_features: ImageRows | None = None,
    ) -> torch.Tensor:
        """`forward`'s logits' argmax per row, int64 `[len(logits_indices)]`: chosen as the LM
        head's sums leave the registers where it is bf16 panels (a decode step of 64 rows writes
        12.6 MB of the default model's logits otherwise, and reads them back to choose)."""
        hidden = self._last_hidden(input_ids, positions, metadata, image_features)
        hidden = self._normed(hidden, logits_indices)
        if isinstance(self.lm_head, PanelLinear) and self.lm_head.chooses_greedily:
            return self.lm_head.greedy(hidden)
        return row_argmax(self.lm_head(hidden).float())

    def pooled(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        indices: torch.Tensor,
    ) -> torch.Tensor:
        """The last layer's rows at `indices`, normalized (the LM head's input): the hidden
        states an embedding model pools, `[len(indices), hidden]`."""
        return self._normed(self._last_hidden(input_ids, positions, metadata), indices)

    def _normed(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The kept rows normalized: the LM head's input."""
        kept = hidden[logits_indices]
        normed = layer_norm(self.norm, kept)
        if normed is not None:
            return normed
        return rms_norm(kept, self.norm.weight, self.norm.variance_epsilon)

    def _last_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        image_features: ImageRows | None = None,
    ) -> torch.Tensor:
        """The last layer's output rows."""
        hidden = with_image_rows(self._embedded(input_ids), image_features)
        tables = self._rotary_tables(hidden, positions)
        step = self._fused_step(hidden, metadata)
        if step is not None:
            return self.fused_decode(hidden, tables, step)
        for index, paged in enumerate(self._paged_layers):
            out = paged(hidden, *self._layer_rotary(tables, paged), metadata)
            hidden = with_layer_rows(out, image_features, index)
        return hidden

    def _embedded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, as the first layer takes them."""
        return cast(torch.Tensor, self.embed_tokens(input_ids))

    def _rotary_tables(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin of the step's positions: per layer type where the model's frequencies
        differ by type, else under None."""
        if self.typed_rotaries:
            return {kind: table(hidden, positions) for kind, table in self.typed_rotaries.items()}
        return {None: self.rotary(hidden, positions)}

    @staticmethod
    def _layer_rotary(
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]], layer: PagedLlamaLayer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return tables[layer.layer_type] if layer.layer_type in tables else tables[None]

    def _fused_step(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> DecodeStep | None:
        """The step as the fused decode takes it, where this model's layers fuse, the rows are
        fp32 and the attention backend hands one out (every row decodes); else None."""
        adapted = self.lora is not None and self.lora.active
        if self.fused_decode.route is DecodeRoute.OPS or adapted or not _fp32_rows(hidden):
            return None
        return metadata.backend.decode_step(metadata)


def nope_view(hf_model: Any, embeddings: str, norm: str, decoder: str = "model") -> Any:
    """A causal LM without a rotary (Nemotron-H's, Jamba's, Mamba's) under the Llama causal LM's
    names, its decoder (`decoder`: Mamba's is its `backbone`) holding its embeddings and last
    norm under `embeddings` and `norm`."""
    base = getattr(hf_model, decoder)
    view = SimpleNamespace(
        embed_tokens=getattr(base, embeddings),
        norm=getattr(base, norm),
        layers=base.layers,
        config=base.config,
        rotary_emb=None,
    )
    return SimpleNamespace(model=view, lm_head=hf_model.lm_head, config=hf_model.config)


def hybrid_layers(
    base: Any,
    shard: Shard | None,
    attending: type[PagedLlamaLayer],
    stateful: type[PagedLlamaLayer],
    view: Callable[[Any], Any],
) -> list[nn.Module]:
    """Conveyor's layer for each decoder layer of a model whose layers attend or keep a state
    (LFM2's, Qwen3.5's), over `view(layer)`, the layer under the Llama layer's names: an
    attending layer indexed by its place in the KV cache, a state-keeping one by the place of
    its first state among the model's states."""
    attends = set(attending_layers(base.config))
    layers: list[nn.Module] = []
    cached, held = 0, 0
    for i, layer in enumerate(base.layers):
        if i in attends:
            built = attending(view(layer), cached, shard)
            cached += 1
        else:
            built = stateful(view(layer), held, shard)
            held += len(built.state_specs())
        built.lora_index = i
        layers.append(built)
    return layers


def _fp32_rows(hidden: torch.Tensor) -> bool:
    return (
        hidden.is_cpu
        and hidden.dtype == torch.float32
        and hidden.dim() == 2
        and hidden.is_contiguous()
    )
