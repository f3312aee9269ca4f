"""EXAONE 4.0 on Conveyor's decoder: OLMo 2's layer (no norm before the attention or the MLP;
each one's output normed before it joins the residual) with Qwen3's norm of each q and k head
before the rotary. Its hybrid models (a sliding window on three layers of four) window only
their sliding layers, and their global layers rotate nothing (NoPE). Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.backend import LayerAttention
from engine.lora.slots import LoRASlots
from engine.models.llama import PagedLlamaLayer
from engine.models.olmo2 import PagedOlmo2ForCausalLM, PagedOlmo2Layer
from engine.parallel.sharding import Shard

EXAONE4_ARCHITECTURES = frozenset({"Exaone4ForCausalLM"})


class PagedExaone4Layer(PagedOlmo2Layer):
    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        attn = hf_layer.self_attn
        # Every layer holds the config's window; only the sliding ones attend within it.
        self.attention = LayerAttention.of(attn.sliding_window if attn.is_sliding else None)
        self.rotates = attn.sliding_window is None or attn.is_sliding

    def _qk_norm_weight(self, attn: Any) -> torch.Tensor | None:
        return PagedLlamaLayer._qk_norm_weight(self, attn)  # per head, as Qwen3's

    def project_qkv(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoRASlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return PagedLlamaLayer.project_qkv(self, hidden, cos, sin, lora)


class PagedExaone4ForCausalLM(PagedOlmo2ForCausalLM):
    name = "conveyor"
    op_by_op = "EXAONE 4's layers"
    layer_class = PagedExaone4Layer
