"""GGUF files written from tiny transformers models, as llama.cpp's converter lays them out: GGUF's
tensor names, a Llama's q and k rows permuted for its rotary layout, projections quantized by
GGUF's own code, and the tokenizer (vocabulary, merges, special tokens, chat template) as
metadata."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFWriter,
    get_tensor_name_map,
)
from gguf.quants import quantize

ARCHITECTURES = {
    "llama": MODEL_ARCH.LLAMA,
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3_moe": MODEL_ARCH.QWEN3MOE,
}
# GGUF's architecture names where they are not transformers' model types.
GGUF_ARCHITECTURES = {"qwen3_moe": "qwen3moe"}
# Where a block (a K-quant's super-block) of the types GGUF's code does not quantize keeps its
# fp16 scales (d, dmin), and their size for random blocks whose weights stay within about 0.5.
K_SCALES = {
    GGMLQuantizationType.Q4_K: {0: 4e-4, 2: 4e-4},
    GGMLQuantizationType.Q6_K: {208: 1e-4},
    GGMLQuantizationType.Q5_K: {0: 2e-4, 2: 2e-4},
    GGMLQuantizationType.Q3_K: {108: 4e-3},
    GGMLQuantizationType.IQ4_NL: {0: 4e-3},
    GGMLQuantizationType.IQ4_XS: {0: 1e-4},
}


def k_quant_rows(
    qtype: GGMLQuantizationType, out: int, in_features: int, seed: int = 0
) -> np.ndarray:
    """`[out, in / block * block_bytes]` uint8 rows of random blocks of `qtype`."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out, in_features // block, block_bytes), dtype=np.uint8)
    for offset, size in K_SCALES[qtype].items():
        d = rng.uniform(0.5 * size, size, (out, in_features // block)).astype(np.float16)
        blocks[..., offset : offset + 2] = d.view(np.uint8).reshape(out, -1, 2)
    return blocks.reshape(out, -1)


def stored(weight: np.ndarray, qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """`weight [out, in]` in `qtype`: quantized by GGUF's code, or random blocks of the types
    it does not quantize (K-quants, IQ4)."""
    if qtype in K_SCALES:
        return k_quant_rows(qtype, *weight.shape, seed=seed)
    return quantize(weight, qtype)


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a Llama's q or k rows (the inverse of loading's unpermute)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path: Path,
    model: Any,
    tokenizer: Any,
    qtype: Callable[[str], GGMLQuantizationType],
    split_max_tensors: int = 0,
) -> None:
    """`model` (a Llama, a Qwen2 or a Qwen3-MoE) and `tokenizer` (byte-level BPE) as a GGUF file;
    `qtype` of a GGUF tensor name gives the type its 2-D weight (or its experts' 3-D one) is
    stored in (norms and biases stay F32; a K-quant weight is random blocks of that type, not
    the model's weight). With `split_max_tensors`, split in parts of that many tensors as
    llama.cpp's `gguf-split` does (`STEM-00001-of-0000N.gguf` beside `path`, the metadata in
    the first)."""
    config = model.config
    arch = config.model_type
    writer = GGUFWriter(
        str(path), GGUF_ARCHITECTURES.get(arch, arch), split_max_tensors=split_max_tensors
    )
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    _add_tokenizer(writer, tokenizer, config.vocab_size)
    names = get_tensor_name_map(ARCHITECTURES[arch], config.num_hidden_layers)
    tied = config.tie_word_embeddings
    for seed, (hf_name, weight) in enumerate(_gguf_weights(model)):
        if tied and hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{suffix}"
        if arch == "llama" and ".attn_q." in name:
            weight = permute_rows(weight, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            weight = permute_rows(weight, config.num_key_value_heads)
        if weight.ndim >= 2 and qtype(name) != GGMLQuantizationType.F32:
            rows = stored(weight.reshape(-1, weight.shape[-1]), qtype(name), seed)
            rows = rows.reshape(*weight.shape[:-1], -1)
            writer.add_tensor(name, rows, raw_dtype=qtype(name))
        else:
            writer.add_tensor(name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_weights(model: Any) -> list[tuple[str, np.ndarray]]:
    """The model's weights as GGUF lays them out, under Hugging Face names whose module GGUF's
    name map knows: a layer's fused experts (`gate_up_proj`, gate above up) as their gate, up
    and down weights stacked over the experts."""
    weights = []
    for hf_name, tensor in model.state_dict().items():
        weight = tensor.float().numpy()
        owner, _, kind = hf_name.rpartition(".")
        if owner.endswith(".experts") and kind == "gate_up_proj":
            gate, up = np.split(weight, 2, axis=1)
            weights += [(f"{owner}.gate_proj.weight", gate), (f"{owner}.up_proj.weight", up)]
        elif owner.endswith(".experts") and kind == "down_proj":
            weights.append((f"{owner}.down_proj.weight", weight))
        else:
            weights.append((hf_name, weight))
    return weights


def _add_tokenizer(writer: GGUFWriter, tokenizer: Any, vocab_size: int) -> None:
    """A byte-level BPE tokenizer as GGUF metadata, its vocabulary padded to the model's."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab]
    tokens += [f"[PAD{i}]" for i in range(vocab_size - len(tokens))]
    special = set(tokenizer.all_special_tokens)
    types = [3 if token in special else 1 for token in tokens]  # control, normal
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
