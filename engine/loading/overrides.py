"""vLLM's `--hf-overrides`: the model's config with some of its fields replaced, such as a longer
context by YaRN (`{"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}`).

The checkpoint folder (a GGUF file's or a quantized checkpoint's conversion, a hub model's
snapshot) is overlaid once in Conveyor's cache: every file linked to the original, the config
written with the overrides merged in (a nested object merges into the nested config, as an
image-text model's `text_config`). Every later read takes the overlay, so that the weights, the
shares under tensor parallelism and the context length all see the same config; replies name
the model as `--model` gave it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from engine.core.config import EngineConfig
from engine.core.paths import cache_dir
from engine.loading.conversions import convert_once

logger = logging.getLogger(__name__)

SOURCE_FILE = "conveyor-overrides.json"


def overridden(config: EngineConfig) -> EngineConfig:
    """`config` whose model is the overlay of its checkpoint with `hf_overrides`; unchanged
    without overrides. A hub model was fetched to a folder first (`hub.fetched`)."""
    if not config.hf_overrides:
        return config
    from engine.loading.model_loader import checkpoint_path

    folder = Path(checkpoint_path(config.model)).resolve()
    if not (folder / "config.json").is_file():
        raise ValueError(f"--hf-overrides: {folder} has no config.json to override")
    overlay = overlay_folder(folder, config.hf_overrides)
    name = config.model_name or config.model
    return dataclasses.replace(config, model=str(overlay), model_name=name)


def overlay_folder(folder: Path, overrides: dict[str, Any]) -> Path:
    """The overlay of `folder` with `overrides` in the config, made on first use."""
    key = hashlib.sha256(json.dumps([str(folder), overrides], sort_keys=True).encode()).hexdigest()[
        :16
    ]
    target = cache_dir() / "models" / "overridden" / f"{folder.name}-{key}"

    def write(staged: Path) -> dict[str, object]:
        staged.mkdir(parents=True)
        for path in folder.iterdir():
            if path.name not in ("config.json", SOURCE_FILE):
                (staged / path.name).symlink_to(path)
        config = json.loads((folder / "config.json").read_text())
        (staged / "config.json").write_text(json.dumps(merged(config, overrides), indent=2))
        logger.info("%s overlaid with --hf-overrides %s", folder, json.dumps(overrides))
        return {"source": str(folder), "overrides": overrides}

    return convert_once(target, SOURCE_FILE, write)


def merged(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`config` with `overrides` in: an object into an object field merges, anything else
    replaces."""
    result = dict(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result
