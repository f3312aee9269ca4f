"""The fields of a config given as a JSON object (vLLM's `--kv-events-config`,
`--profiler-config`, ...), checked against what each field takes before the config is built."""

from __future__ import annotations

from typing import Any


def check_fields(fields: dict[str, Any], kinds: dict[str, tuple[type, ...]], what: str) -> None:
    """A `ValueError` naming the first field of `fields` not in `kinds`, or whose value is not
    of its kinds (an integer field takes no bool); `what` names the config in the message."""
    unknown = sorted(set(fields) - set(kinds))
    if unknown:
        raise ValueError(f"unknown {what} config fields: {', '.join(unknown)}")
    for name, value in fields.items():
        integer = kinds[name] == (int,)
        if not isinstance(value, kinds[name]) or (integer and isinstance(value, bool)):
            kind = "an integer" if integer else kinds[name][0].__name__
            raise ValueError(f"{what} config field {name} must be {kind}")
