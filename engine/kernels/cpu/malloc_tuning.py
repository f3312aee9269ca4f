"""glibc's malloc told to keep freed memory for reuse, for a CPU engine.

A CPU step allocates its activations, logits and kernel scratch afresh (tensors of hundreds of
KiB to tens of MiB) and frees them at its end. By default glibc maps each allocation of more
than 128 KiB (a bound it raises as it goes, up to 32 MiB) straight from the kernel and hands it
back on free, and trims the heap's free top past a bound; the next step's allocations fault
the same memory in again, a page at a time, zeroed by the kernel: about 3,300 pages (13 MiB) a
2048-token prefill step of the default model. With the mapping bound at its maximum and
trimming off, the heap keeps that memory and steps reuse it: a handful of faults in a whole
run of 64 requests. This is what vLLM's CPU image gets from tcmalloc.

Loading is the other way round: each weight is read, repacked into panels and moved into huge
pages, and every copy left behind is freed into the heap, where glibc keeps it. Handed back
to the kernel as the loader goes (`FreedMemory`) and once more when the model is built, a bf16
model's start-up peaks at about its weights plus its checkpoint's pages, not twice that, and
the server stays resident at about its weights.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mapping bound on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD = 32 * 1024 * 1024
# The heap's free top is handed back only past this much.
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's malloc to serve allocations up to 32 MiB from its heap and keep the heap's
    free memory; False where the C library is not glibc (nothing changes)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    kept = (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
    if kept:
        logger.info(
            "malloc keeps freed memory (mmap threshold %d MiB, trim threshold %d MiB)",
            MMAP_THRESHOLD >> 20,
            TRIM_THRESHOLD >> 20,
        )
    return kept


def give_back_freed_memory() -> bool:
    """Hand the heap's free memory back to the kernel now (glibc's `malloc_trim`), as sleep
    mode does after freeing the weights; False where the C library is not glibc."""
    try:
        malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    malloc_trim(0)
    return True


# While weights are repacked or moved, what they were copied from goes back to the kernel after
# about this many bytes (a 1.3B bf16 model's start-up: 30 `malloc_trim` calls, 60 ms in all).
GIVE_BACK_EVERY = 64 * 1024 * 1024


class FreedMemory:
    """Counts the bytes of copies a loop frees (the weights it repacks or moves) and hands
    glibc's free memory back to the kernel each time about `GIVE_BACK_EVERY` bytes were freed:
    the loop then holds the weights about once, not twice."""

    def __init__(self) -> None:
        self.pending = 0

    def freed(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= GIVE_BACK_EVERY:
            give_back_freed_memory()
            self.pending = 0
