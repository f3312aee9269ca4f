"""Importing a deployment's plugin file (`--tool-parser-plugin`, `--reasoning-parser-plugin`):
a Python file by path, as vLLM's flags import theirs. What it registers is the importing
module's to read; a file that is missing or fails to import stops the start with the reason."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def import_file(path: Path, flag: str) -> None:
    """Run the Python file at `path` as a module of its own (named after the file)."""
    if not path.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    module_name = f"conveyor_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag} {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"{flag} {path}: {type(exc).__name__}: {exc}") from exc
