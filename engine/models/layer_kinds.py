"""Which of a model's layer kinds Conveyor serves. Its paged KV cache and attention backends
compute causal attention over the whole past or a sliding window, and its state cache keeps
LFM2's convolutions' last inputs, Qwen3.5's and Qwen3-Next's Gated DeltaNet states, Granite 4's,
Bamba's, Nemotron-H's and Falcon-H1's Mamba2 states and Jamba's and Mamba's own models' states
per request; a model whose layers keep another recurrent state (RWKV's) or attend sparsely
(DeepSeek V3.2's indexer) would run without what it needs and give wrong tokens silently, so
such a model is refused at start-up with the reason. Llama 4's chunked layers attend as causal
attention within one chunk, so its context is held to a chunk.

transformers names each layer's kind in the text config's `layer_types` (Mamba's layers as
`linear_attention`); a recurrent model without attention at all (RWKV) is known by its class.
"""

from __future__ import annotations

from typing import Any

# The kinds Conveyor's attention computes, and those that attend to nothing (an MLP or experts
# alone).
SERVED_KINDS = frozenset({"full_attention", "sliding_attention", "moe", "mlp", "dense", "sparse"})
# Kinds that keep a recurrent or convolution state across tokens.
RECURRENT_KINDS = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})
# Kinds of a layer that is an MLP or experts alone (Nemotron-H's blocks), attending to nothing.
MLP_KINDS = frozenset({"moe", "mlp"})
# Kinds of a layer that attends to nothing (a hybrid layer, Falcon-H1's, attends beside its
# recurrence).
NOT_ATTENDING = frozenset({"linear_attention", "conv"}) | MLP_KINDS
# Llama 4's layers that attend within fixed chunks of the context: the same as causal attention
# over a context no longer than one chunk.
CHUNKED = "chunked_attention"
# Models with no attention layer at all.
RECURRENT_MODELS = frozenset({"RwkvForCausalLM"})
# The families whose state-keeping layers Conveyor's decoder computes, and those layers' kinds
# (`kv/state_cache.py`).
STATEFUL_FAMILIES = {
    "Lfm2ForCausalLM": frozenset({"conv"}),
    "Qwen3_5ForCausalLM": frozenset({"linear_attention"}),
    "Qwen3_5MoeForCausalLM": frozenset({"linear_attention"}),
    "Qwen3_5ForConditionalGeneration": frozenset({"linear_attention"}),
    "Qwen3_5MoeForConditionalGeneration": frozenset({"linear_attention"}),
    "Qwen3NextForCausalLM": frozenset({"linear_attention"}),
    "GraniteMoeHybridForCausalLM": frozenset({"linear_attention"}),
    "NemotronHForCausalLM": frozenset({"linear_attention"}),
    "FalconH1ForCausalLM": frozenset({"hybrid"}),
    "BambaForCausalLM": frozenset({"linear_attention"}),
    "JambaForCausalLM": frozenset({"linear_attention"}),
    "MambaForCausalLM": frozenset({"linear_attention"}),
    "Mamba2ForCausalLM": frozenset({"linear_attention"}),
    "FalconMambaForCausalLM": frozenset({"linear_attention"}),
}
# The text families among them whose states tensor parallelism splits (each rank keeping its
# heads' or channels' states).
STATES_SPLIT = frozenset(
    {
        "Lfm2ForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "BambaForCausalLM",
        "FalconH1ForCausalLM",
        "NemotronHForCausalLM",
        "JambaForCausalLM",
        "MambaForCausalLM",
        "Mamba2ForCausalLM",
        "FalconMambaForCausalLM",
    }
)


def why_not_served(hf_model: Any) -> str:
    """Empty where Conveyor computes every layer of the model, else why not."""
    if type(hf_model).__name__ in RECURRENT_MODELS:
        return f"{type(hf_model).__name__} is a recurrent model with no attention layers"
    text = _text_config(hf_model)
    kinds = set(getattr(text, "layer_types", None) or ())
    computed = STATEFUL_FAMILIES.get(type(hf_model).__name__, frozenset())
    recurrent = sorted(kinds & RECURRENT_KINDS - computed)
    if recurrent:
        return (
            f"its {', '.join(recurrent)} layers keep a recurrent state (linear attention, "
            "Mamba or convolutions) that Conveyor's paged KV cache does not hold"
        )
    other = sorted(kinds - SERVED_KINDS - computed - {CHUNKED})
    if other:
        return (
            f"its {', '.join(other)} layers attend in a way Conveyor's attention does not compute"
        )
    return ""


def attending_layers(config: Any) -> list[int]:
    """The indices of the layers that attend (and hold K/V in the cache): those whose kind
    is neither a recurrence alone nor an MLP alone; every layer where no kind the config names
    is either."""
    kinds = getattr(config, "layer_types", None) or ()
    if not set(kinds) & NOT_ATTENDING:
        return list(range(config.num_hidden_layers))
    return [i for i, kind in enumerate(kinds) if kind not in NOT_ATTENDING]


def why_not_this_long(hf_model: Any, max_model_len: int) -> str:
    """Empty where every layer attends as Conveyor's attention does over `max_model_len` tokens;
    else why not (Llama 4's chunked layers past one chunk), and what to serve instead."""
    text = _text_config(hf_model)
    chunk = getattr(text, "attention_chunk_size", None)
    if CHUNKED not in (getattr(text, "layer_types", None) or ()) or not chunk:
        return ""
    if max_model_len <= chunk:
        return ""
    return (
        f"its chunked_attention layers attend within chunks of {chunk} tokens, which Conveyor's "
        f"attention does not compute past one chunk; serve it with --max-model-len {chunk} or less"
    )


def _text_config(hf_model: Any) -> Any:
    """The config of the model's language part (an image-text model's text config)."""
    config = hf_model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config
