"""A hub model fetched as vLLM's flags ask: `--revision` (a branch, tag or commit of the model's
repository), `--tokenizer-revision` (the tokenizer's), `--download-dir` (a Hugging Face cache
folder of its own) and `--hf-token` (for gated or private repositories). Where any is given (or
`--hf-overrides`, which overlays a local folder), the repository's files are fetched at that
revision into that folder once at start-up and every later read (the config, the weights, under
tensor parallelism each worker's share, the tokenizer) takes the local folder; replies still
name the model as `--model` gave it. Without them, transformers fetches a hub id as it always
does."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from engine.core.config import EngineConfig

logger = logging.getLogger(__name__)

# The files a model is read from besides its weights (not other frameworks' copies of it).
MODEL_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
TOKENIZER_FILES = MODEL_FILES  # a tokenizer's repository without its model's weights
# Where the weights are looked for, in turn: the shards a safetensors index lists, else one
# `model.safetensors`, else every safetensors file, else PyTorch's `.bin` files. A repository
# that also holds its weights in another form (Mistral's `consolidated.safetensors`) is not
# fetched twice.
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FALLBACKS = (["*.safetensors"], ["*.bin"])


def is_hub_id(name: str | None) -> bool:
    """Whether `--model` names a hub repository (`org/name` or `name`), not a local folder or
    file, nor a GGUF file's `REPO:QUANT`."""
    if name is None or Path(name).expanduser().exists():
        return False
    return ":" not in name and not name.lower().endswith(".gguf") and name.count("/") <= 1


def fetched(config: EngineConfig) -> EngineConfig:
    """`config` with its hub model and tokenizer as local folders, fetched as the flags ask
    (`--hf-overrides` too: the overlay of a config needs the folder it overlays); unchanged
    where no flag asks or the model is not a hub id."""
    wanted = (config.revision, config.tokenizer_revision, config.download_dir, config.hf_token)
    if not any(value is not None for value in wanted) and not config.hf_overrides:
        return config
    model, name, tokenizer = config.model, config.model_name, config.tokenizer
    if model is not None and is_hub_id(model):
        name = name or model
        model = str(snapshot(model, config.revision, MODEL_FILES, config, weights=True))
    source = config.tokenizer or (config.model if config.tokenizer_revision else None)
    if source is not None and is_hub_id(source):
        tokenizer = str(
            snapshot(source, config.tokenizer_revision, TOKENIZER_FILES, config, weights=False)
        )
    return dataclasses.replace(config, model=model, model_name=name, tokenizer=tokenizer)


def snapshot(
    repo: str, revision: str | None, patterns: list[str], config: EngineConfig, weights: bool
) -> Path:
    """The repository's files at `revision` in the Hugging Face cache (`--download-dir`'s):
    those `patterns` match, and with `weights` the model's weights in one form (`FALLBACKS`);
    none that `--ignore-patterns` match."""
    folder = _download(repo, revision, patterns, config)
    if weights:
        folder = _weights(repo, revision, config, _indexed_shards(folder))
    logger.info("%s%s fetched into %s", repo, f" ({revision})" if revision else "", folder)
    return folder


def _weights(repo: str, revision: str | None, config: EngineConfig, shards: list[str]) -> Path:
    """The repository's weights in the first form it has them in (`FALLBACKS`)."""
    if shards:
        return _download(repo, revision, shards, config)
    folder = _download(repo, revision, [SINGLE], config)
    if (folder / SINGLE).is_file():
        return folder
    for fallback in FALLBACKS:
        folder = _download(repo, revision, fallback, config)
        if any(folder.glob(fallback[0])):
            break
    return folder


def _indexed_shards(folder: Path) -> list[str]:
    """The shards the folder's safetensors index lists (none where it has no readable one)."""
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _download(repo: str, revision: str | None, patterns: list[str], config: EngineConfig) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo,
            revision=revision,
            cache_dir=config.download_dir,
            token=config.hf_token,
            allow_patterns=patterns,
            ignore_patterns=list(config.ignore_patterns) or None,
        )
    except (OSError, ValueError) as exc:
        at = f" at revision {revision}" if revision else ""
        raise ValueError(f"cannot fetch {repo}{at}: {exc}") from exc
    return Path(folder)
