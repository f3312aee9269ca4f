"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-VL-MoE's language model,
gpt-oss, and the families whose router chooses by scores plus a bias, `routing`): a router picks
each token's top-k experts, each expert is a gated MLP of its own (Nemotron-H's an MLP without a
gate), and their outputs are summed with the router's weights (plus a shared expert every token
runs: Qwen2-MoE's behind a sigmoid gate, DeepSeek's kind's as it is). Nemotron 3's experts may
work in a narrower latent width, the rows projected into it and the experts' sum back out.

Hugging Face holds a layer's experts as two 3-d tensors (`gate_up_proj [experts, 2 * inter,
hidden]` with gate above up, `down_proj [experts, hidden, inter]`; gpt-oss's transposed, gate
and up interleaved, with biases). `ExpertLinears` holds them as one gate/up and one down linear
layer per expert instead (views of the same memory; gpt-oss's copied once into that layout), so the
linear-layer forms (`kernels/cpu/linear.py`) take experts as they take any projection: bf16
panels on AVX-512 BF16 and AMX CPUs, fp16 or fp32 panels elsewhere, torch's own on a GPU. It
keeps Hugging Face's `forward(hidden, top_k_index, top_k_weights)`, so the Hugging Face model
runs over it unchanged. `SparseMoE` is Conveyor's whole block: routing, experts, shared expert.

Tokens are grouped by expert on the host (one sort and one count per layer), and only the
experts some token chose run, each over its tokens at once.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import GatedPanelLinear, PanelLinear, takes_bf16_rows
from engine.models.layers import clamped_swiglu, gated_activation, is_silu
from engine.models.routing import BiasedRouter, GroupLimitedRouter, router_of
from engine.parallel.sharding import GATELESS_EXPERTS, HF_EXPERTS, TRANSPOSED_EXPERTS

# Routers without `norm_topk_prob` that still cast their weights to the logits' dtype.
CASTING_ROUTERS = frozenset(
    {
        "Qwen3VLMoeTextTopKRouter",
        "HunYuanMoEV1Gate",
        "GraniteMoeTopKRouter",
        "GraniteMoeSharedTopKRouter",
        "GraniteMoeHybridTopKRouter",
        "Qwen3_5MoeTopKRouter",
        "Qwen3NextTopKRouter",
        "JambaTopKRouter",
    }
)
# Routers that keep the top-k softmax weights as they are, not renormalized (Jamba's).
UNNORMALIZED_ROUTERS = frozenset({"JambaTopKRouter"})
# A block's shared expert by its families' names: Qwen2-MoE's one (behind a gate), DeepSeek's
# kind's shared experts (one MLP as wide as all of them), Hunyuan's MLP every token runs.
SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
# Routers that take the top-k logits (plus a bias) first and softmax over those alone (gpt-oss;
# Granite MoE's in fp32, cast to the rows' dtype).
TOP_LOGIT_ROUTERS = frozenset(
    {
        "GptOssTopKRouter",
        "GraniteMoeTopKRouter",
        "GraniteMoeSharedTopKRouter",
        "GraniteMoeHybridTopKRouter",
    }
)
# Why steps of such a model run eagerly: no CUDA graph or compiled piece holds a host sync.
SPARSE_ON_HOST = "mixture-of-experts layers group their tokens by expert on the host"


def is_sparse(mlp: Any) -> bool:
    """Whether a decoder layer's MLP is a mixture of experts Conveyor runs."""
    experts = getattr(mlp, "experts", None)
    return isinstance(experts, ExpertLinears) or type(experts).__name__ in HF_EXPERTS


def unfuse_experts(model: nn.Module) -> int:
    """Swap each of Hugging Face's fused expert modules in `model` for an `ExpertLinears` over
    the same memory; return how many were swapped. Run before the linear layers take their
    form, which then takes every expert's."""
    swapped = 0
    for parent in list(model.modules()):
        experts = getattr(parent, "experts", None)
        if type(experts).__name__ in HF_EXPERTS:
            parent.experts = ExpertLinears.of(experts)
            swapped += 1
    return swapped


def _silu(experts: Any) -> bool:
    """Whether the experts' activation is silu, by their config (Jamba's experts keep none: by
    their activation's module)."""
    config = getattr(experts, "config", None)
    if config is not None:
        return getattr(config, "hidden_act", None) == "silu"
    return is_silu(experts.act_fn)


def _latent(block: Any, name: str) -> nn.Module | None:
    """The block's projection `name` into or out of its experts' latent width; None where it has
    none (or an identity in its place)."""
    projection = getattr(block, name, None)
    return None if projection is None or isinstance(projection, nn.Identity) else projection


def _view_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """A linear layer over `weight` `[out, in]` (and `bias`) themselves (no copy)."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


class ClampedSwiGLU(nn.Module):
    """gpt-oss's activation over gate and up side by side: gate capped at `limit`, up clamped
    to `[-limit, limit]`, then `(up + 1) * gate * sigmoid(alpha * gate)`."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha = alpha
        self.limit = limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


class ExpertLinears(nn.Module):
    """A layer's experts, each a gate/up projection (`[2 * inter, hidden]`, gate first) and a
    down projection, computing `down(act(gate) * up)` for the tokens routed to it; or, not
    `gated` (Nemotron-H's), an up projection alone in the gate/up's place: `down(act(up))`."""

    def __init__(
        self,
        gate_up: list[nn.Module],
        down: list[nn.Module],
        act_fn: nn.Module,
        silu: bool,
        clamped: ClampedSwiGLU | None = None,
        gated: bool = True,
    ) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act_fn = act_fn
        self.silu = silu
        # gpt-oss's activation in place of `act_fn(gate) * up`.
        self.clamped = clamped
        self.gated = gated
        self.num_experts = len(gate_up)
        self.intermediate = int(cast(nn.Linear, down[0]).in_features)
        # Every expert's panels and biases as `cpu_ops.expert_mlps` takes them, once `group` has
        # found them in a form it takes; None otherwise. Panels over fp32 rows are one such form.
        self._grouped: tuple[list[torch.Tensor | None], ...] | None = None
        self._fp32_rows = False

    @classmethod
    def of(cls, experts: Any) -> ExpertLinears:
        """Over Hugging Face's fused experts' memory, or `experts` itself where it is one."""
        if isinstance(experts, ExpertLinears):
            return experts
        if type(experts).__name__ in TRANSPOSED_EXPERTS:
            return cls._of_transposed(experts)
        if type(experts).__name__ in GATELESS_EXPERTS:
            up, down = experts.up_proj.detach(), experts.down_proj.detach()
            ups: list[nn.Module] = [_view_linear(w) for w in up]
            downs: list[nn.Module] = [_view_linear(w) for w in down]
            return cls(ups, downs, experts.act_fn, silu=False, gated=False)
        gate_up = experts.gate_up_proj.detach()
        down = experts.down_proj.detach()
        return cls(
            [_view_linear(w) for w in gate_up],
            [_view_linear(w) for w in down],
            experts.act_fn,
            _silu(experts),
        )

    @classmethod
    def _of_transposed(cls, experts: Any) -> ExpertLinears:
        """gpt-oss's experts copied once into the `[out, in]` layout, gate above up: the
        loaded tensors are freed with the module they came in."""
        with torch.no_grad():
            weight = experts.gate_up_proj.detach()
            bias = experts.gate_up_proj_bias.detach()
            gate_up = torch.cat([weight[..., 0::2], weight[..., 1::2]], dim=-1)
            gate_up = gate_up.transpose(1, 2).contiguous()
            gate_up_bias = torch.cat([bias[..., 0::2], bias[..., 1::2]], dim=-1)
            down = experts.down_proj.detach().transpose(1, 2).contiguous()
            down_bias = experts.down_proj_bias.detach()
        return cls(
            [_view_linear(w, b) for w, b in zip(gate_up, gate_up_bias, strict=True)],
            [_view_linear(w, b) for w, b in zip(down, down_bias, strict=True)],
            nn.SiLU(),
            silu=False,
            clamped=ClampedSwiGLU(float(experts.alpha), float(experts.limit)),
        )

    def group(self) -> bool:
        """Have a step's experts run as one op (`cpu_ops.expert_mlps`) where they can; returns
        whether they do. They can under silu or the clamped SwiGLU: over bf16 panels, each
        expert's gate/up then made gated bf16 panel pairs (`GatedPanelLinear`: one pass writes
        only the activation, rounded to bf16 for the down product; each joined layer gives way
        to its pairs as they are made), the intermediate size in whole panels; over blocks
        multiplied in bf16 (`PanelLinear.multiply_in_bf16`: MXFP4, GGUF's), as they are; and over
        panels that multiply fp32 rows (fp32, fp16, or blocks widened to fp32: CPUs without
        AVX-512 BF16, fp32 models), as they are."""
        if not (self.gated and (self.silu or self.clamped is not None)):
            return False
        fp32_rows = self._fp32_row_panels()
        if fp32_rows or self._bf16_blocks():
            self._fp32_rows = fp32_rows
            self._grouped = self._grouped_panels()
            return True
        joined = list(self.gate_up)
        if not (
            all(isinstance(g, PanelLinear) and g.bf16_activations for g in joined)
            and all(isinstance(d, PanelLinear) and d.bf16_activations for d in self.down)
        ):
            return False
        halves = [cast(PanelLinear, g).split(self.intermediate) for g in joined]
        if any(h is None for h in halves) or not cpu_ops.bf16_panels_available():
            return False
        for index, pair in enumerate(halves):
            assert pair is not None
            gated = GatedPanelLinear.of(*pair, clamped=self._clamp)
            if gated is None:
                return False
            self.gate_up[index] = gated
        self._grouped = self._grouped_panels()
        return True

    def _bf16_blocks(self) -> bool:
        """Every expert's gate/up and down are contiguous block panels that multiply in bf16
        (GGUF's kept beside a bf16 model, MXFP4's), as the one op takes them."""
        return all(
            isinstance(layer, PanelLinear) and layer.bf16_blocks and layer.panels.is_contiguous()
            for layer in [*self.gate_up, *self.down]
        )

    def _fp32_row_panels(self) -> bool:
        """Every expert's gate/up and down are contiguous panels that multiply fp32 rows (fp32,
        fp16 or blocks widened to fp32), as the one op takes them."""
        return cpu_ops.panel_linear_available() and all(
            isinstance(layer, PanelLinear)
            and layer.panels.dtype in (torch.float32, torch.float16, torch.uint8)
            and not layer.bf16_blocks
            and layer.panels.is_contiguous()
            for layer in [*self.gate_up, *self.down]
        )

    @property
    def _clamp(self) -> tuple[float, float] | None:
        """The clamped SwiGLU's `(alpha, limit)`, as the ops take it; None for silu."""
        return None if self.clamped is None else (self.clamped.alpha, self.clamped.limit)

    @property
    def grouped(self) -> bool:
        """A step's experts run as one op (`group`)."""
        return self._grouped is not None

    @property
    def route(self) -> str:
        """How a step's experts run, for the start-up routes line."""
        if self._grouped is None:
            return "expert by expert"
        if self._fp32_rows:
            return "one op (panels over fp32 rows)"
        if isinstance(self.gate_up[0], GatedPanelLinear):
            return "one op (gated bf16 panel pairs)"
        return "one op (blocks over bf16 rows)"

    def _grouped_panels(self) -> tuple[list[torch.Tensor | None], ...]:
        """Gate/up panels, their biases, down panels and theirs, an entry per expert."""
        gate_up = cast(list[GatedPanelLinear | PanelLinear], list(self.gate_up))
        down = cast(list[PanelLinear], list(self.down))
        return (
            [g.panels for g in gate_up],
            [g.padded_bias for g in gate_up],
            [d.panels for d in down],
            [d.padded_bias for d in down],
        )

    def _apply(self, fn: Any, recurse: bool = True) -> ExpertLinears:
        """As `nn.Module._apply`, the grouped panels then taken again from the moved layers."""
        super()._apply(fn, recurse)
        if self._grouped is not None:
            self._grouped = self._grouped_panels()
        return self

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Each row's experts' outputs `[rows, hidden]`, weighted and summed: row `i` ran
        through experts `top_k_index[i]` with weights `top_k_weights[i]`. The rows are taken
        in expert order once; each expert runs over its own run of them, and one indexed add
        sums each row's weighted outputs in fp32, cast once at the end (as transformers' grouped
        experts sum them). Where the experts are grouped (`group`) all of that is one op, to
        the bit the same."""
        grouped = self._grouped
        if (
            grouped is not None
            and hidden.dtype == torch.float32
            and top_k_weights.dtype == torch.float32
            and hidden.dim() == 2
        ):
            gate_up, gate_up_bias, down, down_bias = grouped
            return cpu_ops.expert_mlps(
                hidden.contiguous(),
                top_k_index.contiguous(),
                top_k_weights.contiguous(),
                cast(list[torch.Tensor], gate_up),
                gate_up_bias,
                cast(list[torch.Tensor], down),
                down_bias,
                self.intermediate,
                clamped=self._clamp,
                fp32_rows=self._fp32_rows,
            )
        return self.by_expert(hidden, top_k_index, top_k_weights)

    def by_expert(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """`forward` op by op: a gather, each chosen expert over its rows, an indexed add."""
        top_k = top_k_index.shape[1]
        flat = top_k_index.flatten()
        order = flat.argsort(stable=True)
        rows = order // top_k
        taken = hidden[rows]
        outputs, start = [], 0
        for expert, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
            if count:
                outputs.append(self._expert(expert, taken[start : start + count]))
                start += count
        weighted = torch.cat(outputs) * top_k_weights.flatten()[order].unsqueeze(1)
        summed = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        return summed.index_add_(0, rows, weighted.float()).to(hidden.dtype)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        layer, down = self.gate_up[expert], self.down[expert]
        if isinstance(layer, GatedPanelLinear):
            return down(layer(x, bf16_out=takes_bf16_rows(down)))
        gate_up = layer(x)
        if not self.gated:
            activated = self.act_fn(gate_up)
        elif self.clamped is not None:
            activated = self.clamped(gate_up)
        else:
            activated = gated_activation(gate_up, self.act_fn, self.intermediate, self.silu)
        return down(activated)


class SparseMoE(nn.Module):
    """Conveyor's mixture-of-experts block over a Hugging Face one (`Qwen2MoeSparseMoeBlock`,
    `Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`, `GptOssMLP`, `Glm4MoeMoE` and its kind):
    the same routing, experts and shared expert over the same weights."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        router = router_of(block)
        # DeepSeek V3's kind (chosen by the scores plus a bias, weighed by the scores alone), or
        # DeepSeek V2's (the best groups' softmax scores, scaled): routers of their own.
        self.own_router: BiasedRouter | GroupLimitedRouter | None = BiasedRouter.of(
            block
        ) or GroupLimitedRouter.of(block)
        # Hunyuan's router holds a linear layer (`wg`), the others its weight.
        self.router_linear = getattr(router, "wg", None)
        self.router_weight = router.weight if self.router_linear is None else None
        self.router_bias = getattr(router, "bias", None)
        self.top_k = int(router.top_k)
        # gpt-oss: a softmax over the top-k logits alone.
        self.top_logits = type(router).__name__ in TOP_LOGIT_ROUTERS
        # Mixtral always renormalizes the top-k weights and keeps them in fp32; Qwen's MoE
        # models renormalize where the config says so (Qwen3-VL's always) and cast them to the
        # logits' dtype.
        self.renormalize = bool(getattr(router, "norm_topk_prob", True)) and (
            type(router).__name__ not in UNNORMALIZED_ROUTERS
        )
        self.cast_weights = (
            hasattr(router, "norm_topk_prob") or type(router).__name__ in CASTING_ROUTERS
        )
        self.experts = ExpertLinears.of(block.experts)
        # Where their panels allow, a step's experts in one op.
        self.experts.group()
        self.shared_expert = next(
            (
                found
                for name in SHARED_EXPERT_NAMES
                if (found := getattr(block, name, None)) is not None
            ),
            None,
        )
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)
        # Nemotron 3's projections of the rows into the experts' narrower width and back (None
        # where the experts take the rows as they are).
        self.into_latent = _latent(block, "fc1_latent_proj")
        self.from_latent = _latent(block, "fc2_latent_proj")

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts `[rows, k]` and their weights."""
        if self.own_router is not None:
            return self.own_router.route(x)
        logits = self._logits(x)
        if self.top_logits:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            if self.cast_weights:
                return torch.softmax(top.float(), dim=-1).to(x.dtype), experts
            return torch.softmax(top, dim=-1, dtype=top.dtype), experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.cast_weights:
            weights = weights.to(logits.dtype)
        return weights, experts

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_linear is None:
            return F.linear(x, cast(torch.Tensor, self.router_weight), self.router_bias)
        weight = getattr(self.router_linear, "weight", None)
        if weight is not None and weight.dtype == torch.float32:  # Hunyuan's: rows in fp32
            x = x.float()
        return cast(torch.Tensor, self.router_linear(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output for the normalized rows `x` `[rows, hidden]`."""
        weights, experts = self.route(x)
        if self.into_latent is None or self.from_latent is None:
            out = self.experts(x, experts, weights)
        else:
            out = self.from_latent(self.experts(self.into_latent(x), experts, weights))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def extra_repr(self) -> str:
        shared = ", shared expert" if self.shared_expert is not None else ""
        return f"experts={self.num_experts}, top_k={self.top_k}{shared}"
