"""Qwen3.5's text models (dense, and with experts in every layer) and Qwen3-Next (Qwen3.5's layers
with experts, its DeltaNet's projections grouped by key head, regrouped once as Qwen3.5's at
load) on Conveyor's decoder: three in
four layers mix tokens by a Gated DeltaNet (linear attention with a recurrent state per request),
the others attend with an output gate. A DeltaNet layer projects each normed row to q, k and v
(through a short causal convolution and silu), to a gate `z`, and to each value head's write
strength `beta` and decay `g`; each request's state `[value heads, key dims, value dims]` decays by
`exp(g)` and takes the delta rule's correction of each token (`S += k (beta (v - S^T k))^T`), read
out by q; the output is normed, gated by silu(z) and projected. Both the convolution's last inputs
and the state stay per request in the state cache (`kv/state_cache.py`). An attention layer's q
projection holds each head's query beside its gate; q and k are normed per head, rotate over their
first quarter, and the attention's output is multiplied by sigmoid(gate) before o. Every norm scales
by one plus its weight (the model's own modules compute them). Decode steps run op by op.

The delta rule runs a step's decode rows together, one token each (`decode_rows`: on the CPU
Conveyor's kernel, one pass of a core over each row's state in place; elsewhere torch's products a
row at a time), and each prompt chunk by chunks of 64 tokens as transformers'
reference computes it (`prompt_rows`), from the state the request holds.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.kernels.cpu import ops as cpu_ops
from engine.kv.state_cache import StateCache, StateSpec, convolved_state_specs
from engine.lora.adapter import Shapes
from engine.models import chunk_decays
from engine.models.experts import is_sparse
from engine.models.layers import add_projected, fuse
from engine.models.llama import (
    PagedLlamaForCausalLM,
    PagedLlamaLayer,
    hybrid_layers,
    not_plain,
)
from engine.parallel.layers import reduced
from engine.parallel.sharding import Shard

QWEN3_5_ARCHITECTURES = frozenset(
    {"Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"}
)


class _OwnNorms:
    """Layers whose norms are the model's own modules (one plus the weight, in fp32)."""

    @staticmethod
    def _norm(norm: Any, hidden: torch.Tensor, projection: nn.Module) -> torch.Tensor:
        return norm(hidden)


class GatedAttentionLayer(_OwnNorms, PagedLlamaLayer):
    """A Qwen3.5 attention layer; `index` is its place in the KV cache. LoRA adapters of its
    projections add their deltas where PEFT's merged weights would."""

    def _attention_parts(self, attn: Any, group: Any) -> None:
        super()._attention_parts(attn, group)
        self.num_heads //= 2  # q's projection holds each head's query and gate
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.qk_norm_weight = None

    def _target_shapes(self) -> Shapes:
        shapes = super()._target_shapes()
        hidden, queries = shapes["q_proj"]
        return shapes | {"q_proj": (hidden, 2 * queries)}  # each head's query and gate

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        lora = self.active_lora()
        normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        qkv = self.qkv_proj(normed)
        if lora is not None and lora.adapts(self.lora_index, "qkv"):
            qkv = qkv + lora.delta(self.lora_index, "qkv", normed).to(qkv.dtype)
        tokens, heads, dim = qkv.shape[0], self.num_heads, self.head_dim
        kv = self.num_kv_heads * dim
        query_gate = qkv[:, : 2 * heads * dim].view(tokens, heads, 2 * dim)
        query = self.q_norm(query_gate[..., :dim])
        gate = query_gate[..., dim:].reshape(tokens, heads * dim)
        key = self.k_norm(qkv[:, 2 * heads * dim : 2 * heads * dim + kv].view(tokens, -1, dim))
        value = qkv[:, 2 * heads * dim + kv :].reshape(tokens, -1, dim)
        query, key = self._rotate(query, cos, sin), self._rotate(key, cos, sin)
        out = metadata.backend.forward(
            self.index, query, key, value, self.scaling, metadata, self.attention
        )
        attended = out.reshape(tokens, heads * dim) * torch.sigmoid(gate)
        hidden = add_projected(self.o_proj, attended, hidden)
        if lora is not None and lora.adapts(self.lora_index, "o"):
            hidden = hidden + lora.delta(self.lora_index, "o", attended).to(hidden.dtype)
        return self._mlp(self.post_attention_norm(hidden), hidden, lora)


class GatedDeltaNetLayer(_OwnNorms, PagedLlamaLayer):
    """A Qwen3.5 linear attention layer; `index` is the place of its first state (its
    convolution's last inputs; its recurrent state follows). Under tensor parallelism it holds
    the rank's key heads and the value heads they serve, and their states. LoRA adapters of
    its MLP apply; its DeltaNet's projections take none."""

    states_split = True
    adapted = True

    def _attention_parts(self, net: Any, group: Any) -> None:
        self.net = net
        self.key_dim, self.value_dim = int(net.key_dim), int(net.value_dim)
        self.value_heads, self.value_head_dim = int(net.num_v_heads), int(net.head_v_dim)
        self.key_head_dim = int(net.head_k_dim)
        # q, k and v (convolved), z, b and a from the same normed rows: one projection.
        self.qkv_proj = fuse(input_projections(net))
        self.taps = net.conv1d.weight.detach()[:, 0].t().contiguous()
        self.out_proj = reduced(net.out_proj, group)
        self.attention = None
        self.layer_type = "linear_attention"

    def _target_shapes(self) -> Shapes:
        """Its dense MLP's projections (none where its MLP is experts)."""
        return self._mlp_shapes(cast(int, self.qkv_proj.in_features))

    def state_specs(self) -> list[StateSpec]:
        """A request's convolution inputs and its recurrent state."""
        recurrent = (self.value_heads, self.key_head_dim, self.value_head_dim)
        return convolved_state_specs(self.taps, recurrent)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        states = metadata.kv_cache.states
        assert states is not None, "a recurrent model runs with its states"
        normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        sizes = [self.key_dim * 2 + self.value_dim, self.value_dim, self.value_heads]
        mixed, z, b, a = self.qkv_proj(normed).split([*sizes, self.value_heads], dim=-1)
        mixed = states.convolve(self.index, mixed, self.taps, None, silu=True)
        tokens = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = b.sigmoid()
        g = -self.net.A_log.float().exp() * F.softplus(a.float() + self.net.dt_bias)
        out = delta_rule(
            states,
            self.index + 1,
            q.reshape(tokens, -1, self.key_head_dim),
            k.reshape(tokens, -1, self.key_head_dim),
            v.reshape(tokens, -1, self.value_head_dim),
            g,
            beta,
        )
        per_head = (-1, self.value_head_dim)
        gated = self.net.norm(out.reshape(per_head), z.reshape(per_head))
        hidden = add_projected(self.out_proj, gated.reshape(tokens, self.value_dim), hidden)
        lora = self.active_lora()
        return self._mlp(self.post_attention_norm(hidden), hidden, lora)


def input_projections(net: Any) -> list[nn.Module]:
    """A DeltaNet's projections to q, k, v, z, b and a, in that order, each by heads in turn:
    Qwen3.5's own four; Qwen3-Next's two (`in_proj_qkvz`, `in_proj_ba`), which hold each key
    head's q, k, v and z rows together (v and z of the value heads it serves) and its b and a,
    regrouped once into that order (copies: the model's own modules keep their layout)."""
    if not hasattr(net, "in_proj_qkvz"):
        return [net.in_proj_qkv, net.in_proj_z, net.in_proj_b, net.in_proj_a]
    groups = int(net.num_k_heads)
    served = int(net.num_v_heads) // groups
    key, value = int(net.head_k_dim), int(net.head_v_dim) * served
    q, k, v, z = _by_part(net.in_proj_qkvz, groups, [key, key, value, value])
    b, a = _by_part(net.in_proj_ba, groups, [served, served])
    return [q, k, v, z, b, a]


def _by_part(linear: nn.Module, groups: int, sizes: list[int]) -> list[nn.Linear]:
    """A projection whose rows run group by group, each group its parts of `sizes` rows in turn,
    as one linear layer a part, holding that part's rows of every group in group order."""
    weight = cast(torch.Tensor, linear.weight).detach()
    parts = weight.view(groups, sum(sizes), weight.shape[1]).split(sizes, dim=1)
    made = []
    for part in parts:
        rows = part.reshape(-1, weight.shape[1])
        with torch.device("meta"):
            projection = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
        projection.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
        made.append(projection)
    return made


def delta_rule(
    states: StateCache,
    index: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule over the step's tokens (`[tokens, heads, dims]`), each request from
    its state `index`, which it leaves updated: decode rows together (a verifying request's
    rows in one call, each from the state of the row before), a prompt chunk at a time (the
    chunks of one length together, each row's heads beside the others')."""

    def decode(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        state: torch.Tensor,
        slots: np.ndarray,
        sources: np.ndarray | None = None,
    ) -> torch.Tensor:
        read = None if sources is None else sources.tolist()
        return decode_rows(q, k, v, g, beta, state, slots.tolist(), read)

    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return states.recur(index, (q, k, v, g, beta), decode, prompt_rows, out, chains=True)


def decode_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: list[int],
    sources: list[int] | None = None,
) -> torch.Tensor:
    """One token of each row (`q`, `k` `[rows, key heads, key dims]`, `v` `[rows, value heads,
    value dims]`, `g`, `beta` `[rows, value heads]`) through the rule, row i from its state
    `states[slots[i]]` `[value heads, key dims, value dims]` (fp32), updated in place (or, with
    `sources`, read from `states[sources[i]]` and written to its slot, the rows in order, so
    that a row may read the state an earlier one wrote); the output in fp32. On the CPU
    Conveyor's kernel reads each state once for both of its products and updates it while
    still in cache; elsewhere `decode_rows_torch`."""
    if not (states.is_cpu and cpu_ops.has("recurrent")):
        return decode_rows_torch(q, k, v, g, beta, states, slots, sources)
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    read = None if sources is None else torch.tensor(sources)
    return cpu_ops.gated_delta_decode(q, k, v, g, beta, states, torch.tensor(slots), read)


def decode_rows_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: list[int],
    sources: list[int] | None = None,
) -> torch.Tensor:
    """`decode_rows` in torch's ops, a row at a time over its state in place (never gathered;
    from its source's state first, where it has one):
    the state decays by `a = exp(g)` and takes `k d^T`, where `d = beta (v - a S^T k)`, and the
    output is its read by q, `a S^T q + (q . k) d` (l2-normed q and k, q scaled by the key dims'
    root, as transformers' reference computes it)."""
    rows, heads, value_dims = v.shape
    q, k = _rule_qk(q, k, heads)
    decay = g.float().exp()
    both = torch.stack([k, q], dim=2)  # [rows, heads, 2, key dims]
    dots = (q * k).sum(dim=-1)
    out = torch.empty((rows, heads, value_dims), dtype=torch.float32, device=v.device)
    for row, slot in enumerate(slots):
        if sources is not None and sources[row] != slot:
            states[slot].copy_(states[sources[row]])
        state, a = states[slot], decay[row, :, None]
        known, read = torch.bmm(both[row], state).unbind(dim=1)  # [heads, value dims] each
        written = (v[row].float() - a * known) * beta[row, :, None].float()
        out[row] = a * read + dots[row, :, None] * written
        state.mul_(a[..., None]).baddbmm_(k[row, :, :, None], written[:, None])
    return out


# Tokens a chunk of a prompt's rule: within one, the rule is a few products; chunks run in turn.
RULE_CHUNK = 64


def prompt_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """A prompt chunk's tokens (`q`, `k` `[tokens, key heads, key dims]`, `v` `[tokens, value
    heads, value dims]`, `g`, `beta` `[tokens, value heads]`) through the rule from one request's
    `state` `[value heads, key dims, value dims]` (fp32), updated in place; the output in fp32.
    By chunks of `RULE_CHUNK` tokens, as transformers' reference computes it: within a chunk the
    delta rule's corrections come from one unit lower triangular solve (its UT transform), and
    each chunk reads the state the chunks before it left. Each whole-prompt operand is written
    once, in the layout its products read (heads first, by chunks); what scales a chunk's rows
    by their decays is done a chunk at a time, while the chunk is in cache."""
    tokens, heads, value_dims = v.shape
    key_dims = k.shape[-1]
    count = -(-tokens // RULE_CHUNK)
    padded = count * RULE_CHUNK
    chunks = (heads, count, RULE_CHUNK)
    g, beta = (_heads_first(x, padded).view(chunks) for x in (g, beta))
    q = _normed_heads(q, heads, padded, key_dims**-0.5).view(*chunks, key_dims)
    k = _normed_heads(k, heads, padded, 1.0).view(*chunks, key_dims)
    decays = g.cumsum(-1)  # each position's decay since the chunk began, in log space
    between = chunk_decays.pairwise(decays)
    solved = _corrections(v, k, beta, decays, between)
    values, reads = solved[..., :value_dims], solved[..., value_dims:]
    kt = k.transpose(-1, -2)
    within = (q @ kt).mul_(between)
    read_decay = decays.exp()[..., None]
    last = decays[..., -1:]
    write_decay = (last - decays).exp()[..., None]
    chunk_decay = last.exp()[..., None]
    out = torch.empty((padded, heads, value_dims), dtype=torch.float32, device=v.device)
    for i in range(count):
        corrected = torch.baddbmm(values[:, i], reads[:, i], state, alpha=-1)
        part = torch.bmm(q[:, i], state).mul_(read_decay[:, i]).baddbmm_(within[:, i], corrected)
        out[i * RULE_CHUNK : (i + 1) * RULE_CHUNK] = part.transpose(0, 1)
        state.mul_(chunk_decay[:, i]).baddbmm_(kt[:, i], corrected.mul_(write_decay[:, i]))
    return out[:tokens]


def _corrections(
    v: torch.Tensor,
    k: torch.Tensor,
    beta: torch.Tensor,
    decays: torch.Tensor,
    pairwise: torch.Tensor,
) -> torch.Tensor:
    """Each chunk's corrections `[heads, chunks, RULE_CHUNK, value dims + key dims]`: of
    `v beta` and of `k beta exp(decay)`, side by side, solved from one unit lower triangular
    system a chunk, `I + tril(beta k k^T * pairwise)`, in place of the right-hand side."""
    tokens, heads, value_dims = v.shape
    padded = beta.shape[1] * RULE_CHUNK
    solved = torch.empty(
        (heads, padded, value_dims + k.shape[-1]), dtype=torch.float32, device=v.device
    )
    torch.mul(
        v.transpose(0, 1),
        beta.view(heads, padded)[:, :tokens, None],
        out=solved[:, :tokens, :value_dims],
    )
    solved[:, tokens:, :value_dims] = 0
    solved = solved.view(*beta.shape, -1)
    torch.mul(k, (beta * decays.exp())[..., None], out=solved[..., value_dims:])
    # The solve reads the strict lower triangle alone (the diagonal is taken as ones).
    system = (k @ k.transpose(-1, -2)).mul_(pairwise).mul_(beta[..., None])
    torch.linalg.solve_triangular(system, solved, upper=False, unitriangular=True, out=solved)
    return solved


def _heads_first(x: torch.Tensor, padded: int) -> torch.Tensor:
    """`[tokens, heads]` as `[heads, padded]` in fp32, zeros after the tokens."""
    held = x.new_zeros((x.shape[1], padded), dtype=torch.float32)
    held[:, : x.shape[0]] = x.t()
    return held


def _normed_heads(x: torch.Tensor, heads: int, padded: int, scale: float) -> torch.Tensor:
    """`x` `[tokens, key heads, dims]` as the rule reads it, `[heads, padded, dims]` in fp32 in
    one pass: l2-normed, times `scale`, a key head repeated for each value head it serves
    (consecutive ones), zeros after the tokens."""
    tokens, key_heads, dims = x.shape
    ratio = heads // key_heads
    norms = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    factor = norms.square_().add_(1e-6).rsqrt_().mul_(scale)
    held = torch.empty((heads, padded, dims), dtype=torch.float32, device=x.device)
    rows = x.transpose(0, 1)[:, None].expand(key_heads, ratio, tokens, dims)
    written = held.view(key_heads, ratio, padded, dims)[:, :, :tokens]
    torch.mul(rows, factor.t()[:, None, :, None], out=written)
    held[:, tokens:] = 0
    return held


def _rule_qk(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the rule reads them, `[tokens, heads, key dims]` in fp32 (`_normed_heads`
    with the tokens first): a key head's repeated for each value head it serves, l2-normed, q
    scaled by the key dims' root."""
    tokens, scale = q.shape[0], q.shape[-1] ** -0.5
    normed = (_normed_heads(x, heads, tokens, s) for x, s in ((q, scale), (k, 1.0)))
    q, k = (x.transpose(0, 1) for x in normed)
    return q, k


def why_not_run(hf_model: Any) -> str:
    """Empty where every projection of the model is a plain linear layer, else why not."""
    return why_not_run_layers(hf_model.model.layers)


def why_not_run_layers(layers: Any) -> str:
    """`why_not_run` over a model's decoder layers (an image-text model's language model's)."""
    attention = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj")
    # Qwen3.5's DeltaNet's projections, then Qwen3-Next's.
    names = (*attention, "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "in_proj_ba")
    for layer in layers:
        mixer = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
        mlp = layer.mlp
        projections = [getattr(mixer, n) for n in names if hasattr(mixer, n)]
        if not is_sparse(mlp):
            projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        reason = not_plain(projections)
        if reason:
            return reason
    return ""


class _Layer:
    """A Qwen3.5 decoder layer under the Llama layer's names (its DeltaNet as `self_attn`)."""

    def __init__(self, layer: Any) -> None:
        self.self_attn = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm


class PagedQwen3_5ForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "Qwen3.5's linear attention layers"

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        return hybrid_layers(base, shard, GatedAttentionLayer, GatedDeltaNetLayer, _Layer)

    def _normed(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden[logits_indices])
