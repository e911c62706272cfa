"""Host memory of a training process: glibc's heap kept from hoarding freed tensors.

PyTorch's CPU tensors are allocated with glibc's malloc. By default glibc serves a request
of at least its mmap threshold (128 KiB at start) with a fresh mapping, returned to the
system when freed, and smaller ones from its heaps (arenas), which keep freed memory for
reuse. The threshold is dynamic: freeing a mapped block raises it to that block's size, up
to 32 MiB. After the first megabyte-sized tensor is freed, every activation, KV buffer
and temporary under 32 MiB (all of them, at the CPU preset's shapes) lands in the heaps,
and what one phase of an iteration frees (the update's activations) stays resident beside
what the next one allocates (the rollout's KV buffers, the evaluation's): the process's
resident set grows towards the sum of the phases' peaks instead of the largest one.

`bound_heap` fixes the threshold (which also turns its adjustment off), so that tensors of
at least `HEAP_MMAP_THRESHOLD` bytes go back to the system when freed; `release_free_memory`
(malloc_trim) hands back what the heaps hold free, between phases. Neither changes any
computed value. Both are no-ops (returning False) where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: mallopt's parameter number for the mmap threshold (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3
#: Requests of at least this many bytes get their own mapping (256 KiB: a [64, 1024] fp32 tensor).
HEAP_MMAP_THRESHOLD = 256 * 1024

@functools.lru_cache(maxsize=1)
def _libc():
    """glibc (ctypes.CDLL), or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018 - glibc's, absent from musl and macOS
        libc.malloc_trim  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


def bound_heap(threshold: int = HEAP_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (default `HEAP_MMAP_THRESHOLD`) for this
    process: every allocation of at least that size is mapped on its own and unmapped when
    freed, whatever was freed before (the module docstring says why). Affects allocations
    made afterwards. Returns True when set, False where the C library is not glibc.
    Raises ValueError for a threshold outside 0..32 MiB (glibc's own bound)."""
    if not 0 <= threshold <= 32 * 2**20:
        raise ValueError(f"mmap threshold must be within 0..{32 * 2**20} bytes, got {threshold}")
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def release_free_memory() -> bool:
    """Return the free memory glibc's heaps hold to the system (malloc_trim(0)): call after a
    phase that freed much (an update's activations, a rollout's KV buffers). Returns whether
    any memory was released; False where the C library is not glibc."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))
