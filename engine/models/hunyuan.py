"""Hunyuan's models on Conveyor's decoder, dense (`HunYuanDenseV1ForCausalLM`) and mixtures of
experts (`HunYuanMoEV1ForCausalLM`: a softmax router beside an MLP every token runs): the Llama
layer with each q and k head normed after the rotary (Qwen3 norms them before it), which the
fused CPU decode norms there too (the dense model's whole stack as one C++ call; the mixture's
each layer's attention as one, its experts between them).
"""

from __future__ import annotations

from typing import Any

from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer

HUNYUAN_ARCHITECTURES = frozenset({"HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM"})


class PagedHunYuanLayer(PagedLlamaLayer):
    norms_rotated = True

    def _qk_norms(self, attn: Any) -> tuple[Any, Any] | None:
        return attn.query_layernorm, attn.key_layernorm


class PagedHunYuanForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedHunYuanLayer
