"""Whether a Triton kernel is usable where the server would launch it: Triton builds a small
launcher with the machine's C compiler on first use, which a bare runtime image lacks, and a
Triton or driver version may reject a kernel. Each kernel family runs a small known case at
start-up and falls back to torch, with one warning, where it fails."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def passes(check: Callable[[], None], kernels: str, device: str, instead: str) -> bool:
    """Run `check` (it raises where the kernels fail or answer wrongly); on failure log
    `kernels` unusable on `device`, the error's first line and what runs `instead`."""
    try:
        check()
    except Exception as error:  # no compiler, no driver support, a broken install
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        logger.warning("%s unusable on %s (%s); %s", kernels, device, message, instead)
        return False
    return True
