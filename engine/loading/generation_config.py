"""The sampling defaults a model's creators recommend in its `generation_config.json`, applied
as vLLM applies them (`--generation-config auto`): a request that leaves out temperature, top_p,
top_k, min_p, repetition_penalty or max_tokens takes the model's value, where the file sets one,
before OpenAI's default. `vllm` keeps OpenAI's defaults alone; a folder reads its own file.
`--override-generation-config` sets fields on top, in the file's names (`max_new_tokens`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from transformers import GenerationConfig

# The file's names of the fields a request can leave out, and the request's names for them.
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# What each default may be: (lowest, highest, whether the lowest itself is allowed).
_RANGES = {
    "temperature": (0.0, math.inf, True),
    "top_p": (0.0, 1.0, False),
    "top_k": (-1, math.inf, True),
    "min_p": (0.0, 1.0, True),
    "repetition_penalty": (0.0, math.inf, False),
    "max_tokens": (1, math.inf, True),
}


def sampling_defaults(
    source: str, model: Any, overrides: Mapping[str, Any] | None = None
) -> dict[str, float]:
    """The request defaults `source` gives (`auto`: the loaded `model`'s own generation config;
    `vllm`: none; else a folder holding a generation_config.json), with `overrides` on top."""
    if source == "vllm":
        config: dict[str, Any] = {}
    elif source == "auto":
        generation = getattr(model, "generation_config", None)
        config = generation.to_diff_dict() if generation is not None else {}
    else:
        try:
            config = GenerationConfig.from_pretrained(source).to_diff_dict()
        except OSError as exc:
            raise ValueError(f"--generation-config {source!r}: {exc}") from None
    config = {**config, **(overrides or {})}
    unknown = sorted(set(overrides or {}) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"--override-generation-config sets {', '.join(unknown)}; it takes {', '.join(FIELDS)}"
        )
    defaults = {FIELDS[key]: value for key, value in config.items() if key in FIELDS}
    return {name: _checked(name, value) for name, value in defaults.items() if value is not None}


def _checked(name: str, value: Any) -> float:
    low, high, low_allowed = _RANGES[name]
    whole = name in ("top_k", "max_tokens")
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (whole and value != int(value)):
        raise ValueError(f"the generation config's {name} is not a number: {value!r}")
    if not (low < value <= high or (low_allowed and value == low)):
        raise ValueError(f"the generation config's {name} of {value} is out of range")
    return int(value) if whole else float(value)
