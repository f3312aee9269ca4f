"""Loading a Hugging Face causal LM and its tokenizer with Conveyor's paged attention."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from engine.attention import hf as hf_attention
from engine.kernels.cpu import malloc_tuning
from engine.kernels.cpu.build import cpu_flags
from engine.kernels.cpu.linear import (
    blocks_in_bf16,
    convert_linears,
    fp32_packing_supported,
    half_weights_supported,
    pack_linears,
    use_gguf_blocks,
    widen_all_but_kernels,
)
from engine.kernels.cpu.ops import bf16_panels_available, panel_linear_available
from engine.loading import block_budget, block_model
from engine.loading.block_model import has_blocks, load_converted, read_blocks
from engine.loading.checkpoint_tensors import model_from_config
from engine.loading.classifiers import as_causal_lm, is_classifier, labels
from engine.loading.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from engine.loading.gguf_file import ensure_converted, is_gguf_file
from engine.loading.mxfp4_experts import expert_blocks, is_mxfp4
from engine.loading.processors import load_processor
from engine.loading.quantized_checkpoint import ensure_converted as ensure_dequantized
from engine.loading.quantized_checkpoint import load_options, quantized_folder
from engine.models.experts import unfuse_experts
from engine.models.vision import is_image_text, why_not_served
from engine.parallel.loading import load_share
from engine.parallel.sharding import ShardShape, shard_model

logger = logging.getLogger(__name__)

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "half": torch.float16,
    "float": torch.float32,
}
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    path: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    compute_dtype: torch.dtype
    # Under tensor parallelism, the share of the weights `model` holds.
    shard: ShardShape | None = None
    # An image-text model's processor (it turns images into pixels and placeholders).
    processor: Any = None
    # A sequence classifier's labels, in logit order (its head is the score head).
    labels: tuple[str, ...] = ()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX-512 BF16 or AMX)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_supports_fp16() -> bool:
    """True when the CPU has native fp16 arithmetic (AVX-512 FP16 or AMX FP16)."""
    flags = cpu_flags()
    return "avx512_fp16" in flags or "amx_fp16" in flags


def half_weights_in_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a 16-bit model on this device should keep 16-bit weights but carry fp32
    activations between its layers: a CPU without native arithmetic for `dtype`, where an
    fp16-weight product runs, or a bf16 model on a CPU with AVX-512 BF16, where Conveyor's bf16
    panels multiply (torch's bf16 linear layers repack their weights at every call)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    native = cpu_supports_bf16() if dtype == torch.bfloat16 else cpu_supports_fp16()
    if native:
        return dtype == torch.bfloat16 and bf16_panels_available()
    return half_weights_supported()


def resolve_dtype(
    name: str, device: torch.device, model: str | None = None, trust_remote_code: bool = False
) -> torch.dtype:
    """`auto`: bf16 on GPUs and CPUs with native bf16. On other CPUs, a checkpoint stored in bf16
    or fp16 keeps its 16-bit weights and computes in fp32 (`half_weights_in_fp32`), anything
    else runs fp32. `model` is the folder or hub id (None: the default model)."""
    if name != "auto":
        try:
            return DTYPES[name]
        except KeyError:
            raise ValueError(
                f"unknown dtype {name!r}; choose auto, bfloat16, float16 or float32"
            ) from None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_supports_bf16():
        return torch.bfloat16
    stored = checkpoint_dtype(model, trust_remote_code)
    if stored in (torch.bfloat16, torch.float16) and half_weights_supported():
        return stored
    return torch.float32


def checkpoint_dtype(
    name_or_path: str | None,
    trust_remote_code: bool = False,
) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are stored in; None where it says none
    or the config does not load (loading the model then reports why)."""
    config = checkpoint_config(name_or_path, trust_remote_code)
    if config is None:
        return None
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = DTYPES.get(stored)
    return stored if isinstance(stored, torch.dtype) else None


def checkpoint_config(name_or_path: str | None, trust_remote_code: bool = False) -> Any:
    """A checkpoint's config (None: the default model's), or None where it does not load
    (loading the model then reports why)."""
    from transformers import AutoConfig

    path = checkpoint_path(name_or_path)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None


def checkpoint_path(name_or_path: str | None) -> str:
    """Where the checkpoint `--model` names is read from: the default model's folder (None), a
    GGUF file's or an AWQ or GPTQ checkpoint's, converted into the cache on first use; an MXFP4
    hub checkpoint's fetched folder; else the folder or hub id itself."""
    if name_or_path is None:
        return str(ensure_default_model())
    if is_gguf_file(name_or_path):
        return str(ensure_converted(name_or_path))
    folder = quantized_folder(name_or_path)
    if folder is not None and is_mxfp4(str(folder)):
        return str(folder)  # read as it is, its experts' blocks too
    if folder is not None:
        return str(ensure_dequantized(name_or_path))
    return name_or_path


def context_length(config: Any) -> int:
    config = config.get_text_config()  # an image-text model's language model's
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (
        getattr(model, "generation_config", None),
        model.config,
        model.config.get_text_config(),
    ):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load_model(
    name_or_path: str | None,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    int8_activations: bool = False,
    rank: tuple[int, int] = (0, 1),
    random_weights: bool = False,
    tokenizer_name: str | None = None,
    served_name: str | None = None,
    slow_tokenizer: bool = False,
    keep_blocks: bool | None = False,
    kv_reserve: int = 0,
) -> LoadedModel:
    """Load weights and tokenizer; None loads the embedded default model, a `.gguf` file its
    conversion (`gguf_file.py`); `tokenizer_name` (`--tokenizer`) is a folder or hub id to take
    the tokenizer and chat template from instead of the model's (`slow_tokenizer`: its Python
    implementation, not the fast one); `served_name` the name
    replies give the model (default: as `name_or_path` says). `int8_activations`
    multiplies the blocks of an fp32 CPU model that have int8 panels (`gguf_blocks.INT8_FORMATS`)
    against inputs rounded to 8-bit blocks. A converted folder's block layers are built as the
    model loads (`block_model`). `rank` is (rank, size) under tensor parallelism: the
    model is cut to that rank's share before it moves to `device`. With `random_weights`
    (`--load-format dummy`) no weight is read: the model gets random ones of its shape."""
    from transformers import AutoTokenizer

    path = checkpoint_path(name_or_path)
    name = served_name or (DEFAULT_MODEL_NAME if name_or_path is None else name_or_path)
    model, shard, classes = load_weights(
        path,
        dtype,
        device,
        trust_remote_code,
        int8_activations,
        rank,
        random_weights,
        keep_blocks,
        kv_reserve,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_name or path, trust_remote_code=trust_remote_code, use_fast=not slow_tokenizer
    )
    processor = image_processor(model.config, path, trust_remote_code)
    if processor is not None and getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = getattr(processor, "chat_template", None)  # kept with it
    loaded = wrap_model(model, tokenizer, name=name, path=path, processor=processor)
    loaded.shard = shard
    loaded.labels = classes
    return loaded


def load_weights(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    trust_remote_code: bool = False,
    int8_activations: bool = False,
    rank: tuple[int, int] = (0, 1),
    random_weights: bool = False,
    keep_blocks: bool | None = False,
    kv_reserve: int = 0,
) -> tuple[Any, ShardShape | None, tuple[str, ...]]:
    """The transformers model at the folder `path` on `device`, its linear layers in the form
    they run in (see `load_model`); its share under tensor parallelism, and a sequence
    classifier's labels. Neither tokenizer nor processor is read. A converted folder's blocks
    are held in fp32 panels, and with `keep_blocks` beside 16-bit panels too (`--keep-blocks`;
    None: where the widened weights and `kv_reserve` bytes of KV cache would not fit in the
    memory left, `block_budget`); an MXFP4 checkpoint's experts beside any panels."""
    logger.info("loading %s (%s on %s)", path, str(dtype).removeprefix("torch."), device)
    form = choose_linear_form(dtype, device)
    shard, model, hold = None, None, False
    if random_weights:
        model, shard = _random_model(path, dtype, device, rank, trust_remote_code)
    elif rank[1] > 1:
        model, shard = load_share(path, dtype, *rank, trust_remote_code=trust_remote_code)
    elif has_blocks(path):
        if keep_blocks is None and form in HALF_FORMS:
            keep_blocks = block_budget.keep_for_memory(Path(path), dtype, kv_reserve)
        kept = form is LinearForm.FP32_PANELS or (bool(keep_blocks) and form in PANEL_FORMS)
        hold = kept and panel_linear_available()
        model = load_converted(path, dtype, hold, int8_activations, trust_remote_code)
    elif form in PANEL_FORMS and panel_linear_available() and is_mxfp4(path):
        experts = expert_blocks(Path(path))
        model = load_converted(path, dtype, True, int8_activations, trust_remote_code, experts)
    # Blocks are taken up once: as the model loads, or after it loaded whole; a share's weights
    # (and random ones) do not match them.
    take_blocks = model is None
    if model is None:
        model = load_whole(path, dtype, trust_remote_code)
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{path} is an encoder-decoder model; only decoder-only models are served")
    classes = labels(model.config) if is_classifier(model.config) else ()
    if classes:
        model = as_causal_lm(model)
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' own stubs
    use_linear_form(model, form, Path(path) if take_blocks else None, int8_activations)
    if device.type == "cpu":
        malloc_tuning.give_back_freed_memory()  # what reading and packing freed
    if keep_blocks and not (hold and form in HALF_FORMS):
        logger.warning(
            "--keep-blocks has no effect here: it needs a bf16 or fp16 model on a CPU and a GGUF "
            "file or quantized checkpoint (in fp32 their blocks are kept anyway)"
        )
    if int8_activations and not any(getattr(m, "int8_activations", False) for m in model.modules()):
        logger.warning(
            "--int8-activations has no effect here: it needs float32 on a CPU and Q4_0, Q4_1, "
            "Q8_0 or Q4_K blocks (a GGUF file's) or a quantized checkpoint's 4-bit groups"
        )
    return model, shard, classes


def load_whole(path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> Any:
    """The model at `path` loaded by transformers, by its auto class (`block_model.load_whole`:
    a converted checkpoint's layers kept only as blocks get their blocks dequantized; an MXFP4
    checkpoint's experts are dequantized as they load)."""
    auto = auto_model_class(path, trust_remote_code)
    return block_model.load_whole(auto, path, dtype, trust_remote_code, load_options(path))


def auto_model_class(path: str, trust_remote_code: bool = False) -> Any:
    """transformers' auto class for the checkpoint: image-text models (LLaVA and its kin) and
    sequence classifiers have their own; every other model is a causal LM. An image-text family
    whose images Conveyor does not serve is refused here, by name."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    config = checkpoint_config(path, trust_remote_code)
    if config is not None and is_classifier(config):
        return AutoModelForSequenceClassification
    if config is None or not is_image_text(config):
        return AutoModelForCausalLM
    reason = why_not_served(config)
    if reason:
        raise ValueError(f"{path} is an image-text model Conveyor does not serve: {reason}")
    return AutoModelForImageTextToText


def image_processor(config: Any, path: str, trust_remote_code: bool = False) -> Any:
    """An image-text model's processor (None for a text model)."""
    if not is_image_text(config):
        return None
    return load_processor(path, config.model_type, trust_remote_code)


def _random_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    rank: tuple[int, int],
    trust_remote_code: bool,
) -> tuple[Any, ShardShape | None]:
    """The model at `path` built from its config with random weights (transformers' own
    initialisation), made where it will run (a tensor-parallel rank cuts its share on the CPU
    first); nothing else of the checkpoint is read."""
    logger.warning("--load-format dummy: random weights, for measuring speed and memory only")
    parallel = rank[1] > 1
    with torch.device("cpu" if parallel else device):
        model = model_from_config(path, dtype, trust_remote_code)
    return model, shard_model(model, *rank) if parallel else None


class LinearForm(StrEnum):
    """How a model's linear layers hold their weights and multiply."""

    BF16_PANELS = "bf16 panels, fp32 between layers"
    HALF_WEIGHTS = "16-bit weights, computed in fp32"
    FP32_PANELS = "fp32 panels (quantized blocks where kept beside the checkpoint)"
    TORCH = "torch's own"


# The forms that carry fp32 activations through Conveyor's panels, where a layer of quantized
# blocks multiplies beside the others.
PANEL_FORMS = (LinearForm.BF16_PANELS, LinearForm.HALF_WEIGHTS, LinearForm.FP32_PANELS)
# The forms whose weights are 16-bit: `--keep-blocks` keeps blocks beside them.
HALF_FORMS = (LinearForm.BF16_PANELS, LinearForm.HALF_WEIGHTS)


def choose_linear_form(dtype: torch.dtype, device: torch.device) -> LinearForm:
    """The linear layers' form for a `dtype` model on `device`, chosen once at load time: on a
    CPU, Conveyor's panels where its kernels built (bf16 panels on AVX-512 BF16, 16-bit weights
    computed in fp32 on CPUs without native 16-bit arithmetic); torch's own elsewhere."""
    if half_weights_in_fp32(dtype, device):
        if dtype == torch.bfloat16 and bf16_panels_available():
            return LinearForm.BF16_PANELS
        return LinearForm.HALF_WEIGHTS
    if device.type == "cpu" and dtype == torch.float32 and fp32_packing_supported():
        return LinearForm.FP32_PANELS
    return LinearForm.TORCH


def use_linear_form(
    model: Any, form: LinearForm, folder: Path | None = None, int8_activations: bool = False
) -> None:
    """Hold the model's linear layers in `form`; fp32 panels take the GGUF blocks kept in
    `folder`, if any. 16-bit weights were already rounded to the model's dtype: fp16 holds every
    bf16 value between 2**-17 and 65504 exactly."""
    logger.info("linear layers: %s", form)
    unfuse_experts(model)
    if form in (LinearForm.BF16_PANELS, LinearForm.HALF_WEIGHTS):
        dtype = model.get_input_embeddings().weight.dtype
        parts = widened_parts(model)
        # Each layer widens on its own as it takes its panels, then the rest of the parts: the
        # model is never held in fp32 whole.
        convert_linears(model, dtype, within=parts)
        for part in parts:
            widen_all_but_kernels(part)
        if form is LinearForm.BF16_PANELS:
            blocks_in_bf16(model)
    elif form is LinearForm.FP32_PANELS:
        if folder is not None:
            use_gguf_blocks_beside(model, folder, int8_activations)
        pack_linears(model)


def widened_parts(model: Any) -> list[Any]:
    """What carries fp32 activations between 16-bit weights: the whole model, or an image-text
    model's language model and head. Its vision encoder keeps the checkpoint's dtype and
    torch's own layers, whose products over thousands of patches at once run about twice as
    fast there as through the panels."""
    if is_image_text(model.config):
        return [model.get_decoder(), model.get_output_embeddings()]
    return [model]


def use_gguf_blocks_beside(model: Any, folder: Path, int8_activations: bool = False) -> None:
    """Hold fp32 linear layers in the GGUF blocks kept beside the checkpoint, if any (the default
    model keeps its Q4_1 and Q8_0 blocks), where they widen to exactly the loaded weights and
    Conveyor's panel kernel runs."""
    if has_blocks(str(folder)) and panel_linear_available():
        use_gguf_blocks(model, read_blocks(str(folder)), int8_activations)


def wrap_model(
    model: Any, tokenizer: Any, name: str, path: str = "", processor: Any = None
) -> LoadedModel:
    """Describe an already loaded model (tests build tiny ones in memory). An image-text
    model's vision encoder keeps SDPA: the paged attention is its language model's."""
    paged = hf_attention.register()
    if is_image_text(model.config):
        model.set_attn_implementation({"": paged, "text_config": paged, "vision_config": "sdpa"})
    else:
        model.set_attn_implementation(paged)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=path,
        max_model_len=context_length(model.config),
        eos_token_ids=eos_token_ids(model, tokenizer),
        compute_dtype=model.get_input_embeddings().weight.dtype,
        processor=processor,
    )
