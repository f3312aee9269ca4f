"""glibc's malloc keeps freed memory: allocations a step frees are reused by the next without
faulting pages in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from engine.kernels.cpu import malloc_tuning

# Tensors of 1 to 24 MiB, allocated, written and freed in turn, twice over: the minor page
# faults of the second round.
SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from engine.kernels.cpu import malloc_tuning
    if sys.argv[1] == "keep":
        assert malloc_tuning.keep_freed_memory()
    def one_round():
        for mib in range(1, 25):
            torch.empty(mib << 18).fill_(1.0)
    one_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    one_round()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def second_round_faults(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True
    )
    return int(result.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
def test_freed_memory_is_reused_without_page_faults() -> None:
    default = second_round_faults("default")
    kept = second_round_faults("keep")
    assert default > 100, "glibc's default should fault freed large allocations in again"
    assert kept * 4 < default


def test_keep_freed_memory_declines_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(malloc_tuning.ctypes, "CDLL", no_libc)
    assert malloc_tuning.keep_freed_memory() is False
