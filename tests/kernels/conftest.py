"""What the kernel tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _split(split_threads: int) -> None:
    """Every kernel test runs on two threads or more (`split_threads`)."""
