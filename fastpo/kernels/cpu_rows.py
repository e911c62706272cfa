"""The chunked path's elementwise stages as one compiled C routine per stage (CPU, fp32).

Between a chunk's GEMMs the chunked path turns the scaled logits z [C, V] into the per-token
statistics (log-sum-exp, entropy, log-prob of the target) and then into d loss / d z. In
PyTorch eager that is about ten passes over each row, each a separate call; `_cpu_rows.c`
does it in two passes for the statistics (the second may leave exp(z - max) in place) and
one for the gradient (from the stored exp: no exp again; a logf only with an entropy term),
row by row (the row stays in the core's cache), the rows split over `torch.get_num_threads()`
OpenMP threads.

The C file is compiled on first use with the system's C compiler and loaded with ctypes
(`compiled.py`: flags, cache folder); later processes load the built file. Without a
compiler, or when the build fails, the eager ops run instead (warned once). `FASTPO_CPU_ROWS=0` (or false, off, no)
turns it off.

Numerics: the same equations as the eager stages (`chunked._softmax_stats`, `chunked._dz_`),
fp32 throughout; sums are vectorized (reassociated) and expf is libmvec's (<= 4 ulp), so the
results agree with the eager path to fp32 rounding (about 1e-6 relative), not bit for bit.
Each row is summed by one thread in one order: the results do not depend on the thread count.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import compiled

_ROUTINES = compiled.Routines(
    Path(__file__).with_name("_cpu_rows.c"), "cpu_rows", "FASTPO_CPU_ROWS",
    "fastpo.kernels: the CPU row kernels could not be built, the chunked path's elementwise stages run as PyTorch "
    "ops (slower, same results to rounding)",
    {"fastpo_row_stats": ([compiled.P, compiled.I64, compiled.I64, compiled.I64] + [compiled.P] * 6
                          + [compiled.INT, compiled.INT], None),
     "fastpo_row_dz": ([compiled.P, compiled.I64, compiled.I64, compiled.I64] + [compiled.P] * 6
                       + [compiled.F, compiled.INT], None),
     "fastpo_row_dz_exp": ([compiled.P, compiled.I64, compiled.I64, compiled.I64] + [compiled.P] * 5
                           + [compiled.F, compiled.INT], None)})


def status() -> str:
    """"ok" when the compiled routines are in use, else why not (builds them on first call)."""
    return _ROUTINES.status()


def usable(z: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether the compiled routines can take this chunk: CPU fp32 z [C, V] with unit column
    stride, int32/int64 targets [C] within [0, V) (anything else goes to the eager ops, which
    raise on a bad target as before)."""
    if z.device.type != "cpu" or z.dtype != torch.float32 or z.dim() != 2 or z.stride(1) != 1 or z.shape[0] == 0:
        return False
    if targets.dtype not in (torch.int32, torch.int64) or targets.shape != z.shape[:1]:
        return False
    if _ROUTINES.get() is None:
        return False
    return bool(((targets >= 0) & (targets < z.shape[1])).all())


def _rows(x: torch.Tensor, c: int, name: str) -> torch.Tensor:
    """x as c contiguous fp32 values (ValueError otherwise: the C loops read one per row)."""
    if not isinstance(x, torch.Tensor) or x.numel() != c or x.device.type != "cpu":
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must hold one value per row ({c}) on the CPU, got {shape}")
    return x.reshape(c).to(torch.float32).contiguous()


def _checked(z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if not usable(z, targets):
        raise ValueError(f"the CPU row kernels cannot take z {tuple(z.shape)} {z.dtype} on {z.device} with targets "
                         f"{tuple(targets.shape)} {targets.dtype} (see cpu_rows.usable)")
    return targets.to(torch.int64).contiguous()


class RowStats(tuple):
    """(lse, entropy, logprob), each [C] fp32, with the row max `shift`, `log_norm` = log sum
    exp(z - max) and whether the rows now hold exp(z - max) (`exp_stored`), for `row_dz_`."""
    shift: torch.Tensor
    log_norm: torch.Tensor
    exp_stored: bool


def row_stats(z: torch.Tensor, targets: torch.Tensor, store_exp: bool = False) -> RowStats:
    """(lse [C], entropy [C], logprob [C]) fp32 of the scaled logits z [C, V]: lse = log sum_v
    exp z_v, entropy = lse - sum_v softmax_v z_v, logprob = z_target - lse (as (z_target - max)
    - log sum exp(z - max)). z is left unchanged, or with `store_exp` holds exp(z - max) (what
    `row_dz_` then needs: no second exp). Call only where `usable(z, targets)`."""
    c, v = z.shape
    t = _checked(z, targets)
    out = torch.empty(5, c, dtype=torch.float32)  # max, log sum, lse, entropy, logprob
    _ROUTINES.lib.fastpo_row_stats(z.data_ptr(), c, v, z.stride(0), t.data_ptr(),
                                   *(out[i].data_ptr() for i in range(5)), int(store_exp), torch.get_num_threads())
    stats = RowStats((out[2], out[3], out[4]))
    stats.shift, stats.log_norm, stats.exp_stored = out[0], out[1], bool(store_exp)
    return stats


def row_dz_(z: torch.Tensor, targets: torch.Tensor, stats, entropy: torch.Tensor, g_lp: torch.Tensor,
            g_ent: torch.Tensor, inv_t: float) -> torch.Tensor:
    """In place on z [C, V] (scaled logits, or exp(z - max) after `row_stats(store_exp=True)`):
    d loss / d logits, (1/T) (g_lp 1[v = target] - p_v (g_lp + g_ent (log p_v + entropy))),
    p = softmax(z); `stats` is `row_stats(z, targets)` or the log-sum-exp [C] alone (as the
    backward of the generic function has it; log p is then z - lse, as in the eager ops);
    g_lp, g_ent [C] are the upstream gradients of log-prob and entropy. Returns z. Call only
    where `usable(z, targets)`."""
    c, v = z.shape
    t = _checked(z, targets)
    entropy, g_lp, g_ent = _rows(entropy, c, "entropy"), _rows(g_lp, c, "g_lp"), _rows(g_ent, c, "g_ent")
    if isinstance(stats, RowStats):
        shift, log_norm = _rows(stats.shift, c, "stats"), _rows(stats.log_norm, c, "stats")
    else:
        shift, log_norm = _rows(stats, c, "lse"), torch.zeros(c, dtype=torch.float32)
    if isinstance(stats, RowStats) and stats.exp_stored:
        _ROUTINES.lib.fastpo_row_dz_exp(z.data_ptr(), c, v, z.stride(0), t.data_ptr(), log_norm.data_ptr(),
                                        entropy.data_ptr(), g_lp.data_ptr(), g_ent.data_ptr(), float(inv_t),
                                        torch.get_num_threads())
        return z
    _ROUTINES.lib.fastpo_row_dz(z.data_ptr(), c, v, z.stride(0), t.data_ptr(), shift.data_ptr(), log_norm.data_ptr(),
                                entropy.data_ptr(), g_lp.data_ptr(), g_ent.data_ptr(), float(inv_t),
                                torch.get_num_threads())
    return z
