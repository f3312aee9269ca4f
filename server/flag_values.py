"""Values of command-line flags that more than one module reads."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (`--hf-overrides`, vLLM's JSON configs)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def at_least(least: int) -> Callable[[str], int]:
    """An integer flag of `least` or more."""

    def parse(text: str) -> int:
        value = integer(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, not {value}")
        return value

    return parse


# vLLM's suffixes of a count: lower case in powers of 1000, upper case in powers of 1024.
_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_COUNT_SUFFIXES |= {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def count(text: str) -> int:
    """A count as vLLM reads one (`--max-num-batched-tokens`, `--kv-cache-memory-bytes`): a
    plain integer, or a number with a suffix, `32k` 32,000 and `32K` 32,768; `2.5k` is
    2,500, and a fraction of an upper-case suffix is refused."""
    text = text.strip()
    suffix = text[-1:]
    if suffix not in _COUNT_SUFFIXES:
        return integer(text)
    number, scale = text[:-1], _COUNT_SUFFIXES[suffix]
    if suffix.isupper() and not number.isdigit():
        raise argparse.ArgumentTypeError(
            f"not a count: {text!r} (a {suffix} count is a whole number; "
            f"{number}{suffix.lower()} counts in thousands)"
        )
    if not re.fullmatch(r"\d+(\.\d+)?", number):
        raise argparse.ArgumentTypeError(f"not a count: {text!r}")
    return int(float(number) * scale) if "." in number else int(number) * scale


def context_length(text: str) -> int | None:
    """`--max-model-len`: a count, or `auto` / `-1` for the model's context where the KV cache
    holds it and as much as it holds where not (as with no flag)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return count(text)


# `--dtype`'s names, vLLM's aliases (`half`, `float`) with them.
DTYPES = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
}


def dtype(text: str) -> str:
    """`--dtype`: its name for the dtype, or one of vLLM's aliases of it."""
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"not a dtype: {text!r} (one of {', '.join(DTYPES)})")
    return DTYPES[text]
