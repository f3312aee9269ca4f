"""Checkpoints converted once into Conveyor's cache (a GGUF file, an AWQ or GPTQ checkpoint):
staged in a scratch folder beside the target, moved into place whole, and marked finished by a
file written last, so that a start stopped halfway converts again and two starts at once do not
see each other's half-written files."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def source_key(paths: Iterable[Path]) -> str:
    """A short key of where the files at `paths` are, their sizes and modification times: an
    edited or replaced file gets another key, so its conversion runs again."""
    parts = []
    for path in paths:
        stat = path.stat()
        parts.append(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}")
    return hashlib.sha256("\0\0".join(parts).encode()).hexdigest()[:16]


def convert_once(target: Path, marker: str, convert: Callable[[Path], dict[str, Any]]) -> Path:
    """`target`, a folder `convert(folder)` fills, converted on first use; `convert`'s answer is
    kept in the file `marker`, written last, which says the conversion finished."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as scratch:
        staged = Path(scratch) / "converted"
        record = convert(staged)
        (staged / marker).write_text(json.dumps(record) + "\n")
        if not (target / marker).is_file():  # another process may have finished first
            shutil.rmtree(target, ignore_errors=True)
            staged.rename(target)
    return target
