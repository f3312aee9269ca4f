"""EXAONE 4.0 and EXAONE MoE on Conveyor's decoder. EXAONE 4.0's layer is the one OLMo 2's is too
(no norm before the attention or the MLP; each one's output normed before it joins the residual)
with Qwen3's norm of each q and k head before the rotary; EXAONE MoE's is the Llama layer with
those norms, and experts in place of the MLP after its dense layers. Their hybrid models (a
sliding window on three layers of four) window only their sliding layers, and their global layers
rotate nothing (NoPE). On the CPU, EXAONE 4.0's decode steps run the whole stack as one C++ call
(`kernels/cpu/fused_decode.py`).
"""

from __future__ import annotations

from typing import Any

from engine.attention.backend import LayerAttention
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.models.olmo2 import PostNormedLayer
from engine.parallel.sharding import Shard

EXAONE4_ARCHITECTURES = frozenset({"Exaone4ForCausalLM"})
EXAONE_MOE_ARCHITECTURES = frozenset({"ExaoneMoeForCausalLM"})


def hybrid_attention(attn: Any) -> tuple[LayerAttention | None, bool]:
    """An EXAONE layer's attention and whether it rotates: every layer holds the config's
    window, only the sliding ones attend within it, and a hybrid model's global layers rotate
    nothing."""
    window = attn.sliding_window if attn.is_sliding else None
    return LayerAttention.of(window), attn.sliding_window is None or attn.is_sliding


class PagedExaone4Layer(PostNormedLayer):
    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        self.attention, self.rotates = hybrid_attention(hf_layer.self_attn)


class PagedExaone4ForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedExaone4Layer


class PagedExaoneMoeLayer(PagedLlamaLayer):
    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        self.attention, self.rotates = hybrid_attention(hf_layer.self_attn)


class PagedExaoneMoeForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedExaoneMoeLayer
