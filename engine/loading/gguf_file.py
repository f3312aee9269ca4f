"""A GGUF file as `--model`: `conveyor serve --model ./qwen2.5-0.5b-instruct-q4_0.gguf`, as
llama.cpp's server and vLLM take one, or `--model unsloth/Qwen3-0.6B-GGUF:Q4_K_M` (vLLM's
`REPO:QUANT`: the repository's one file of that type, fetched into the Hugging Face cache). A
file split in parts (`NAME-00001-of-00003.gguf`, llama.cpp's) is named by its first part.

The first start converts the file once into Conveyor's cache: transformers reads its config and
its tokenizer (with the chat template the file carries), and its tensors are read one at a time
(`gguf_tensors`) into a checkpoint folder: a linear layer stored in a type panels hold is kept
as its blocks (`gguf_blocks`), which the CPU's panel product reads and other forms dequantize
as they load (`block_model`), every other tensor in fp32. Later starts load that folder in
seconds. The folder's name holds the file's path, size
and modification time, so an edited or replaced file converts again.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

from engine.core.paths import cache_dir
from engine.loading import gguf_parts
from engine.loading.conversions import convert_once, source_key

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
# Written last into a converted folder: its presence says the conversion finished.
SOURCE_FILE = "conveyor-gguf.json"
# `REPO:QUANT`, vLLM's form for a GGUF file of a hub repository (`unsloth/Qwen3-0.6B-GGUF:Q4_K_M`).
HUB_FILE = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+):(?P<quant>\w+)$")


def is_gguf_file(name: str | None) -> bool:
    """Whether `--model` names a GGUF file: a path ending in `.gguf` (as vLLM tells them
    apart), or `REPO:QUANT`."""
    if name is None:
        return False
    return name.lower().endswith(SUFFIX) or HUB_FILE.match(name) is not None


def gguf_path(name: str) -> Path:
    """The local GGUF file `--model` names, fetched into the Hugging Face cache for
    `REPO:QUANT`."""
    match = HUB_FILE.match(name)
    if match is None:
        return Path(name).expanduser()
    return hub_file(match["repo"], match["quant"])


@functools.cache
def hub_file(repo: str, quant: str) -> Path:
    """The one GGUF file of `repo` whose name holds `quant` (in any case), fetched (or found in
    the cache when offline) once per process: a start asks for the checkpoint several times;
    refused where none or several match."""
    from huggingface_hub import snapshot_download

    patterns = sorted({f"*{q}*{SUFFIX}" for q in (quant, quant.upper(), quant.lower())})
    try:
        folder = Path(snapshot_download(repo, allow_patterns=patterns))
    except OSError as exc:
        raise ValueError(f"--model {repo}:{quant}: cannot fetch it: {exc}") from exc
    found = sorted(
        path
        for path in folder.rglob(f"*{SUFFIX}")
        if quant.lower() in path.name.lower() and path.is_file()
    )
    if not found:
        raise ValueError(f"--model {repo}:{quant}: the repository has no {quant} GGUF file")
    if len(found) > 1:
        first = gguf_parts.first_of_one_set(found)
        if first is not None:  # the parts of one split file
            return first
        names = ", ".join(path.name for path in found)
        raise ValueError(
            f"--model {repo}:{quant}: several GGUF files match ({names}); name one more "
            "closely, or give a file's path"
        )
    return found[0]


def converted_folder(path: Path) -> Path:
    """Where the conversion of the GGUF file at `path` (a split file's first part: its every
    part counts) lives in the cache."""
    key = source_key(gguf_parts.parts(path))
    return cache_dir() / "models" / "gguf" / f"{gguf_parts.model_name(path)}-{key}"


def ensure_converted(name: str) -> Path:
    """The checkpoint folder converted from the GGUF file `name` (a path or `REPO:QUANT`; a
    file split in parts named by its first), converting it on first use."""
    path = gguf_path(name)
    if not path.is_file():
        raise ValueError(f"--model {name}: no such GGUF file")
    try:
        target = converted_folder(path)
    except ValueError as exc:
        raise ValueError(f"--model {name}: {exc}") from exc

    def converted(staged: Path) -> dict[str, object]:
        blocks = convert(path, staged, gguf_parts.model_name(path))
        logger.info("%s converted into %s", path.name, target)
        return {"gguf": str(path.resolve()), "blocks": blocks}

    return convert_once(target, SOURCE_FILE, converted)


def convert(gguf: Path, out: Path, name: str, plain: bool = False) -> int:
    """Convert the GGUF file `gguf` into a checkpoint folder `out` (weights, config, tokenizer
    and chat template, as transformers reads them from the file) whose model is called `name`,
    a linear layer in a type panels hold kept as its blocks instead of fp32 weights (`plain`:
    as both, a checkpoint other programs load whole); return how many layers kept blocks.
    Tensors are read and written one at a time (`gguf_tensors`), blocks too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from engine.loading import gguf_blocks
    from engine.loading.checkpoint_tensors import parameters_on_meta
    from engine.loading.conversions import ShardWriter
    from engine.loading.gguf_tensors import model_tensors

    logger.info("converting %s to a checkpoint, a tensor at a time ...", gguf.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with_experts_settings(config, gguf)
        config.name_or_path = name
        config.dtype = torch.float32
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        config.architectures = [type(model).__name__]
        writer = ShardWriter(out)
        blocks = gguf_blocks.BlockWriter(out)
        for tensor in model_tensors(gguf, model):
            blocks.add_all(tensor.blocks)
            if plain or not tensor.whole:  # a tied head's embedding is kept, for one
                writer.add(tensor.name, tensor.tensor)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(f"{gguf.name}: transformers cannot read this GGUF file: {exc}") from exc
    writer.close()
    kept = blocks.close()
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("%d linear layers keep their GGUF blocks", kept)
    return kept


# A mixture's settings transformers' GGUF reading leaves at its config's defaults (a Qwen3-MoE's
# experts 768 wide, whatever the file says): the GGUF keys (under the architecture's name) that
# hold them, by config field.
EXPERT_KEYS = {
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "norm_topk_prob": "expert_weights_norm",
}


def with_experts_settings(config: Any, gguf: Path) -> None:
    """Give a mixture of experts' `config` the experts' widths (and whether its router
    renormalizes the top-k weights) where the GGUF file holds them."""
    if getattr(config, "num_experts", None) is None:
        return
    from gguf import GGUFReader

    from engine.loading.gguf_tensors import metadata

    reader = GGUFReader(gguf)
    architecture = metadata(reader, "general.architecture")
    for setting, key in EXPERT_KEYS.items():
        value = metadata(reader, f"{architecture}.{key}")
        if value is not None and hasattr(config, setting):
            current = getattr(config, setting)
            setattr(config, setting, value if current is None else type(current)(value))
