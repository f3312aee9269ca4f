"""LoRA adapters for the tiny test model, written by PEFT as users' training runs write them,
and PEFT's own model with the adapter merged: the oracle for what serving one computes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.helpers import tiny_llama

# A dev requirement; a GPU host given only the offline kit may lack what it needs to install.
peft = pytest.importorskip("peft", reason="peft is not installed on this host")
LoraConfig, PeftModel, get_peft_model = peft.LoraConfig, peft.PeftModel, peft.get_peft_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def save_adapter(
    folder: Path,
    targets: list[str],
    seed: int,
    rank: int = 4,
    zero: bool = False,
    base: Callable[[], torch.nn.Module] = tiny_llama,
    **config: Any,
) -> str:
    """An adapter of the tiny model (or of the model `base` builds) saved in `folder`: random A
    and B wide enough to change its greedy tokens (or, with `zero`, B left at zero as PEFT
    initializes it: a delta of nothing)."""
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=zero, **config
    )
    model = get_peft_model(base(), lora)
    if not zero:
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "lora_B" in name:
                    weight.normal_(std=0.3)
    model.save_pretrained(str(folder))
    return str(folder)


def merged(path: str, base: torch.nn.Module | None = None, **tiny: Any) -> LlamaForCausalLM:
    """The tiny model (or `base`) with the adapter at `path` merged into its weights, by
    PEFT."""
    model = base if base is not None else tiny_llama(**tiny)
    return PeftModel.from_pretrained(model, path).merge_and_unload()
