"""Pure-torch paged attention: runs on CPU and CUDA and is the oracle for faster backends.

Rows with a single query token (decodes) are batched into one call over their gathered block
tables. Rows with several query tokens (prefill chunks) run one by one: a fresh prompt attends
causally over its own new K/V; a chunk after a cached prefix reads its whole sequence back from
the cache with an offset causal mask.

It alone computes a layer's `LayerAttention` (sliding windows, soft-capped scores, sinks): the
masks then also hide what lies before each token's window, and scores that are capped or meet
sinks are computed explicitly in fp32 (SDPA takes neither). It also attends the chunks whose
image tokens see their whole run both ways (`InputBatch.key_limits`), for every backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.backend import AttentionBackend, AttentionMetadata, LayerAttention
from engine.kv.kv_cache import KVCache
from engine.worker.input_batch import InputBatch

_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(slots=True)
class PrefillSpan:
    """One multi-token row. `block_row` (its block ids, on the host) is set only when a cached
    prefix exists; the ids on the device (`block_ids`) and `mask`, its offset causal mask, are
    made when the torch path first attends over that prefix (a backend whose kernel reads the
    blocks itself never needs them)."""

    start: int
    end: int
    seq_len: int
    # Where its image tokens see past themselves: the last key position each query token
    # sees (`InputBatch.key_limits`).
    limits: np.ndarray | None = None
    block_row: np.ndarray | None = None
    device_blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def context(self) -> int:
        """Tokens cached before the chunk."""
        return self.seq_len - (self.end - self.start)

    def block_ids(self, device: torch.device) -> torch.Tensor:
        """The cached prefix's block ids on `device`, copied there once."""
        if self.device_blocks is None:
            assert self.block_row is not None  # set for every span with a cached prefix
            self.device_blocks = _to(self.block_row, device)
        return self.device_blocks

    def offset_mask(self, device: torch.device) -> torch.Tensor:
        """`[1, 1, tokens, seq_len]`: query token i (at position context + i) sees keys up to
        its own position."""
        if self.mask is None:
            query_pos = np.arange(self.context, self.seq_len)
            seen = np.arange(self.seq_len)[None, :] <= query_pos[:, None]
            self.mask = _to(seen, device)[None, None]
        return self.mask

    def visible(self, device: torch.device, window: int | None) -> torch.Tensor:
        """`[tokens, seq_len]`: the keys each query token sees, within its `window` (None:
        all before it) and up to its limit (its own position but where `limits` say more)."""
        positions = torch.arange(self.context, self.seq_len, device=device)[:, None]
        limits = positions if self.limits is None else _to(self.limits, device)[:, None]
        return _visible(positions, self.seq_len, window, limits)


@dataclass(slots=True, eq=False)
class TorchPagedMetadata(AttentionMetadata):
    backend: AttentionBackend
    kv_cache: KVCache
    slot_mapping: torch.Tensor
    num_tokens: int
    decode_tokens: torch.Tensor | None = None
    decode_block_table: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    all_decode: bool = False
    prefills: list[PrefillSpan] = field(default_factory=list)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    @classmethod
    def takes(cls, features: LayerAttention) -> bool:
        return True

    @staticmethod
    def metadata_type() -> type[TorchPagedMetadata]:
        return TorchPagedMetadata

    def build_metadata(self, batch: InputBatch, kv_cache: KVCache) -> TorchPagedMetadata:
        device = kv_cache.device
        meta = self.metadata_type()(
            backend=self,
            kv_cache=kv_cache,
            slot_mapping=_to(batch.slot_mapping, device),
            num_tokens=batch.num_tokens,
        )
        decode_rows = np.flatnonzero(batch.query_lens == 1)
        if decode_rows.size:
            self._decode_metadata(meta, batch, decode_rows, kv_cache.block_size, device)
        for row in np.flatnonzero(batch.query_lens > 1):
            meta.prefills.append(_prefill_span(batch, int(row), kv_cache.block_size))
        return meta

    def _decode_metadata(
        self,
        meta: TorchPagedMetadata,
        batch: InputBatch,
        rows: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> None:
        seq_lens = batch.seq_lens[rows]
        width = int(-(-seq_lens.max() // block_size))
        meta.decode_tokens = _to(batch.query_starts[rows], device)
        meta.decode_block_table = _to(batch.block_table[rows, :width], device)
        meta.all_decode = rows.size == batch.num_tokens
        self._decode_lengths(meta, seq_lens, width * block_size, device)

    @staticmethod
    def _decode_lengths(
        meta: TorchPagedMetadata, seq_lens: np.ndarray, span: int, device: torch.device
    ) -> None:
        """The decode rows' lengths as a mask over the `span` keys their blocks gather."""
        keys = np.arange(span)
        meta.decode_mask = _to(keys[None, :] < seq_lens[:, None], device)[:, None, None, :]

    def forward(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        metadata: AttentionMetadata,
        features: LayerAttention | None = None,
    ) -> torch.Tensor:
        assert isinstance(metadata, TorchPagedMetadata)
        if features is not None and not self.takes(features):
            raise ValueError(
                f"the {self.name} attention backend computes plain causal attention, not a "
                "sliding window, soft-capped scores or sinks"
            )
        metadata.kv_cache.calibrate(layer, key, value)
        self._store(metadata.kv_cache, layer, metadata.slot_mapping, key, value)
        if metadata.all_decode:
            return self._decode(layer, query, scale, metadata, features)
        out = query.new_empty(query.shape)
        if metadata.decode_tokens is not None:
            out[metadata.decode_tokens] = self._decode(layer, query, scale, metadata, features)
        self._prefill_rows(layer, query, key, value, scale, metadata, out, features)
        return out

    def _prefill_rows(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        metadata: TorchPagedMetadata,
        out: torch.Tensor,
        features: LayerAttention | None = None,
    ) -> None:
        """Write the multi-token rows' attention into their tokens of `out`: one SDPA call
        per row here."""
        self._prefill_spans(layer, query, key, value, scale, metadata, out, features)

    def _prefill_spans(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        metadata: TorchPagedMetadata,
        out: torch.Tensor,
        features: LayerAttention | None = None,
        limited_only: bool = False,
    ) -> None:
        """Write the multi-token rows' attention into `out`, one SDPA call a row: every row, or
        (`limited_only`) those whose image tokens see past themselves, which a faster backend's
        kernel leaves to this path."""
        for span in metadata.prefills:
            if limited_only and span.limits is None:
                continue
            out[span.start : span.end] = self._prefill(
                layer, query, key, value, scale, span, metadata.kv_cache, features
            )

    def _store(
        self,
        cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        cache.write(layer, slot_mapping, key, value)

    def _decode(
        self,
        layer: int,
        query: torch.Tensor,
        scale: float,
        meta: TorchPagedMetadata,
        features: LayerAttention | None = None,
    ) -> torch.Tensor:
        cache = meta.kv_cache
        q = (query if meta.all_decode else query[meta.decode_tokens]).unsqueeze(2)
        assert meta.decode_block_table is not None  # set for every step with decode rows
        assert meta.decode_mask is not None
        k, v = _read(cache, layer, meta.decode_block_table, q.dtype)
        if features is None:
            return _sdpa(q, k, v, attn_mask=meta.decode_mask, scale=scale).squeeze(2)
        lengths = meta.decode_mask.sum(-1, keepdim=True)
        seen = _visible(lengths - 1, k.shape[2], features.window)
        return _attend(q, k, v, seen, scale, features).squeeze(2)

    @staticmethod
    def _prefill(
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        span: PrefillSpan,
        cache: KVCache,
        features: LayerAttention | None = None,
    ) -> torch.Tensor:
        q = query[span.start : span.end].transpose(0, 1).unsqueeze(0)
        if span.context:
            table = span.block_ids(q.device).unsqueeze(0)
            k, v = _read(cache, layer, table, q.dtype, span.seq_len)
        else:
            # As the cache holds them, so that a prompt attends alike whether its K/V come
            # fresh or, after a prefix hit or preemption, from the cache.
            k = cache.round_trip(layer, 0, key[span.start : span.end])
            v = cache.round_trip(layer, 1, value[span.start : span.end])
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if features is not None or span.limits is not None:
            seen = span.visible(q.device, features.window if features is not None else None)
            out = _attend(q, k, v, seen[None, None], scale, features)
        elif span.context:
            out = _sdpa(q, k, v, attn_mask=span.offset_mask(q.device), scale=scale)
        else:
            out = _sdpa(q, k, v, is_causal=True, scale=scale)
        return out[0].transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    """SDPA with grouped-query heads. On CUDA cuDNN's kernel is left out: it builds a plan for
    every new shape it meets, hundreds of milliseconds for some, and prompt lengths vary from
    request to request. Flash attention takes grouped heads but no mask, so masked calls get
    K/V repeated per query head for the memory-efficient kernel instead of falling to the
    unfused math path."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)
    if options.get("attn_mask") is not None and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(_CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)


def _visible(
    positions: torch.Tensor, keys: int, window: int | None, limits: torch.Tensor | None = None
) -> torch.Tensor:
    """Which of `keys` key positions a query at each of `positions` (a column) sees: those up
    to its own (or to its `limits`, a column), and within its window (the last `window`
    positions, its own included)."""
    key = torch.arange(keys, device=positions.device)
    seen = key <= (positions if limits is None else limits)
    if window is not None:
        seen &= key > positions - window
    return seen


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    features: LayerAttention | None,
) -> torch.Tensor:
    """Attention of `q` `[rows, heads, tokens, dim]` over grouped `k`/`v` where `seen`: SDPA
    for a mask alone, else the scores in fp32, capped, and joined by the sinks in the
    softmax, as Hugging Face's eager attention computes them."""
    if features is None or (features.softcap is None and features.sinks is None):
        return _sdpa(q, k, v, attn_mask=seen, scale=scale)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if features.softcap is not None:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    scores = scores.masked_fill(~seen, float("-inf"))
    if features.sinks is not None:
        sinks = features.sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if features.sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def _read(
    cache: KVCache,
    layer: int,
    block_table: torch.Tensor,
    dtype: torch.dtype,
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer`'s K and V through a block table (`_gather`), their first `length` tokens, as
    the K/V they stand for in `dtype`."""
    k = _gather(cache.key(layer), block_table)[:, :, :length]
    v = _gather(cache.value(layer), block_table)[:, :, :length]
    return cache.widened(layer, 0, k, dtype), cache.widened(layer, 1, v, dtype)


def _gather(layer_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """`[blocks, block_size, heads, dim]` read through a `[rows, width]` block table gives
    `[rows, heads, width * block_size, dim]`."""
    rows, width = block_table.shape
    blocks = layer_cache.shape[0]
    # index_select copies whole block rows; advanced indexing is several times slower here.
    gathered = layer_cache.view(blocks, -1).index_select(0, block_table.flatten())
    return gathered.view(rows, width * layer_cache.shape[1], *layer_cache.shape[2:]).transpose(1, 2)


def _prefill_span(batch: InputBatch, row: int, block_size: int) -> PrefillSpan:
    start = int(batch.query_starts[row])
    num = int(batch.query_lens[row])
    context = int(batch.context_lens[row])
    span = PrefillSpan(
        start=start, end=start + num, seq_len=context + num, limits=batch.key_limits.get(row)
    )
    if context:
        num_blocks = -(-span.seq_len // block_size)
        span.block_row = batch.block_table[row, :num_blocks]
    return span


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
