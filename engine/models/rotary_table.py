"""A model's rotary cos/sin looked up by position instead of computed every step.

A Hugging Face rotary embedding with fixed frequencies gives each position's cos and sin from that
position alone (`pos * inv_freq`, then cos and sin, elementwise), so a table the module filled once
for positions 0..n holds, row for row, what it gives any batch of positions. The table grows in
powers of two as longer sequences come. On the CPU only: a GPU step would wait on the host to
learn how long the table must be, and a captured graph cannot. Rope types that change their
frequencies with the sequence length (dynamic NTK, LongRoPE) keep calling the module, as do head
dims that are not whole vector registers, and any module whose table rows turn out to differ from
its own answer the first time they are compared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Rope types whose frequencies are fixed when the module is built (Hunyuan's `ntk_alpha`: NTK
# scaling by a fixed alpha).
FIXED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "ntk_alpha"})
_FIRST_ROWS = 1024
# Floats a vector register holds at the widest: a row of whole vectors takes no scalar tail.
_VECTOR_FLOATS = 16


class RotaryTable:
    """cos, sin `[tokens, 1, head_dim]` for `positions` `[tokens]`, as `rotary(x, positions[None])`
    gives them."""

    def __init__(self, rotary: Any, max_positions: int) -> None:
        self.rotary = rotary
        self.max_positions = max_positions
        # Per layer type (Gemma 3), a rope type is a mapping: such modules are looked up per type.
        rope_type = getattr(rotary, "rope_type", None)
        self.enabled = (
            isinstance(rope_type, str) and rope_type in FIXED_ROPE_TYPES and _whole_vectors(rotary)
        )
        # One table per dtype asked for; all on the CPU, the only device that looks rows up.
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.enabled and x.is_cpu and positions.numel() > 0:
            needed = int(positions.max()) + 1
            if needed <= self.max_positions:
                looked_up = self._look_up(x, positions, needed)
                if looked_up is not None:
                    return looked_up
        cos, sin = self.rotary(x, positions[None])
        return cos[0, :, None, :], sin[0, :, None, :]

    def _look_up(
        self, x: torch.Tensor, positions: torch.Tensor, needed: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        tables = self._tables.get(x.dtype)
        if tables is None or tables[0].shape[0] < needed:
            tables = self._fill(x, needed)
            if tables is None:
                return None
            self._tables[x.dtype] = tables
        cos, sin = tables
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _fill(self, x: torch.Tensor, needed: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The module's cos and sin `[size, 1, head_dim]` for positions 0..size; the first time,
        checked against its answer for a few positions asked for on their own."""
        size = min(self.max_positions, max(_FIRST_ROWS, 1 << (needed - 1).bit_length()))
        cos, sin = self._module_rows(x, torch.arange(size, device=x.device))
        if x.dtype not in self._tables and not self._agrees(x, cos, sin, needed):
            self.enabled = False
            return None
        return cos[:, None, :], sin[:, None, :]

    def _module_rows(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(x, positions[None])
        return cos[0].contiguous(), sin[0].contiguous()

    def _agrees(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, needed: int) -> bool:
        probe = torch.arange(needed - 1, -1, -max(1, needed // 7), device=x.device)
        want_cos, want_sin = self._module_rows(x, probe)
        return torch.equal(cos[probe], want_cos) and torch.equal(sin[probe], want_sin)


def _whole_vectors(rotary: Any) -> bool:
    """Rows of whole vector registers: torch computes every element of every batch the same
    way, none in a scalar tail that may round a cosine differently."""
    inv_freq = getattr(rotary, "inv_freq", None)
    return inv_freq is not None and (2 * inv_freq.numel()) % _VECTOR_FLOATS == 0


class NoRotary:
    """The rotary of a model that has none (its layers NoPE, as Granite 4's hybrids): cos and sin
    of no dims for each position, which no layer reads."""

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, 0)
        return x.new_ones(shape), x.new_zeros(shape)


class AdaptedRotary:
    """A model's rotary whose cos and sin are rewritten before the layers take them (gpt-oss's
    half-head ones widened, nanochat's turned backward), with what `RotaryTable` reads of it."""

    def __init__(
        self,
        rotary: Any,
        adapt: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.rotary = rotary
        self.adapt = adapt
        self.rope_type = getattr(rotary, "rope_type", None)
        self.inv_freq = getattr(rotary, "inv_freq", None)

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.adapt(*self.rotary(x, position_ids))


class LayerTypeRotary:
    """A rotary embedding with frequencies per layer type (Gemma 3's, OLMo 3's: local and
    global layers), for one layer type, called as any model's rotary is."""

    def __init__(self, rotary: Any, layer_type: str) -> None:
        self.rotary = rotary
        self.layer_type = layer_type
        self.rope_type = rotary.rope_type[layer_type]
        self.inv_freq = getattr(rotary, f"{layer_type}_inv_freq")

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(x, position_ids, self.layer_type)


def typed_rotary_tables(rotary: Any, max_positions: int) -> dict[str, RotaryTable]:
    """The model's rotary looked up by position, one table per layer type, where its
    frequencies differ by layer type (its rope type is a mapping); else empty."""
    kinds = getattr(rotary, "rope_type", None)
    if not isinstance(kinds, dict):
        return {}
    return {kind: RotaryTable(LayerTypeRotary(rotary, kind), max_positions) for kind in kinds}


class AxisRotary:
    """cos, sin for positions on three axes (`[3, tokens]`, `engine/core/mrope.py`) as Qwen2-VL's
    and Qwen3-VL's rotaries compose them: each of the head's frequencies takes its cos and sin
    from the axis `axes` names for it (`rotary_axes`); `[tokens]` positions are the same on
    every axis."""

    def __init__(self, table: RotaryTable, axes: torch.Tensor) -> None:
        self.table = table
        self.axis = torch.cat([axes, axes])  # one axis per column of the head
        # The axes where the steps run, copied there once (a copy per step would wait on it).
        self._axis_on: dict[torch.device, torch.Tensor] = {}

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return self.table(x, positions)
        per_axis = [self.table(x, positions[axis]) for axis in range(3)]
        cos = torch.stack([c for c, _ in per_axis])  # [3, tokens, 1, head_dim]
        sin = torch.stack([s for _, s in per_axis])
        axis = self._axis_on.get(cos.device)
        if axis is None:
            axis = self._axis_on.setdefault(cos.device, self.axis.to(cos.device))
        index = axis.view(1, 1, 1, -1).expand(1, *cos.shape[1:])
        return cos.gather(0, index)[0], sin.gather(0, index)[0]


# Text models whose three axes take interleaved frequencies (time, height, width, time, ...)
# rather than a section each.
INTERLEAVED_AXES = ("qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_5_text", "qwen3_5_moe_text")


def rotary_axes(config: Any) -> torch.Tensor | None:
    """The axis (0 time, 1 height, 2 width) of each frequency of a text config whose positions
    lie on three axes, by its `mrope_section`: a run of frequencies per axis (Qwen2-VL), or
    interleaved, height and width each on every third frequency up to three times its section
    (Qwen3-VL); None where positions lie on one axis."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    if not sections:
        return None
    if getattr(config, "model_type", None) not in INTERLEAVED_AXES:
        return torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
    axes = torch.zeros(sum(sections), dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * sections[axis] : 3] = axis
    return axes
