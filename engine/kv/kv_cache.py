"""The paged KV cache: real K/V tensors allocated once, addressed by block and slot."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.kernels.cpu import huge_pages
from engine.kv.kv_scales import calibrated_scales
from engine.worker.transfer import to_device

if TYPE_CHECKING:
    from engine.kv.state_cache import StateCache
    from engine.parallel.group import ParallelGroup

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of one token's K/V across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    # Whether a layer's values are its keys (latent attention's one row a token): the cache
    # then holds one plane a layer, read as both.
    values_are_keys: bool = False

    @property
    def planes(self) -> int:
        """Planes a layer holds: K and V, or the one both read."""
        return 1 if self.values_are_keys else 2

    @property
    def bytes_per_token(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.planes * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block)

    @classmethod
    def from_hf_config(cls, config: Any, dtype: torch.dtype, block_size: int) -> KVCacheSpec:
        from engine.models.layer_kinds import attending_layers  # the models build on this

        if getattr(config, "kv_lora_rank", None):  # multi-head latent attention (DeepSeek)
            return cls(
                num_layers=config.num_hidden_layers,
                num_kv_heads=1,  # one latent row a token: the latent and the rotated key part
                head_dim=int(config.kv_lora_rank) + int(config.qk_rope_head_dim),
                dtype=dtype,
                block_size=block_size,
                values_are_keys=True,
            )
        if not attending_layers(config):  # Mamba's own models: no layer keeps K/V
            return cls(num_layers=0, num_kv_heads=1, head_dim=1, dtype=dtype, block_size=block_size)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            # (the layers that attend: a recurrent layer keeps a state instead, LFM2's)
            num_layers=len(attending_layers(config)),
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            dtype=dtype,
            block_size=block_size,
        )


class KVCache:
    """One tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]` with per-layer views
    (`[layers, 1, ...]` where the values are the keys: each layer's one plane is read as both).

    Slot `s` of the flattened cache is token `s % block_size` of block `s // block_size`. The
    memory is zeroed once so slots never read as NaN before they are written; on the CPU it
    lies in huge pages where the kernel allows (`huge_pages`).

    An fp8 cache holds each layer's K and V divided by that layer's scales (`scales`,
    `[layers, 2]` in fp32 on the device: 1.0 unless a checkpoint gives others or the first
    step calibrates them, `engine/kv/kv_scales.py`). The scales live on the device, so a graph
    captured before they change reads the new ones.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.spec = spec
        self.num_blocks = num_blocks
        self.device = device
        self.tensor: torch.Tensor
        self._keys: list[torch.Tensor]
        self._values: list[torch.Tensor]
        self.restore()
        self.scales = torch.ones(spec.num_layers, 2, dtype=torch.float32, device=device)
        self._layer_scales = [self.scales[layer] for layer in range(spec.num_layers)]
        # Set while the next step's K/V are to set every layer's scales (`calibrate`).
        self.calibrating = False
        # Under tensor parallelism, the ranks that share the layers: each calibrates over the
        # largest K/V of them all, so the scales are those of one rank holding every head.
        self.group: ParallelGroup | None = None
        # A recurrent model's per-request states beside the blocks (None in other models).
        self.states: StateCache | None = None

    def restore(self) -> None:
        """Allocate the cache, zeroed (at start-up, and after `release`)."""
        spec = self.spec
        shape = (
            spec.num_layers,
            spec.planes,
            self.num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
        )
        if self.device.type == "cpu":
            self.tensor = huge_pages.zeros(shape, spec.dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        # Per-layer views, made once: every layer asks for its own on every step.
        self._keys = [self.tensor[layer, 0] for layer in range(spec.num_layers)]
        self._values = [self.tensor[layer, spec.planes - 1] for layer in range(spec.num_layers)]
        self._released = False

    def release(self) -> None:
        """Give the cache's memory back (sleep mode); nothing may step until `restore`."""
        self.tensor = torch.empty(0, dtype=self.spec.dtype, device=self.device)
        self._keys, self._values = [], []
        self._released = True

    @property
    def released(self) -> bool:
        return self._released

    @property
    def scaled(self) -> bool:
        """Whether the cache holds K/V divided by the layers' scales (an fp8 cache does)."""
        return self.spec.dtype in FP8_DTYPES

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def key(self, layer: int) -> torch.Tensor:
        return self._keys[layer]

    def value(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    def layer_scales(self, layer: int) -> torch.Tensor:
        """`layer`'s key and value scales, `[2]` on the device."""
        return self._layer_scales[layer]

    def calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """While calibrating, set `layer`'s scales from these K/V (on the device, no wait)."""
        if self.calibrating and self.scaled:
            scales = calibrated_scales(key, value)
            if self.group is not None:
                self.group.all_reduce_max(scales)
            self._layer_scales[layer].copy_(scales)

    def end_calibration(self) -> None:
        """After the step that calibrated the scales: keep them, and log their range (the one
        wait for the device this takes)."""
        if not self.calibrating:
            return
        self.calibrating = False
        keys, values = self.scales.T.tolist()
        logger.info(
            "fp8 KV cache scales calibrated on the first step: key %.4g to %.4g, "
            "value %.4g to %.4g",
            min(keys),
            max(keys),
            min(values),
            max(values),
        )

    def write(
        self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store `[tokens, kv_heads, head_dim]` K/V of new tokens at their slots, rounded to
        the cache's dtype (an fp8 cache's divided by the layer's scales first)."""
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        stores = [(self.key(layer), self.stored(layer, 0, key))]
        if not self.spec.values_are_keys:  # else the key's plane is the value's
            stores.append((self.value(layer), self.stored(layer, 1, value)))
        for layer_cache, new in stores:
            _as_bits(layer_cache).view(-1, heads, dim).index_copy_(0, slot_mapping, _as_bits(new))

    def stored(self, layer: int, kind: int, x: torch.Tensor) -> torch.Tensor:
        """K (`kind` 0) or V (1) of `layer` as the cache stores them."""
        if self.scaled:
            x = x.float() / self._layer_scales[layer][kind]
        return narrowed(x, self.spec.dtype)

    def widened(self, layer: int, kind: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values `x` read from `layer`'s K (`kind` 0) or V (1) cache as the K/V they stand
        for, in `dtype`."""
        if self.scaled:
            return (x.float() * self._layer_scales[layer][kind]).to(dtype)
        return x.to(dtype)

    def round_trip(self, layer: int, kind: int, x: torch.Tensor) -> torch.Tensor:
        """New K or V as attention reads them back from the cache, where it holds fewer bits."""
        if x.dtype == self.spec.dtype:
            return x
        return self.widened(layer, kind, self.stored(layer, kind, x), x.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): `(source, destination)` pairs."""
        if not pairs:
            return
        source = to_device([s for s, _ in pairs], self.device)
        destination = to_device([d for _, d in pairs], self.device)
        bits = _as_bits(self.tensor)
        bits[:, :, destination] = bits[:, :, source]

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def narrowed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`; into fp8, saturated to its largest finite value first (e5m2 would round
    past it to infinity)."""
    if dtype in FP8_DTYPES and x.dtype != dtype:
        largest = torch.finfo(dtype).max
        return x.clamp(-largest, largest).to(dtype)
    return x.to(dtype)


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 values as their bytes, for the copies torch does not implement for fp8 on the CPU."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES else tensor
