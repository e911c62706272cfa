"""Host memory of a training process: glibc's heap reused within a phase, returned between phases.

PyTorch's CPU tensors are allocated with glibc's malloc. glibc serves a request of at least
its mmap threshold with a fresh mapping, returned to the system when freed, and smaller ones
from its heaps (arenas), which keep freed memory for reuse. Two costs pull apart:

- A fresh mapping costs a page fault per 4 KiB page on first touch (and the kernel's zeroing).
  With the threshold at 256 KiB, every activation, attention temporary and gradient of the
  update was mapped and unmapped: about 8 million page faults per CPU-preset update, a third
  of its time (`python bench/profile_update.py`, docs/performance.md).
- The threshold is dynamic by default: freeing a mapped block raises it to that block's size
  (up to 32 MiB), so what a process serves from its heaps depends on what it freed before, and
  the heaps keep what one phase frees (the update's activations) beside what the next one
  allocates (the rollout's KV buffers, the evaluation's).

`fix_mmap_threshold` fixes the threshold at 32 MiB (glibc's largest; fixing it also turns the
adjustment off): requests under it come from the heaps and are reused within a phase, mostly
without new page faults; `release_free_memory` (malloc_trim) hands back what the heaps hold free at
the end of each phase (rollout, evaluation, each mini-batch's forward and backward, update),
so that one phase's freed memory does not stay resident through the next. The rollout
engine's KV pools, which grow as tokens arrive, and the evaluation, whose heap would fragment
most, keep their own mappings (`mapped_allocations`). The price is fragmentation: the
update's peak is about 0.7 GiB higher than with every tensor mapped (docs/performance.md,
memory of the main job). None of this changes any computed value. All of it is a no-op (returning False) where the C library is not glibc.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: mallopt's parameter number for the mmap threshold (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3
#: Requests of at least this many bytes get their own mapping: 32 MiB, glibc's largest (a
#: [16384, 512] fp32 tensor); everything smaller is served and reused from the heaps.
HEAP_MMAP_THRESHOLD = 32 * 2**20
#: Inside `mapped_allocations`: requests of at least 256 KiB get their own mapping.
MAPPED_THRESHOLD = 256 * 1024
#: The threshold in force: None until `fix_mmap_threshold` sets one in this process, then
#: that one, or MAPPED_THRESHOLD inside `mapped_allocations`.
_current_threshold = None


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


def fix_mmap_threshold(threshold: int = HEAP_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (default `HEAP_MMAP_THRESHOLD`) for this
    process: allocations of at least that size are mapped on their own and unmapped when
    freed, smaller ones come from the heaps, whatever was freed before (the module docstring
    says why; pair it with `release_free_memory` at the end of each phase). Affects
    allocations made afterwards. Returns True when set, False where the C library is not
    glibc. Raises ValueError for a threshold outside 0..32 MiB (glibc's own bound)."""
    if not 0 <= threshold <= 32 * 2**20:
        raise ValueError(f"mmap threshold must be within 0..{32 * 2**20} bytes, got {threshold}")
    global _current_threshold
    libc = _libc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)):
        return False
    _current_threshold = int(threshold)
    return True


@contextlib.contextmanager
def mapped_allocations():
    """Within the block, allocations of at least `MAPPED_THRESHOLD` bytes get their own
    mapping, which goes back to the system the moment it is freed, whenever that is; the
    threshold in force before is restored after (blocks nest). For buffers that outlive a
    phase and are replaced by larger ones (the rollout engine's KV pools, reallocated with
    more blocks as tokens arrive: in the heaps each larger set would leave the previous one's
    memory behind as holes until the phase's end), and for the evaluation, whose 64-row
    batches fragment the heaps by about 0.9 GiB at the CPU preset (its peak is the main
    job's). A no-op unless `fix_mmap_threshold` set a threshold in this process (glibc's
    dynamic threshold cannot be restored once changed)."""
    global _current_threshold
    libc = _libc() if _current_threshold is not None else None
    if libc is None:
        yield
        return
    before = _current_threshold
    libc.mallopt(_M_MMAP_THRESHOLD, MAPPED_THRESHOLD)
    _current_threshold = MAPPED_THRESHOLD
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, before)
        _current_threshold = before


def release_free_memory() -> bool:
    """Return the free memory glibc's heaps hold to the system (malloc_trim(0)): call after a
    phase that freed much (an update's activations, a rollout's KV buffers). Returns whether
    any memory was released; False where the C library is not glibc."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def held_state_mib(modules, optimizers) -> tuple[float, float]:
    """(parameters, optimizer state) this process holds, in MiB: each parameter's local storage
    (a DTensor's own shard, not the whole tensor; a tied weight once; None modules skipped)
    and every tensor in the optimizers' states."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    seen, params = set(), 0
    for m in modules:
        for p in (m.parameters() if m is not None else ()):
            if id(p) not in seen:
                seen.add(id(p))
                x = local(p)
                params += x.numel() * x.element_size()
    state = 0
    for opt in optimizers:
        for s in opt.state.values():
            for v in s.values():
                if torch.is_tensor(v):
                    x = local(v)
                    state += x.numel() * x.element_size()
    return params / 2**20, state / 2**20


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory in MiB: CUDA's peak allocated bytes on `device`, else the
    process's peak resident set size (Linux ru_maxrss)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
