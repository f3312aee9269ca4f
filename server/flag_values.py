"""Values of command-line flags that more than one module reads."""

from __future__ import annotations

import argparse
import json
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


def at_least(least: int) -> Callable[[str], int]:
    """An integer flag of `least` or more."""

    def parse(text: str) -> int:
        value = integer(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be {least} or more, not {value}")
        return value

    return parse
