"""Log output: the plain lines by default, or (`--log-format json`) one JSON object per line for
every record, uvicorn's included; a record's `fields` (a request's ids, outcome, token counts
and timings) become keys of its object, or `key=value` pairs after a plain line's message
(unless the record says its message holds them: `fields_in_message`)."""

from __future__ import annotations

import json
import logging
import logging.config
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("plain", "json")


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if not fields or getattr(record, "fields_in_message", False):
            return line
        return line + " " + " ".join(f"{key}={json.dumps(value)}" for key, value in fields.items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(
    level: str, log_format: str, uvicorn_level: str | None = None
) -> dict[str, Any] | None:
    """Set up the root logger; return the logging configuration uvicorn should apply (None:
    its own), its own loggers at `uvicorn_level` (default: `level`)."""
    if log_format == "plain":
        plain = logging.StreamHandler()
        plain.setFormatter(PlainFormatter(PLAIN))
        logging.basicConfig(level=level.upper(), handlers=[plain])
        return None
    uvicorn_level = uvicorn_level or level
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": {"class": "logging.StreamHandler", "formatter": "json"}},
        "loggers": {
            name: {"handlers": ["json"], "level": uvicorn_level.upper(), "propagate": False}
            for name in ("uvicorn", "uvicorn.access")
        },
    }


def apply_config_file(path: Path) -> dict[str, Any]:
    """`--log-config-file`: a `logging.config.dictConfig` dictionary as JSON, applied to every
    logger (Conveyor's and uvicorn's, which it is returned for), as vLLM's flag applies it."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the log config file {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"the log config file {path} must hold a JSON object")
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError) as exc:
        raise ValueError(f"the log config file {path} does not configure logging: {exc}") from exc
    return config


class QuietPaths(logging.Filter):
    """Drops uvicorn's access lines for requests to `paths` (`--disable-access-log-for-endpoints`),
    whatever their query string, under the app's root path too."""

    def __init__(self, paths: tuple[str, ...], root_path: str = "") -> None:
        super().__init__()
        self.paths = frozenset(paths) | frozenset(root_path + path for path in paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access line: client, method, path with query, HTTP version, status.
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in self.paths
        return True


def quiet_access_log(paths: tuple[str, ...], root_path: str = "") -> None:
    """Keep uvicorn's access log from these paths (replacing any earlier such choice)."""
    access = logging.getLogger("uvicorn.access")
    for earlier in [f for f in access.filters if isinstance(f, QuietPaths)]:
        access.removeFilter(earlier)
    if paths:
        access.addFilter(QuietPaths(paths, root_path))
