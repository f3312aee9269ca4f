"""ERNIE 4.5's dense models (`Ernie4_5ForCausalLM`) on Conveyor's decoder: the Llama layer whose
rotary turns neighbouring dims as pairs over the whole head (GLM's rotation at full width),
computed in fp32 as transformers computes it. On the CPU, decode steps run the whole stack as
one C++ call (`kernels/cpu/fused_decode.py`).
"""

from __future__ import annotations

from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer

ERNIE_ARCHITECTURES = frozenset({"Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"})


class PagedErnieLayer(PagedLlamaLayer):
    paired_rotary = True
    rotary_in_fp32 = True


class PagedErnieForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedErnieLayer
