"""Decode attention over a paged KV cache: a compiled C routine for the CPU and its PyTorch reference.

A paged cache keeps each layer's keys and values in pools of fixed-size blocks
(`BLOCK` tokens); a row's tokens are the blocks its block table lists, in order, anywhere in
the pool (fastpo/rollout/kv_cache.py). Decoding attends one new query token per row to the
row's whole context.

- `paged_decode` (`_cpu_attention.c`): per (row, KV head), the scores of that head's query
  heads block by block, the softmax over the row's length, the probability-weighted values;
  each key and value is read once, and no padding is read. The rows and heads are split over
  `torch.get_num_threads()` OpenMP threads; each is summed by one thread in one order, so the
  result does not depend on the thread count.
- `paged_decode_reference`: the same from the pools with PyTorch ops (the rows' blocks gathered
  into a padded batch, then sdpa with a length mask): any device and dtype, the slow, obvious
  path the C routine is tested against, and what runs where the C routine cannot (CUDA, no
  compiler, a dtype other than fp32).

The C file is built on first use with the system's C compiler (`compiled.py`); without one,
or when the build fails, `usable` is False (warned once). `FASTPO_CPU_ATTENTION=0` (or false,
off, no) turns it off. Numerics: fp32 throughout, sums vectorized (reassociated), expf from
libmvec (<= 4 ulp): the C routine agrees with the reference to fp32 rounding (about 1e-6
relative), not bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import compiled

#: Tokens per block of a paged KV cache (the C routine's compile-time block size).
BLOCK = 16

_ROUTINES = compiled.Routines(
    Path(__file__).with_name("_cpu_attention.c"), "cpu_attention", "FASTPO_CPU_ATTENTION",
    "fastpo.kernels: the CPU decode attention could not be built, decoding runs PyTorch's attention on gathered "
    "blocks (slower, same results to rounding)",
    {"fastpo_paged_decode": ([compiled.P] * 5 + [compiled.I64, compiled.P] + [compiled.I64] * 4
                             + [compiled.F, compiled.INT], compiled.INT)})


def status() -> str:
    """"ok" when the compiled routine is in use, else why not (builds it on first call)."""
    return _ROUTINES.status()


def _shapes(q, kpool, vpool, table, lens) -> str | None:
    """Why these cannot go to the C routine (None when they can)."""
    if q.dim() != 3 or kpool.dim() != 4 or vpool.dim() != 4 or table.dim() != 2 or lens.dim() != 1:
        return "q [R, Hq, D], pools [NB, Hkv, ., .], table [R, blocks], lens [R] expected"
    R, Hq, D = q.shape
    NB, Hkv = kpool.shape[:2]
    if tuple(kpool.shape) != (NB, Hkv, D, BLOCK) or tuple(vpool.shape) != (NB, Hkv, BLOCK, D):
        return f"pools of shapes {tuple(kpool.shape)} and {tuple(vpool.shape)} for head dim {D} and block {BLOCK}"
    if Hkv == 0 or Hq % Hkv or table.shape[0] != R or lens.shape[0] != R:
        return f"{Hq} query heads over {Hkv} KV heads, table {tuple(table.shape)}, lens {tuple(lens.shape)} for {R} rows"
    return None


def usable(q: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor) -> bool:
    """Whether `paged_decode` can take these: fp32 CPU tensors, pools laid out as described
    in `paged_decode`, and the routine built."""
    if any(x.device.type != "cpu" or x.dtype != torch.float32 for x in (q, kpool, vpool)):
        return False
    if not (kpool.is_contiguous() and vpool.is_contiguous()):
        return False
    return _ROUTINES.get() is not None


def paged_decode(q: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, table: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale q . K^T) V for one query token per row, K and V read from the pools.

    q: [R, Hq, D] fp32 (any strides; copied to contiguous). kpool: [NB, Hkv, D, BLOCK] fp32
    contiguous, each block's keys transposed (head dim before slot); vpool: [NB, Hkv, BLOCK, D].
    table: [R, max blocks] int (block ids, every entry in [0, NB)); lens: [R] int, each row's
    tokens, 1 <= lens[r] <= BLOCK x max blocks: row r's token i is slot i % BLOCK of block
    table[r, i // BLOCK]. Query head h reads KV head h // (Hq / Hkv) (grouped-query attention).
    Returns out [R, Hq, D] fp32. Raises ValueError for shapes, block ids or lengths outside
    these bounds, or where `usable` is False; MemoryError when a task's scratch memory (Hq / Hkv
    x row length floats) cannot be allocated.
    """
    why = _shapes(q, kpool, vpool, table, lens)
    if why is None and not usable(q, kpool, vpool):
        why = f"not usable here ({status()})"
    if why is not None:
        raise ValueError(f"paged_decode cannot take these: {why}")
    R, Hq, D = q.shape
    if R == 0:
        return q.new_empty((0, Hq, D))
    table = table.to(torch.int32).contiguous()
    lens = lens.to(torch.int64).contiguous()
    NB = kpool.shape[0]
    if int(table.min()) < 0 or int(table.max()) >= NB:
        raise ValueError(f"block ids must be in [0, {NB}), got [{int(table.min())}, {int(table.max())}]")
    if int(lens.min()) < 1 or int(lens.max()) > table.shape[1] * BLOCK:
        raise ValueError(f"row lengths must be in [1, {table.shape[1] * BLOCK}], got "
                         f"[{int(lens.min())}, {int(lens.max())}]")
    q = q.contiguous()
    out = torch.empty_like(q)
    failed = _ROUTINES.lib.fastpo_paged_decode(q.data_ptr(), out.data_ptr(), kpool.data_ptr(), vpool.data_ptr(),
                                               table.data_ptr(), table.shape[1], lens.data_ptr(), R, Hq,
                                               kpool.shape[1], D, float(scale), torch.get_num_threads())
    if failed:
        raise MemoryError(f"paged_decode: no memory for the scores of a row of up to {int(lens.max())} tokens")
    return out


def gather_rows(kpool: torch.Tensor, vpool: torch.Tensor, table: torch.Tensor, length: int) -> tuple:
    """The first `length` tokens of the rows of `table` [R, blocks] from the pools (laid out as
    in `paged_decode`), as (K, V), each [R, Hkv, length, D] contiguous, in the pools' dtype
    and device; tokens past a row's own length are whatever its listed blocks hold."""
    R, nb = table.shape
    idx = table.to(device=kpool.device, dtype=torch.long).reshape(-1)
    Hkv, D = kpool.shape[1], kpool.shape[2]
    k = kpool.index_select(0, idx).view(R, nb, Hkv, D, BLOCK).permute(0, 2, 1, 4, 3)
    v = vpool.index_select(0, idx).view(R, nb, Hkv, BLOCK, D).permute(0, 2, 1, 3, 4)
    return (k.reshape(R, Hkv, nb * BLOCK, D)[:, :, :length].contiguous(),
            v.reshape(R, Hkv, nb * BLOCK, D)[:, :, :length].contiguous())


def paged_decode_reference(q: torch.Tensor, kpool: torch.Tensor, vpool: torch.Tensor, table: torch.Tensor,
                           lens: torch.Tensor, scale: float) -> torch.Tensor:
    """What `paged_decode` computes, with PyTorch ops on any device and dtype: the rows' blocks
    gathered into a padded batch [R, Hkv, max len, D] (`gather_rows`; the slots past a row's
    length zeroed), then sdpa with a mask of each row's length. Same arguments; returns
    [R, Hq, D] in q's dtype."""
    R, Hq, D = q.shape
    if R == 0:
        return q.new_empty((0, Hq, D))
    L = int(lens.max())
    k, v = gather_rows(kpool, vpool, table[:, :(L + BLOCK - 1) // BLOCK], L)
    mask = torch.arange(L, device=q.device)[None, :] < lens.to(q.device)[:, None]
    # slots past a row's length hold whatever was there (a NaN would pass through a zero weight)
    k.masked_fill_(~mask[:, None, :, None], 0)
    v.masked_fill_(~mask[:, None, :, None], 0)
    Hkv = k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(R, Hkv, Hq // Hkv, D), k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(R, Hq, D)
