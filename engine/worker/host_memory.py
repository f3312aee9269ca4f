"""What memory the host has left for this process: `MemAvailable`, and where the process runs in
a cgroup with a memory limit (a container), what the limit leaves. A CPU KV cache's pages become
resident as its blocks are first written, so a budget beyond this is not refused at start-up
but fails later, under load; the start-up warns instead."""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
CGROUPS = Path("/sys/fs/cgroup")
OWN_CGROUP = Path("/proc/self/cgroup")


def available_bytes(
    meminfo: Path = MEMINFO, cgroups: Path = CGROUPS, own: Path = OWN_CGROUP
) -> int | None:
    """Bytes this process may still take (None where the host does not say: not Linux)."""
    try:
        found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
    except OSError:
        return None
    if found is None:
        return None
    available = int(found.group(1)) * 1024
    left = _cgroup_left(cgroups, own)
    return available if left is None else min(available, left)


def _cgroup_left(cgroups: Path, own: Path) -> int | None:
    """What this process's cgroup's memory limit leaves, None without a limit: cgroup v2 (the
    `0::` line of /proc/self/cgroup names the group, `memory.max`) or v1 (the `memory` line,
    `memory.limit_in_bytes`, a huge number where unlimited)."""
    try:
        text = own.read_text()
    except OSError:
        return None
    v1 = re.search(r"^\d+:memory:(/.*)$", text, re.MULTILINE)
    v2 = re.search(r"^0::(/.*)$", text, re.MULTILINE)
    if v1 is not None:
        group = cgroups / "memory" / v1.group(1).lstrip("/")
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    elif v2 is not None:
        group = cgroups / v2.group(1).lstrip("/")
        files = ("memory.max", "memory.current")
    else:
        return None
    try:
        limit = (group / files[0]).read_text().strip()
        used = int((group / files[1]).read_text())
        if limit == "max" or int(limit) >= 2**60:
            return None
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def warn_if_beyond(kv_bytes: int, available: int | None, ranks: int = 1) -> bool:
    """Warn where a CPU KV cache of `kv_bytes` on each of `ranks` ranks (the tensor-parallel
    ranks on one host) is more than the memory `available`; returns whether it warned."""
    total = kv_bytes * ranks
    if available is None or total <= available:
        return False
    caches = "the KV cache takes" if ranks == 1 else f"the KV caches of {ranks} ranks take"
    logger.warning(
        "%s %.1f GiB, more than the %.1f GiB of memory left: requests may fail for memory once "
        "its blocks fill; lower --kv-cache-memory",
        caches,
        total / 2**30,
        available / 2**30,
    )
    return True
