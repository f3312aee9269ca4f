"""Steps with prompt chunks, replayed from CUDA graphs piece by piece around attention.

A step that carries a prefill chunk cannot be one graph: its attention depends on how its
tokens split into sequences. Every other op of the model works row by row, so its shapes depend
on the number of tokens only. The model is cut at each attention call (as vLLM's piecewise
graphs are): piece 0 embeds the tokens, turns their positions into rotary angles and projects
layer 0's query, key and value; piece i finishes layer i - 1 (output projection, MLP) and
projects layer i's; the last piece finishes the last layer. Each piece is captured once per
token bucket over static buffers shared by every bucket and layer. A step's tokens are copied
into the buffers padded to the next bucket and the pieces replayed; between them attention runs
eagerly on the real tokens only, so padded rows never touch the KV cache. The final norm and the
LM head run on the kept rows. Without capture (on a CPU) the same padded path runs eagerly,
which is how the tests check it.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, cast

import torch

from engine.attention import AttentionMetadata
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.worker.cuda_graphs import copy_padded
from engine.worker.input_batch import InputBatch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

# Token counts captured; a step of more tokens runs eagerly (vLLM captures up to 512 too).
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512)


def bucket_sizes(max_tokens: int) -> list[int]:
    """The buckets below `max_tokens`, then `max_tokens` itself (at most 512)."""
    largest = min(max_tokens, TOKEN_BUCKETS[-1])
    return sorted({*(b for b in TOKEN_BUCKETS if b < largest), largest})


class PiecewiseGraphs:
    """Static buffers for up to `max_tokens` tokens of `model`'s steps."""

    def __init__(self, model: PagedLlamaForCausalLM, max_tokens: int) -> None:
        self.model = model
        self.layers = [cast(PagedLlamaLayer, layer) for layer in model.layers]
        self.sizes = bucket_sizes(max_tokens)
        layer = self.layers[0]
        weight = cast(torch.Tensor, model.embed_tokens.weight)
        rows, device, dtype = self.sizes[-1], weight.device, weight.dtype
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(rows, weight.shape[1], dtype=dtype, device=device)
        heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.query = torch.zeros(rows, heads, head_dim, dtype=dtype, device=device)
        self.key = torch.zeros(rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.value = torch.zeros(rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.attended = torch.zeros(rows, heads, head_dim, dtype=dtype, device=device)
        self.cos = torch.zeros(rows, 1, head_dim, dtype=dtype, device=device)
        self.sin = torch.zeros(rows, 1, head_dim, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def supports(self, batch: InputBatch) -> bool:
        return 0 < batch.num_tokens <= self.sizes[-1]

    @torch.inference_mode()
    def capture(self, pool: _POOL_HANDLE | None = None) -> _POOL_HANDLE | None:
        """Every piece of every bucket, largest first, in one memory pool (`pool`, if given,
        is shared with other graphs that never run at the same time); returns the pool."""
        start = time.perf_counter()
        device = self.hidden.device
        for size in reversed(self.sizes):
            for index in range(self.num_pieces):
                self._piece(index, size)  # warm-up: compiles kernels and settles the allocator
            torch.cuda.synchronize(device)
            pieces = []
            for index in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(index, size)
                pool = graph.pool()
                pieces.append(graph)
            self.graphs[size] = pieces
        torch.cuda.synchronize(device)
        logger.info(
            "captured piecewise CUDA graphs (%d pieces) for %d token counts up to %d in %.1f s",
            self.num_pieces,
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
        )
        return pool

    def run(
        self,
        batch: InputBatch,
        input_ids: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits `[len(logits_indices), vocab]` of a step that `supports` accepts."""
        tokens = batch.num_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, tokens)]
        self._fill(batch, input_ids, tokens, size)
        pieces = self.graphs.get(size)
        for index in range(self.num_pieces):
            if pieces is None:
                self._piece(index, size)
            else:
                pieces[index].replay()
            if index < len(self.layers):
                self._attend(index, tokens, metadata)
        return self.model.logits(self.hidden[:tokens], logits_indices)

    def _fill(self, batch: InputBatch, input_ids: torch.Tensor, tokens: int, size: int) -> None:
        self.input_ids[:tokens].copy_(input_ids)
        self.input_ids[tokens:size].zero_()
        copy_padded(self.positions, batch.positions, size)

    def _attend(self, index: int, tokens: int, metadata: AttentionMetadata) -> None:
        """Layer `index`'s attention over the step's real tokens, eagerly, into the buffer the
        next piece reads (the padded rows keep what they held: no real row reads them)."""
        layer = self.layers[index]
        out = metadata.backend.forward(
            index,
            self.query[:tokens],
            self.key[:tokens],
            self.value[:tokens],
            layer.scaling,
            metadata,
            layer.attention,
        )
        self.attended[:tokens].copy_(out.reshape(tokens, layer.num_heads, layer.head_dim))

    def _piece(self, index: int, size: int) -> None:
        """Piece `index` over the first `size` rows of the buffers."""
        layers = self.layers
        if index == 0:
            hidden = self.model.embed_tokens(self.input_ids[:size])
            cos, sin = self.model.rotary(hidden, self.positions[:size])
            self.cos[:size].copy_(cos)
            self.sin[:size].copy_(sin)
        else:
            hidden = layers[index - 1].after_attention(self.attended[:size], self.hidden[:size])
        self.hidden[:size].copy_(hidden)
        if index < len(layers):
            query, key, value = layers[index].project_qkv(
                self.hidden[:size], self.cos[:size], self.sin[:size]
            )
            self.query[:size].copy_(query)
            self.key[:size].copy_(key)
            self.value[:size].copy_(value)
