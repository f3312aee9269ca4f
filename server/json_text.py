"""JSON text from outside (a client's field, a model's output) read with its nesting held to a
depth that Python's own reading and writing of it can reach: text nested deeper raises the
`ValueError` any other text that is not JSON raises, never a `RecursionError`."""

from __future__ import annotations

import json
import re
from typing import Any

# Deeper than any schema, arguments or call list has reason to be, and far within what the
# interpreter's recursion limit lets `json` read and write back.
MAX_DEPTH = 256

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def loads(text: str | bytes) -> Any:
    """`json.loads(text)`, for text nested no deeper than `MAX_DEPTH`."""
    if isinstance(text, bytes):
        text = text.decode()
    check_depth(text)
    return json.loads(text)


def check_depth(text: str) -> None:
    """Raise `ValueError` where `text` opens more than `MAX_DEPTH` arrays and objects at once
    (brackets inside strings do not count)."""
    depth = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
