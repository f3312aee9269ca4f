"""What the engine-loop tests share."""

from __future__ import annotations

import pytest

from engine.core.async_engine import AsyncEngine
from tests.helpers import tiny_core


@pytest.fixture
async def engine(tiny_model):
    """A running engine loop around the tiny model (modules that need another define their
    own)."""
    engine = AsyncEngine(*tiny_core(tiny_model))
    await engine.start()
    yield engine
    await engine.shutdown()
