"""The adapters the model can run, and the `max_loras` slots one step runs them in.

Each layer holds the slots' weights stacked per group of projections that share an input
(`GROUPS`): `A` `[targets * slots * rank, in]` and a block-diagonal `B` `[sum of outs,
targets * slots * rank]`, each adapter zero-padded to `--max-lora-rank`. A step sets a mask
that keeps, for each token, the columns of its request's slot (none for a base-model
request), so a group's delta for a whole mixed batch is two products and a multiply,
`((x A^T) * mask) B^T`, whatever adapters its rows use. An adapter enters a slot
when a step first needs it, taking the least recently used slot the step does not need (the
scheduler never runs more adapters in a step than there are slots)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from engine.lora.adapter import LoRAAdapter, Shapes
from engine.lora.registry import LoRARequest

# The projections that share an input, in the order the model's fused outputs hold them: a
# group's delta is one product pair over its targets' slots side by side. A layer holds a group
# where it has every target of it and no larger group holds them all (a gateless MLP's up is a
# group of its own; a gated MLP's is part of gate and up).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "up": ("up_proj",),
    "down": ("down_proj",),
}
# How many targets the groups have: a step's mask is built once for each.
_GROUP_SIZES = frozenset(len(targets) for targets in GROUPS.values())


class LoRASlots:
    def __init__(
        self,
        layer_shapes: list[Shapes],
        max_loras: int,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """`dtype`: what the adapters compute in (fp32 on a CPU: the products are small)."""
        self.layer_shapes = layer_shapes
        self.num_slots, self.rank = max_loras, max_rank
        self.device, self.dtype = device, dtype
        # Per layer and group: A `[targets * slots * rank, in]`, and B `[sum of outs, targets *
        # slots * rank]`, block-diagonal (each target's rows read its own columns only).
        self.a = [self._stacks(shapes, "a") for shapes in layer_shapes]
        self.b = [self._stacks(shapes, "b") for shapes in layer_shapes]
        # The slot each column of a one-target group's products belongs to.
        self._columns = torch.arange(max_loras, device=device).repeat_interleave(max_rank)
        self.adapters: dict[int, LoRAAdapter] = {}
        self._held: list[int | None] = [None] * max_loras
        self._used: list[int] = [0] * max_loras
        self._clock = 0
        # The running step's token-by-column mask per group size (None while the step runs
        # the base model alone), and the groups its adapters target.
        self._masks: dict[int, torch.Tensor] | None = None
        self.groups: frozenset[str] = frozenset()

    @property
    def active(self) -> bool:
        return self._masks is not None

    def add(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.adapters[lora_id] = adapter

    def remove(self, lora_id: int) -> None:
        """Forget the adapter's weights, and the slot it held."""
        self.adapters.pop(lora_id, None)
        for slot, held in enumerate(self._held):
            if held == lora_id:
                self._held[slot] = None

    def begin(self, loras: list[LoRARequest | None], query_lens: np.ndarray) -> bool:
        """Set the step up for rows of `query_lens` tokens run under `loras` (None: the base
        model); False, with no mask, when no row takes an adapter."""
        ids = {lora.lora_id for lora in loras if lora is not None}
        if not ids:
            self._masks, self.groups = None, frozenset()
            return False
        if len(ids) > self.num_slots:
            raise RuntimeError(f"a step runs {len(ids)} adapters; there are {self.num_slots} slots")
        slot_of = {lora_id: self._slot_for(lora_id, ids) for lora_id in sorted(ids)}
        row_slots = np.fromiter(
            (-1 if lora is None else slot_of[lora.lora_id] for lora in loras), np.int64, len(loras)
        )
        token_slots = torch.from_numpy(np.repeat(row_slots, query_lens)).to(self.device)
        mask = (token_slots[:, None] == self._columns[None, :]).to(self.dtype)
        self._masks = {size: mask.repeat(1, size) for size in _GROUP_SIZES}
        targets = {t for i in ids for t in self.adapters[i].targets}
        self.groups = frozenset(g for g, members in GROUPS.items() if targets & set(members))
        return True

    def adapts(self, layer: int, group: str) -> bool:
        """Whether the step's adapters add to `group` of the layer (one that holds the group: a
        recurrent mixer holds no o, a mixture of experts no gate/up)."""
        return group in self.groups and group in self.a[layer]

    def delta(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        """What the step's adapters add to `group`'s outputs (side by side) over rows `x`."""
        assert self._masks is not None
        a, b = self.a[layer][group], self.b[layer][group]
        mask = self._masks[len(GROUPS[group])]
        return ((x.to(self.dtype) @ a.T) * mask) @ b.T

    def _stacks(self, shapes: Shapes, side: str) -> dict[str, torch.Tensor]:
        width = self.num_slots * self.rank
        stacks = {}
        for group in _held_groups(shapes):
            targets = GROUPS[group]
            columns = len(targets) * width
            if side == "a":
                shape = (columns, shapes[targets[0]][0])
            else:
                shape = (sum(shapes[t][1] for t in targets), columns)
            stacks[group] = torch.zeros(shape, device=self.device, dtype=self.dtype)
        return stacks

    def _slot_for(self, lora_id: int, needed: Iterable[int]) -> int:
        """The slot holding the adapter, loading it into a free or the least recently used
        slot no adapter of the step holds."""
        self._clock += 1
        if lora_id in self._held:
            slot = self._held.index(lora_id)
        else:
            keep = set(needed)
            free = [s for s, held in enumerate(self._held) if held is None or held not in keep]
            slot = min(free, key=lambda s: (self._held[s] is not None, self._used[s]))
            self._load(slot, self.adapters[lora_id])
            self._held[slot] = lora_id
        self._used[slot] = self._clock
        return slot

    @torch.inference_mode()
    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy the adapter into the slot's columns, zeros where it targets nothing."""
        width = self.num_slots * self.rank
        for layer, shapes in enumerate(self.layer_shapes):
            for group, targets in GROUPS.items():
                if group not in self.a[layer]:
                    continue
                row = 0
                for index, target in enumerate(targets):
                    start = index * width + slot * self.rank
                    cols = slice(start, start + self.rank)
                    rows = slice(row, row + shapes[target][1])
                    a, b = self.a[layer][group][cols], self.b[layer][group][rows, cols]
                    a.zero_()
                    b.zero_()
                    weights = adapter.weights.get((layer, target))
                    if weights is not None:
                        a[: weights.rank].copy_(weights.a)
                        b[:, : weights.rank].copy_(weights.b)
                    row = rows.stop


def _held_groups(shapes: Shapes) -> list[str]:
    """The groups a layer with projections `shapes` holds (a mixture of experts holds no MLP's):
    those whose targets it has, less any whose targets a larger one it holds covers."""
    whole = [g for g, targets in GROUPS.items() if all(t in shapes for t in targets)]
    return [
        g
        for g in whole
        if not any(set(GROUPS[g]) < set(GROUPS[other]) for other in whole if other != g)
    ]
