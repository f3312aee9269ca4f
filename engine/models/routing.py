"""Routers that choose each token's experts by their scores plus a per-expert bias, but weigh
the chosen experts by the scores alone (DeepSeek V3's auxiliary-loss-free balancing, and the
families built after it: GLM-4.5, dots.llm1, EXAONE MoE, Solar Open, MiniMax M2 over a sigmoid;
ERNIE 4.5's MoE over a softmax). Some first keep only the best groups of experts (by the sum of
each group's two best biased scores) and choose within them.

`BiasedRouter.of` reads one from a Hugging Face MoE block, wherever its family keeps the bias;
`route` computes what that family's router computes, in the same dtypes and order. DeepSeek V2's
router, before the bias (`GroupLimitedRouter`), limits the choice to the best groups by their
best softmax score and weighs by the scores, scaled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The sum DeepSeek V3's routers (and those written after it) add to the weights' sum before
# dividing by it.
DEEPSEEK_EPSILON = 1e-20


def within_best_groups(
    choice: torch.Tensor,
    groups: int,
    top_groups: int,
    rank: Callable[[torch.Tensor], torch.Tensor],
    fill: float,
) -> torch.Tensor:
    """`choice` `[rows, experts]` with every expert outside each row's best `top_groups` of its
    `groups` groups set to `fill`; `rank` gives each group's rank from its experts' scores
    (`[rows, groups, per group]` to `[rows, groups]`). As it is with one group."""
    if groups <= 1:
        return choice
    grouped = choice.view(choice.shape[0], groups, -1)
    group_scores = rank(grouped)
    best = torch.topk(group_scores, top_groups, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), fill).view_as(choice)


def _two_best_summed(grouped: torch.Tensor) -> torch.Tensor:
    """DeepSeek V3's rank of a group: the sum of its two best biased scores."""
    return grouped.topk(2, dim=-1)[0].sum(dim=-1)


def _best(grouped: torch.Tensor) -> torch.Tensor:
    """DeepSeek V2's rank of a group: its best score."""
    return grouped.max(dim=-1).values


def router_of(block: Any) -> Any:
    """A Hugging Face MoE block's router (gpt-oss names it `router`, the others `gate`)."""
    return block.router if hasattr(block, "router") else block.gate


def correction_bias(block: Any) -> torch.Tensor | None:
    """The per-expert bias a block's router adds to the scores it chooses by, wherever the
    family keeps it (the router, the block, ERNIE's router's statistics); None without one."""
    router = router_of(block)
    for owner in (router, block, getattr(router, "moe_statics", None)):
        bias = getattr(owner, "e_score_correction_bias", None)
        if bias is not None:
            return bias
    return None


class BiasedRouter(nn.Module):
    """Each row's top-k experts by `score + bias` (within the best `top_groups` of `groups`
    groups), weighted by their scores, renormalized and scaled as the family does."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor,
        top_k: int,
        *,
        sigmoid: bool,
        fp32_logits: bool,
        groups: int = 1,
        top_groups: int = 1,
        renormalize: bool = True,
        epsilon: float = 0.0,
        floor: float = 0.0,
        scale: float = 1.0,
        cast: bool = False,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias.reshape(-1)
        self.top_k = top_k
        self.sigmoid = sigmoid
        # DeepSeek's kind: logits of the rows and the weight both in fp32; MiniMax M2's: of the
        # rows in the weight's dtype, scored in fp32.
        self.fp32_logits = fp32_logits
        self.groups = groups
        self.top_groups = top_groups
        self.renormalize = renormalize
        # The weights' sum, plus `epsilon`, at least `floor`, divides them (DeepSeek's adds
        # 1e-20, ERNIE's clamps to its `moe_norm_min`).
        self.epsilon = epsilon
        self.floor = floor
        self.scale = scale
        # ERNIE casts the weights to the rows' dtype; the others keep them in fp32.
        self.cast = cast

    @classmethod
    def of(cls, block: Any) -> BiasedRouter | None:
        """The router of a Hugging Face MoE block that chooses by a correction bias; None where
        the block's router has none."""
        bias = correction_bias(block)
        if bias is None:
            return None
        router = router_of(block)
        name = type(router).__name__
        if name.startswith("Ernie4_5"):
            return cls(
                router.weight,
                bias,
                int(router.top_k),
                sigmoid=False,
                fp32_logits=True,
                floor=float(router.norm_min),
                cast=True,
            )
        if name == "MiniMaxM2TopKRouter":
            return cls(router.weight, bias, int(router.top_k), sigmoid=True, fp32_logits=False)
        return cls(
            router.weight,
            bias,
            int(router.top_k),
            sigmoid=True,
            fp32_logits=True,
            groups=int(router.num_group),
            top_groups=int(router.topk_group),
            renormalize=bool(router.norm_topk_prob),
            epsilon=DEEPSEEK_EPSILON,
            scale=float(router.routed_scaling_factor),
        )

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's score of each expert `[rows, experts]`, in fp32."""
        if self.fp32_logits:
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x.to(self.weight.dtype), self.weight).float()
        if self.sigmoid:
            return logits.sigmoid()
        return torch.softmax(logits, dim=-1, dtype=torch.float32)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts `[rows, k]` and their weights."""
        scores = self.scores(x)
        choice = within_best_groups(
            scores + self.bias, self.groups, self.top_groups, _two_best_summed, float("-inf")
        )
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.epsilon).clamp(
                min=self.floor
            )
        weights = weights * self.scale
        return (weights.to(x.dtype) if self.cast else weights), experts

    def extra_repr(self) -> str:
        scoring = "sigmoid" if self.sigmoid else "softmax"
        groups = f", best {self.top_groups} of {self.groups} groups" if self.groups > 1 else ""
        return f"top_k={self.top_k}, {scoring} plus a bias{groups}, scale={self.scale}"


class GroupLimitedRouter(nn.Module):
    """DeepSeek V2's router: a softmax over the experts' logits (in fp32); where its method is
    `group_limited_greedy`, only the experts of each row's best `top_groups` groups (ranked by
    their best score) stay candidates; the top-k scores, scaled, are the weights (not
    renormalized)."""

    def __init__(
        self, weight: torch.Tensor, top_k: int, groups: int, top_groups: int, scale: float
    ) -> None:
        super().__init__()
        self.weight = weight
        self.top_k = top_k
        self.groups = groups
        self.top_groups = top_groups
        self.scale = scale

    @classmethod
    def of(cls, block: Any) -> GroupLimitedRouter | None:
        """The router of a DeepSeek V2 block; None for any other."""
        router = router_of(block)
        if type(router).__name__ != "DeepseekV2TopkRouter":
            return None
        limited = router.topk_method == "group_limited_greedy"
        return cls(
            router.weight,
            int(router.top_k),
            groups=int(router.num_group) if limited else 1,
            top_groups=int(router.topk_group) if limited else 1,
            scale=float(router.routed_scaling_factor),
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts `[rows, k]` and their weights."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        scores = within_best_groups(scores, self.groups, self.top_groups, _best, 0.0)
        weights, experts = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.scale, experts

    def extra_repr(self) -> str:
        groups = f", best {self.top_groups} of {self.groups} groups" if self.groups > 1 else ""
        return f"top_k={self.top_k}, softmax{groups}, scale={self.scale}"
