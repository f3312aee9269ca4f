"""EXAONE 4.0 on Conveyor's decoder: the layer OLMo 2's is too (no norm before the attention or
the MLP; each one's output normed before it joins the residual) with Qwen3's norm of each q and
k head before the rotary. Its hybrid models (a sliding window on three layers of four) window only
their sliding layers, and their global layers rotate nothing (NoPE). Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any

from engine.attention.backend import LayerAttention
from engine.models.llama import PagedLlamaForCausalLM
from engine.models.olmo2 import PostNormedLayer
from engine.parallel.sharding import Shard

EXAONE4_ARCHITECTURES = frozenset({"Exaone4ForCausalLM"})


class PagedExaone4Layer(PostNormedLayer):
    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        attn = hf_layer.self_attn
        # Every layer holds the config's window; only the sliding ones attend within it.
        self.attention = LayerAttention.of(attn.sliding_window if attn.is_sliding else None)
        self.rotates = attn.sliding_window is None or attn.is_sliding


class PagedExaone4ForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "EXAONE 4's layers"
    layer_class = PagedExaone4Layer
