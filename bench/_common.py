"""Shared pieces of the benchmarks: timing, peak memory, records.

Every comparison is one `Record`: fastpo's figure and the baseline's, measured in the same
run, and their ratio expressed so that > 1 always means fastpo is better.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from typing import Any, Callable


@dataclasses.dataclass
class BenchContext:
    """What every part's `run(ctx)` receives from `bench/throughput.py`."""

    quick: bool = False
    device: str = "cpu"
    model: str = "smollm2-135m-instruct"
    repeats: int = 3
    repeats_given: bool = False  # --repeats was passed (parts with minutes-long figures default to 1)
    seed: int = 0
    parts: tuple = ()  # every part this run measures (a part may skip what another one covers)
    skipped: dict = dataclasses.field(default_factory=dict)  # "part: what" -> one-line reason, written to the JSON


class PartSkipped(Exception):
    """Raised by a part's `run(ctx)` that cannot measure anything here (e.g. an optional
    benchmark dependency is missing); the message is the one-line reason."""


@dataclasses.dataclass
class Record:
    """One side-by-side comparison.

    `higher_is_better` tells how `ratio` is formed: fastpo/baseline for rates (tokens/s),
    baseline/fastpo for costs (seconds, bytes), so that ratio > 1 means fastpo wins.
    `target` is the ratio the issue asks for (None where it sets none).
    """

    part: str
    name: str
    unit: str
    fastpo: float
    baseline: float | None
    higher_is_better: bool
    fastpo_spread: float = 0.0
    baseline_spread: float = 0.0
    baseline_name: str = ""
    target: float | None = None
    notes: str = ""
    ratio: float | None = None
    met: bool | None = None

    def __post_init__(self) -> None:
        if self.ratio is None and self.baseline not in (None, 0) and self.fastpo:
            self.ratio = (self.fastpo / self.baseline) if self.higher_is_better else (self.baseline / self.fastpo)
        if self.met is None and self.target is not None and self.ratio is not None:
            self.met = self.ratio >= self.target

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def timings(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1,
            sync: Callable[[], None] | None = None) -> list[float]:
    """Run `fn` `warmup` times untimed, then `repeats` times; returns the timed runs' seconds.
    `sync` (e.g. torch.cuda.synchronize) is called before each clock read. Raises ValueError
    for repeats < 1."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def measure(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, sync: Callable[[], None] | None = None) -> tuple[float, float]:
    """`timings` summarised: (median seconds, spread seconds), the spread being max - min of
    the timed runs."""
    times = timings(fn, repeats, warmup, sync)
    return statistics.median(times), max(times) - min(times)


def fix_malloc_threshold() -> None:
    """Set glibc's heap up as `Trainer.run` does (`fastpo.memory.fix_mmap_threshold`: a fixed
    threshold, so that what the heaps serve does not depend on what an earlier side freed;
    `peak_memory` returns their free memory to the system before each measurement, so that
    peaks measured one after the other do not depend on which side ran first). Call once,
    before measuring."""
    from fastpo.memory import fix_mmap_threshold

    fix_mmap_threshold()


def _trim() -> None:
    from fastpo.memory import release_free_memory

    release_free_memory()


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory(fn: Callable[[], Any], device: str = "cpu", interval_s: float = 0.0005) -> tuple[int, Any]:
    """Peak memory that `fn()` adds above what was in use when it started, in bytes.

    On CUDA: torch.cuda.max_memory_allocated (exact). On Linux CPUs: the kernel's own
    resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs) after
    returning freed heap memory to the OS: exact, with no sampling thread competing with the
    code measured (see also `fix_malloc_threshold`). Elsewhere: the resident set sampled
    every `interval_s` seconds by a thread (very short spikes can be missed).
    Returns (peak bytes, fn's result).
    """
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, out
    import gc

    gc.collect()
    _trim()
    try:
        start_kib = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
    except (OSError, KeyError):
        return _sampled_peak(fn, interval_s)
    out = fn()
    return max(0, _status_kib("VmHWM") - start_kib) * 1024, out


def _sampled_peak(fn: Callable[[], Any], interval_s: float) -> tuple[int, Any]:
    start = _rss_bytes()
    peak = [start]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(interval_s)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out = fn()
        peak[0] = max(peak[0], _rss_bytes())
    finally:
        stop.set()
        th.join()
    return peak[0] - start, out
