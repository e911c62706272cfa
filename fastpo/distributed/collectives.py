"""Collectives over a `DistContext`, each the one-process computation when there is one
process: rank-0-only side effects with the result, or the error, shared (`on_main`), work
shared out with the results gathered (`gather_results`), object gathers, the replicas'
start from rank 0's weights (`broadcast_modules`), element-wise sums and maxima
(`all_reduce`), the global batch's whitening (`masked_whiten`) and one number from every rank
(`per_rank`). An iteration's metrics are reduced once, by fastpo.trainer.metric_sums."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from fastpo.algorithms import masked_whiten as whiten
from fastpo.distributed.context import DistContext


def on_main(ctx: DistContext, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Run `fn` on rank 0 only (writing metrics.jsonl, a checkpoint, the evaluation files) and return
    its result on every rank (pickled and broadcast). An exception in `fn` is raised on every
    rank (the same type and message; one that cannot be pickled as a RuntimeError with its
    text), so that all ranks stop together instead of waiting for a result."""
    if not ctx.initialized:
        return fn(*args, **kwargs)
    import torch.distributed as dist

    box: list = [None]
    if ctx.is_main:
        try:
            box[0] = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - re-raised below, on every rank
            box[0] = ("error", portable_error(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def portable_error(e: BaseException) -> BaseException:
    """`e` if it pickles, else a RuntimeError with its type and text (to send it to other ranks)."""
    import pickle

    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def gather_results(ctx: DistContext, fn: Callable[..., Any], *args, **kwargs) -> Optional[list]:
    """Run `fn` on every rank (each on its own share of some work, e.g. its evaluation seeds)
    and return [every rank's result] in rank order on rank 0, None on the others (pickled).
    An exception in `fn` on any rank is raised on every rank once all have finished `fn`
    (the lowest failing rank's, sent as `on_main` sends one), so that no rank waits for a result
    that will not come. One process: [fn()], its exceptions raised as they are."""
    if not ctx.initialized:
        return [fn(*args, **kwargs)]
    value, error = None, None
    try:
        value = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = portable_error(e)
    errors = all_gather_object(ctx, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return gather_to_main(ctx, value)


def all_gather_object(ctx: DistContext, obj: Any) -> list:
    """[every rank's `obj`] in rank order, on every rank (pickled); [obj] for one process."""
    if not ctx.initialized:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(ctx: DistContext, obj: Any) -> Optional[list]:
    """[every rank's `obj`] in rank order on rank 0, None on the others (pickled); [obj] for one process."""
    if not ctx.initialized:
        return [obj]
    import torch.distributed as dist

    out: Optional[list] = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_modules(ctx: DistContext, *modules) -> None:
    """Copy rank 0's parameters and buffers into every rank's `modules` (None entries skipped),
    so that data-parallel replicas start equal whatever each rank loaded. No-op for one process."""
    if not ctx.initialized:
        return
    import torch.distributed as dist

    with torch.no_grad():
        for m in modules:
            if m is None:
                continue
            for t in list(m.parameters()) + list(m.buffers()):
                buf = t.detach().to(ctx.device)
                dist.broadcast(buf, src=0)
                if buf is not t:
                    t.copy_(buf)


def masked_whiten(ctx: DistContext, x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False,
                  eps: float = 1e-8) -> torch.Tensor:
    """`fastpo.algorithms.masked_whiten` (shift_mean) with the mean and variance of the global
    batch: every rank's entries where `mask` is True (sums in float64, two passes). x, mask:
    [B_r, T] (B_r may be 0); returns fp32 [B_r, T], zero off the mask. One process: that function."""
    m = mask.bool()
    if not ctx.initialized:
        return whiten(x, m, eps=eps, unbiased=unbiased)
    xf = x.to(torch.float32)
    n, total = all_reduce(ctx, [int(m.sum()), float(xf[m].double().sum())])
    if n == 0:
        return torch.zeros_like(xf)
    mean = total / n
    dev = all_reduce(ctx, [float(((xf[m].double() - mean) ** 2).sum())])[0]
    var = dev / (n - 1 if unbiased and n > 1 else n)
    return (xf - mean) * float(1.0 / (var + eps) ** 0.5) * m


def all_gather_rows(ctx: DistContext, rows: torch.Tensor) -> torch.Tensor:
    """Concatenation over ranks (rank order) of each rank's [k_r, C] float64 rows (k_r may differ)."""
    import torch.distributed as dist

    dev = ctx.device
    rows = rows.to(dev)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=dev)
    counts = [torch.zeros_like(count) for _ in range(ctx.world_size)]
    dist.all_gather(counts, count)
    counts = [int(c) for c in counts]
    width = max(counts)
    padded = torch.zeros(width, rows.shape[1], dtype=rows.dtype, device=dev)
    padded[: rows.shape[0]] = rows
    parts = [torch.zeros_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]).cpu()


def all_reduce(ctx: DistContext, values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum or max of `values` over ranks (float64), the same on every rank."""
    if not ctx.initialized:
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.cpu().tolist()


def per_rank(ctx: DistContext, value: float) -> list[float]:
    """One number from every rank, in rank order (e.g. each rank's peak memory or phase time)."""
    if not ctx.initialized:
        return [float(value)]
    return [row[0] for row in all_gather_rows(ctx, torch.tensor([[float(value)]], dtype=torch.float64)).tolist()]
