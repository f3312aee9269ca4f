"""MiniMax M2 on Conveyor's decoder: the Llama layer with q and k each normed over all their
heads at once (OLMo 2's norms, before the rotary, here with a norm before the attention too), a
partial rotary, and experts chosen by their sigmoid scores plus a bias in every layer. On the
CPU each layer's attention decodes as one C++ call, its experts between them."""

from __future__ import annotations

from engine.models.llama import PagedLlamaForCausalLM
from engine.models.olmo2 import AllHeadsNormedLayer

MINIMAX_ARCHITECTURES = frozenset({"MiniMaxM2ForCausalLM"})


class PagedMiniMaxM2ForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = AllHeadsNormedLayer
