"""Plugin files of a deployment's own parsers (`--tool-parser-plugin`,
`--reasoning-parser-plugin`): a Python file imported by path, as vLLM's flags import theirs,
that registers parsers by name in a table; the parser flag then names one of Conveyor's or of
the plugin's. A file that is missing or fails to import, a name of Conveyor's own, and a parser
flag that names no parser stop the start with the reason."""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class PluginParsers:
    """The `kind` parsers plugin files add to `table` (beside Conveyor's `own` names), read by
    `plugin_flag`'s file and chosen by `parser_flag`."""

    def __init__(
        self,
        kind: str,
        plugin_flag: str,
        parser_flag: str,
        own: Collection[str],
        table: Mapping[str, Any],
    ) -> None:
        self.kind = kind
        self.plugin_flag = plugin_flag
        self.parser_flag = parser_flag
        self.own = own
        self.table = table
        self.registered: list[str] = []  # every name a plugin has registered, in order

    def claim(self, name: str) -> None:
        """Take `name` for a plugin's parser (Conveyor's own names are refused)."""
        if name in self.own:
            raise ValueError(f"{self.kind} {name!r} is one of Conveyor's own: choose another name")
        self.registered.append(name)

    def load(self, path: Path) -> list[str]:
        """Import the file at `path`; the parsers it registered, by name."""
        before = len(self.registered)
        import_file(path, self.plugin_flag)
        return self.registered[before:]

    def check(self, name: str | None) -> None:
        """Refuse a parser flag that neither Conveyor nor a loaded plugin names."""
        if name is not None and name not in self.own and name not in self.table:
            known = ", ".join(sorted({*self.own, *self.table}))
            raise ValueError(f"{self.parser_flag} {name!r} is not one of {known}")

    def chosen(self, path: Path | None, name: str | None) -> str | None:
        """The parser flag's `name`, once the plugin file at `path` (if any) has registered
        its parsers."""
        if path is not None:
            names = self.load(path)
            logger.info("%ss from %s: %s", self.kind, path, ", ".join(names) or "none")
        self.check(name)
        return name


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
