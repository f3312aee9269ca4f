"""The memory left for a CPU KV cache, read from /proc/meminfo and the process's cgroup (v1 or
v2), and the start-up's warning where the cache's budget is more than that."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.worker import host_memory
from tests.helpers import tiny_core

GIB = 2**30
MEMINFO = "MemTotal:       24683772 kB\nMemFree:         1000000 kB\nMemAvailable:    8388608 kB\n"


def host(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[Path, Path, Path]:
    """A fake /proc/meminfo (8 GiB available), /proc/self/cgroup and cgroup tree."""
    meminfo, own, cgroups = tmp_path / "meminfo", tmp_path / "cgroup", tmp_path / "fs"
    meminfo.write_text(MEMINFO)
    own.write_text(cgroup)
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(text)
    return meminfo, cgroups, own


def test_without_a_limit_the_host_s_available_memory(tmp_path):
    meminfo, cgroups, own = host(tmp_path, "0::/\n", {})
    assert host_memory.available_bytes(meminfo, cgroups, own) == 8 * GIB


def test_a_cgroup_v2_limit_leaves_its_limit_less_its_use(tmp_path):
    files = {"app/memory.max": str(3 * GIB), "app/memory.current": str(GIB)}
    meminfo, cgroups, own = host(tmp_path, "0::/app\n", files)
    assert host_memory.available_bytes(meminfo, cgroups, own) == 2 * GIB
    (cgroups / "app/memory.max").write_text("max\n")
    assert host_memory.available_bytes(meminfo, cgroups, own) == 8 * GIB


def test_a_cgroup_v1_limit_and_its_unlimited_huge_number(tmp_path):
    files = {
        "memory/box/memory.limit_in_bytes": str(5 * GIB),
        "memory/box/memory.usage_in_bytes": str(GIB),
    }
    meminfo, cgroups, own = host(tmp_path, "4:memory:/box\n0::/\n", files)
    assert host_memory.available_bytes(meminfo, cgroups, own) == 4 * GIB
    (cgroups / "memory/box/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_memory.available_bytes(meminfo, cgroups, own) == 8 * GIB


def test_no_meminfo_says_nothing(tmp_path):
    assert host_memory.available_bytes(tmp_path / "absent") is None


def test_a_cpu_cache_beyond_the_memory_left_is_served_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1 << 20)
    with caplog.at_level(logging.WARNING, logger="engine.worker.host_memory"):
        core, _ = tiny_core(num_blocks=None, kv_cache_memory=4 << 20)
    assert core.runner.kv_cache.num_bytes > 1 << 20
    assert "more than the" in caplog.text and "GiB of memory left" in caplog.text
    assert "--kv-cache-memory" in caplog.text
    caplog.clear()
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1 << 30)
    with caplog.at_level(logging.WARNING, logger="engine.worker.host_memory"):
        tiny_core(num_blocks=None, kv_cache_memory=4 << 20)
    assert caplog.text == ""


def test_tensor_parallel_ranks_on_one_host_weigh_their_caches_together(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.worker.host_memory"):
        assert not host_memory.warn_if_beyond(3 * GIB, 4 * GIB)
        assert host_memory.warn_if_beyond(3 * GIB, 4 * GIB, ranks=2)
    assert "the KV caches of 2 ranks take 6.0 GiB, more than the 4.0 GiB" in caplog.text
