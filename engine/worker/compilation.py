"""torch.compile over what Conveyor's decoder does between attention calls (`--compile`).

Attention depends on how a step's tokens split into sequences and reads the paged cache, so it
stays outside, as vLLM splits its compiled graph at attention. What a layer does before it
(`project_qkv`: norm, fused projection, q/k norm, rotary) and after it (`after_attention`: output
projection, residual, norm, MLP) works row by row, so inductor can fuse its elementwise passes
for any number of tokens. Every layer runs the same code over its own weights, which torch.compile
takes as graph inputs: one compiled graph serves them all.

Compiling happens when the engine is built, on a few rows through every layer (two sizes make
the token count dynamic; one row is a shape of its own), so no request waits on it; a failure
leaves the layers eager, with one warning. CUDA graphs then capture the compiled pieces as they
captured the eager ones.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from engine.core.paths import cache_dir
from engine.kernels.cpu import ops as cpu_ops
from engine.models import CausalLM
from engine.models.experts import SPARSE_ON_HOST
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer

logger = logging.getLogger(__name__)

# Rows run through every layer at start-up: the second size makes the token count dynamic; a
# single row (a decode step of one sequence) is a shape torch.compile keeps apart.
WARM_UP_ROWS = (2, 3, 1)
PIECES = ("project_qkv", "after_attention")
# Where inductor keeps its compiled code between starts (unless set already).
CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def why_not_compiled(model: CausalLM) -> str:
    """Why `model`'s layers are not compiled ("" where they can be)."""
    if not isinstance(model, PagedLlamaForCausalLM):
        return "the Hugging Face model implementation is not compiled"
    if model.shard is not None:
        return "steps across tensor-parallel ranks are not compiled"
    if model.sparse:
        return SPARSE_ON_HOST
    if model.state_specs():
        return "layers that keep recurrent states (LFM2's, Qwen3.5's) are not compiled"
    if not model.splits_at_attention:
        return "layers that are not cut at an attention call are not compiled"
    return ""


def compile_layers(model: CausalLM) -> str:
    """Compile `model`'s layer pieces and run them once at each warm-up size; return how the
    layers run, for the start-up routes line."""
    reason = why_not_compiled(model)
    if reason:
        logger.warning("--compile: %s; the layers run eagerly", reason)
        return f"off ({reason})"
    assert isinstance(model, PagedLlamaForCausalLM)
    os.environ.setdefault(CACHE_VARIABLE, str(cache_dir() / "inductor"))
    cpu_ops.register_fakes()
    layers = [layer for layer in model.layers if isinstance(layer, PagedLlamaLayer)]
    start = time.perf_counter()
    for layer in layers:
        for name in PIECES:
            setattr(layer, name, torch.compile(getattr(layer, name)))
    try:
        warm_up(model, layers)
    except Exception as exc:  # inductor needs a working compiler and every op traceable
        for layer in layers:
            for name in PIECES:
                delattr(layer, name)
        logger.warning("--compile: compiling the layers failed, they run eagerly: %s", exc)
        return f"off (compiling failed: {_first_line(exc)})"
    logger.info("compiled the layers in %.1f s", time.perf_counter() - start)
    return "torch.compile (inductor) between attention calls"


@torch.inference_mode()
def warm_up(model: PagedLlamaForCausalLM, layers: list[PagedLlamaLayer]) -> None:
    """Each layer's pieces over `WARM_UP_ROWS` rows of the embedding's output."""
    device = model.embed_tokens.weight.device
    for rows in WARM_UP_ROWS:
        ids = torch.zeros(rows, dtype=torch.int64, device=device)
        hidden = model.embed_tokens(ids)
        cos, sin = model.rotary(hidden, torch.arange(rows, device=device))
        for layer in layers:
            query, _, _ = layer.project_qkv(hidden, cos, sin)
            hidden = layer.after_attention(query.contiguous(), hidden)


def is_compiled(layer: Any) -> bool:
    """Whether the layer's pieces are torch.compile's."""
    return all(name in vars(layer) for name in PIECES)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]
