"""Values of command-line flags that more than one module reads."""

from __future__ import annotations

import argparse
import json
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
