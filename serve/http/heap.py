"""Giving the memory of large request bodies back to the system.

glibc raises its mmap threshold each time a large block is freed (up to
32 MB), so the next large blocks come from the arena of the thread that
parsed them (one per connection thread, up to eight per core), and a
non-main arena's top is never returned, not even by malloc_trim. Sixteen
10 MB bodies left 300 MB resident for good. So the threshold is fixed: a
block of a megabyte or more is its own mapping, unmapped when freed; and
after a large body `malloc_trim(0)` returns the free pages left between the
smaller blocks of every arena. Before the trim, a collection: an error a job
keeps is re-raised by each of its readers, and its traceback then holds their
frames (the body among them) in a cycle through the job, which only the cycle
collector frees.

Other C libraries (musl, macOS) have neither call: there this does nothing.
"""
from __future__ import annotations

import ctypes
import gc
from typing import Optional

M_MMAP_THRESHOLD = -3        # mallopt's parameter number, from glibc's malloc.h
MMAP_THRESHOLD = 1 << 20     # blocks this large get their own mapping
TRIM_AFTER_BYTES = 1 << 20   # bodies this large are followed by a trim, once the reply has gone


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)   # the process's own C library
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def map_large_blocks() -> None:
    """Fix the mmap threshold, so that large blocks go back to the system when freed."""
    if _LIBC is not None:
        _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def give_back() -> None:
    """Free what cycles hold, then return the free pages between the C heap's blocks to the
    system."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
