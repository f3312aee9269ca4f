"""The model the runner steps: Conveyor's own decoder where the architecture is supported,
otherwise the Hugging Face model itself with the paged attention plugged in.

Both take the flattened step (token ids and positions `[tokens]`, the attention metadata, the
flattened indices whose logits are wanted) and return logits `[len(indices), vocab]`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.models.bamba import BAMBA_ARCHITECTURES, PagedBambaForCausalLM
from engine.models.bamba import why_not_run as bamba_reason
from engine.models.base import CausalLM
from engine.models.deepseek import (
    DEEPSEEK_ARCHITECTURES,
    DEEPSEEK_V2_ARCHITECTURES,
    PagedDeepseekForCausalLM,
    PagedDeepseekV2ForCausalLM,
)
from engine.models.ernie import ERNIE_ARCHITECTURES, PagedErnieForCausalLM
from engine.models.exaone4 import (
    EXAONE4_ARCHITECTURES,
    EXAONE_MOE_ARCHITECTURES,
    PagedExaone4ForCausalLM,
    PagedExaoneMoeForCausalLM,
)
from engine.models.falcon_h1 import FALCON_H1_ARCHITECTURES, PagedFalconH1ForCausalLM
from engine.models.falcon_h1 import why_not_run as falcon_h1_reason
from engine.models.gemma import GEMMA_ARCHITECTURES, PagedGemmaForCausalLM
from engine.models.glm import GLM_ARCHITECTURES, PagedGlmForCausalLM
from engine.models.gpt_oss import GPT_OSS_ARCHITECTURES, PagedGptOssForCausalLM
from engine.models.granite import GRANITE_ARCHITECTURES, PagedGraniteForCausalLM
from engine.models.granite_hybrid import (
    GRANITE_HYBRID_ARCHITECTURES,
    PagedGraniteHybridForCausalLM,
)
from engine.models.granite_hybrid import why_not_run as granite_hybrid_reason
from engine.models.helium import HELIUM_ARCHITECTURES, PagedHeliumForCausalLM
from engine.models.hf import TransformersCausalLM
from engine.models.hunyuan import HUNYUAN_ARCHITECTURES, PagedHunYuanForCausalLM
from engine.models.jamba import JAMBA_ARCHITECTURES, PagedJambaForCausalLM
from engine.models.jamba import why_not_run as jamba_reason
from engine.models.layer_kinds import why_not_served
from engine.models.lfm2 import LFM2_ARCHITECTURES, PagedLfm2ForCausalLM
from engine.models.lfm2 import why_not_run as lfm2_reason
from engine.models.llama import PagedLlamaForCausalLM, plain_projections, supports
from engine.models.mamba import MAMBA_ARCHITECTURES, PagedMambaForCausalLM
from engine.models.mamba import why_not_run as mamba_reason
from engine.models.minimax import MINIMAX_ARCHITECTURES, PagedMiniMaxM2ForCausalLM
from engine.models.nanochat import NANOCHAT_ARCHITECTURES, PagedNanoChatForCausalLM
from engine.models.nemotron_h import NEMOTRON_H_ARCHITECTURES, PagedNemotronHForCausalLM
from engine.models.nemotron_h import why_not_run as nemotron_h_reason
from engine.models.olmo2 import (
    OLMO2_ARCHITECTURES,
    OLMOE_ARCHITECTURES,
    PagedOlmo2ForCausalLM,
    PagedOlmoeForCausalLM,
)
from engine.models.qwen3_5 import QWEN3_5_ARCHITECTURES, PagedQwen3_5ForCausalLM
from engine.models.qwen3_5 import why_not_run as qwen3_5_reason
from engine.models.vision import (
    TransformersImageTextLM,
    decoder_supports,
    is_image_text,
    needs_decoder,
    paged_image_text,
)
from engine.parallel.sharding import Shard

MODEL_IMPLS = ("auto", "conveyor", "transformers")
# Architectures whose transformers layers do not hand the attention its keyword arguments, or
# hand it keys and values the paged cache does not hold (DeepSeek's expanded from the latent),
# so the paged attention cannot be plugged into them: Conveyor's decoder is their only way.
DECODER_ONLY = (
    frozenset({"StableLmForCausalLM"})
    | DEEPSEEK_ARCHITECTURES
    | DEEPSEEK_V2_ARCHITECTURES
    # Their recurrent layers' states live in Conveyor's state cache.
    | LFM2_ARCHITECTURES
    | QWEN3_5_ARCHITECTURES
    | GRANITE_HYBRID_ARCHITECTURES
    | NEMOTRON_H_ARCHITECTURES
    | FALCON_H1_ARCHITECTURES
    | BAMBA_ARCHITECTURES
    | JAMBA_ARCHITECTURES
    | MAMBA_ARCHITECTURES
)

# The families of the Llama decoder with a model of their own, by architecture.
FAMILY_DECODERS: dict[str, type[PagedLlamaForCausalLM]] = {
    architecture: decoder
    for architectures, decoder in (
        (GRANITE_ARCHITECTURES, PagedGraniteForCausalLM),
        (OLMO2_ARCHITECTURES, PagedOlmo2ForCausalLM),
        (OLMOE_ARCHITECTURES, PagedOlmoeForCausalLM),
        (GLM_ARCHITECTURES, PagedGlmForCausalLM),
        (GPT_OSS_ARCHITECTURES, PagedGptOssForCausalLM),
        (EXAONE4_ARCHITECTURES, PagedExaone4ForCausalLM),
        (EXAONE_MOE_ARCHITECTURES, PagedExaoneMoeForCausalLM),
        (MINIMAX_ARCHITECTURES, PagedMiniMaxM2ForCausalLM),
        (DEEPSEEK_ARCHITECTURES, PagedDeepseekForCausalLM),
        (DEEPSEEK_V2_ARCHITECTURES, PagedDeepseekV2ForCausalLM),
        (HUNYUAN_ARCHITECTURES, PagedHunYuanForCausalLM),
        (ERNIE_ARCHITECTURES, PagedErnieForCausalLM),
        (NANOCHAT_ARCHITECTURES, PagedNanoChatForCausalLM),
        (HELIUM_ARCHITECTURES, PagedHeliumForCausalLM),
        (GEMMA_ARCHITECTURES, PagedGemmaForCausalLM),
        (LFM2_ARCHITECTURES, PagedLfm2ForCausalLM),
        (QWEN3_5_ARCHITECTURES, PagedQwen3_5ForCausalLM),
        (GRANITE_HYBRID_ARCHITECTURES, PagedGraniteHybridForCausalLM),
        (NEMOTRON_H_ARCHITECTURES, PagedNemotronHForCausalLM),
        (FALCON_H1_ARCHITECTURES, PagedFalconH1ForCausalLM),
        (BAMBA_ARCHITECTURES, PagedBambaForCausalLM),
        (JAMBA_ARCHITECTURES, PagedJambaForCausalLM),
        (MAMBA_ARCHITECTURES, PagedMambaForCausalLM),
    )
    for architecture in architectures
}

# Why Conveyor's decoder would not run a model of the families whose layers are not the Llama
# layer's, by architecture (`supports` for the others).
FAMILY_REASONS: dict[str, Callable[[Any], str]] = {
    architecture: reason
    for architectures, reason in (
        (LFM2_ARCHITECTURES, lfm2_reason),
        (QWEN3_5_ARCHITECTURES, qwen3_5_reason),
        (GRANITE_HYBRID_ARCHITECTURES, granite_hybrid_reason),
        (NEMOTRON_H_ARCHITECTURES, nemotron_h_reason),
        (FALCON_H1_ARCHITECTURES, falcon_h1_reason),
        (BAMBA_ARCHITECTURES, bamba_reason),
        (JAMBA_ARCHITECTURES, jamba_reason),
        (MAMBA_ARCHITECTURES, mamba_reason),
    )
    for architecture in architectures
}

__all__ = ["MODEL_IMPLS", "CausalLM", "build_causal_lm"]


def build_causal_lm(hf_model: Any, impl: str = "auto", shard: Shard | None = None) -> CausalLM:
    """`auto` takes Conveyor's implementation when it covers the architecture. A `shard` (one
    rank's share under tensor parallelism) runs on Conveyor's implementation only."""
    if impl not in MODEL_IMPLS:
        raise ValueError(
            f"unknown model implementation {impl!r}; choose one of {', '.join(MODEL_IMPLS)}"
        )
    unserved = why_not_served(hf_model)
    if unserved:
        raise ValueError(f"Conveyor cannot serve {type(hf_model).__name__}: {unserved}")
    if is_image_text(hf_model.config):
        return _image_text_lm(hf_model, impl, shard)
    reason = decoder_reason(hf_model)
    decoder = _decoder_class(type(hf_model).__name__)
    if shard is not None:
        if impl == "transformers" or reason:
            why = "--model-impl transformers" if impl == "transformers" else reason
            raise ValueError(
                f"tensor parallelism runs on Conveyor's model implementation only: {why}"
            )
        return decoder(hf_model, shard)
    if impl == "conveyor" and reason:
        raise ValueError(f"Conveyor's model implementation cannot run this model: {reason}")
    if (impl == "transformers" or reason) and type(hf_model).__name__ in DECODER_ONLY:
        why = f": {reason}" if reason else ""
        raise ValueError(
            f"{type(hf_model).__name__} runs on Conveyor's model implementation only "
            f"(the paged attention cannot be plugged into transformers' layers){why}"
        )
    if impl == "transformers" or reason:
        return TransformersCausalLM(hf_model)
    return decoder(hf_model)


def decoder_reason(hf_model: Any) -> str:
    """Empty where Conveyor's decoder runs this text model, else why not."""
    if type(hf_model).__name__ in GEMMA_ARCHITECTURES:  # not the Llama family's, but its layer
        return plain_projections(hf_model.model.layers)
    reason = FAMILY_REASONS.get(type(hf_model).__name__, supports)
    return reason(hf_model)


def _decoder_class(architecture: str) -> type[PagedLlamaForCausalLM]:
    """Conveyor's decoder for a Llama-family architecture (a family may have its own layer)."""
    return FAMILY_DECODERS.get(architecture, PagedLlamaForCausalLM)


def _image_text_lm(hf_model: Any, impl: str, shard: Shard | None) -> CausalLM:
    """An image-text model on one device: Conveyor's decoder for its language model where
    that is of the Llama family or Gemma 3 (`auto`, `conveyor`), else transformers' model
    whole."""
    if shard is not None:
        raise ValueError("tensor parallelism serves text models only, not image-text ones")
    reason = decoder_supports(hf_model)
    if (impl == "conveyor" or needs_decoder(hf_model)) and reason:
        raise ValueError(f"Conveyor's model implementation cannot run this model: {reason}")
    if impl == "transformers" and needs_decoder(hf_model):
        raise ValueError(
            "this image-text model runs on Conveyor's model implementation only: its vision "
            "encoder feeds decoder layers, which transformers' model takes from its own "
            "forward alone"
        )
    if impl == "transformers" or reason:
        return TransformersImageTextLM(hf_model)
    return paged_image_text(hf_model)
