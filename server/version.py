"""The installed package's version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def conveyor_version() -> str:
    try:
        return version("conveyor")
    except PackageNotFoundError:
        return "0.0.0+local"
