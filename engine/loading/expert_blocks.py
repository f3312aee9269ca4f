"""A mixture's experts kept as blocks: one block layer per expert, under the names of the
layers `ExpertLinears` makes of a layer's experts (`...experts.gate_up.3`, gate rows above up
rows, and `...experts.down.3`), so that the loader puts each in place of its expert's layer.

A GGUF file stores a layer's experts as three 3-d tensors (`gguf_tensors.ExpertBlocks`); a
quantized checkpoint stores each expert's projections as layers of their own
(`experts.3.gate_proj`, or Mixtral's `block_sparse_moe.experts.3.w1`), joined here.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from engine.loading.gguf_blocks import Blocks

# The layers `ExpertLinears` makes of a layer's experts.
EXPERT_LAYER = re.compile(r"\.experts\.(gate_up|down)\.\d+$")
# An expert's own projection in a checkpoint: Qwen's names, or Mixtral's (w1 gate, w3 up).
CHECKPOINT_EXPERT = re.compile(
    r"^(?P<owner>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)$"
)
PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down"}
PARTS["w2"] = "down"


def expert_layer(owner: str, part: str, expert: int) -> str:
    """The name of expert `expert`'s `gate_up` or `down` layer of the experts `owner`."""
    return f"{owner}.{part}.{expert}"


def join_checkpoint_experts(blocks: Blocks, owners: frozenset[str]) -> tuple[Blocks, list[str]]:
    """Each expert's gate and up blocks joined and its down blocks, by `ExpertLinears`' names,
    for the experts of `owners` (the model's experts modules) whose every expert's three
    projections are among `blocks` (a checkpoint's expert layers that hold blocks), gate and up
    in one format; and the layers of the other experts, which keep fp32 weights."""
    grouped: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for layer in blocks:
        match = CHECKPOINT_EXPERT.match(layer)
        assert match is not None  # the caller passes expert layers only
        owner = match["owner"].replace(".block_sparse_moe.", ".mlp.")
        grouped[owner][int(match["expert"])][PARTS[match["part"]]] = layer
    joined: Blocks = {}
    leftover = []
    for owner, experts in grouped.items():
        found = _joined(owner, experts, blocks) if owner in owners else None
        if found is None:
            leftover += [layer for parts in experts.values() for layer in parts.values()]
        else:
            joined |= found
    return joined, leftover


def _joined(owner: str, experts: dict[int, dict[str, str]], blocks: Blocks) -> Blocks | None:
    if sorted(experts) != list(range(len(experts))):
        return None
    found: Blocks = {}
    for expert, parts in experts.items():
        if set(parts) != {"gate", "up", "down"}:
            return None
        (gate_fmt, gate), (up_fmt, up) = blocks[parts["gate"]], blocks[parts["up"]]
        if gate_fmt is not up_fmt:
            return None
        found[expert_layer(owner, "gate_up", expert)] = (gate_fmt, torch.cat([gate, up]))
        found[expert_layer(owner, "down", expert)] = blocks[parts["down"]]
    return found
