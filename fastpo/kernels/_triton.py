"""Triton kernels: log-prob, entropy and their backward straight from hidden states.

Forward (`triton_stats`): each program owns BLOCK_N tokens and one contiguous range of
vocabulary tiles (a "split"); per tile it computes the logits tile with tl.dot (fp32
accumulation) and folds it into a running max m (started at -inf), a running sum
s = sum exp(z - m) and t = sum exp(z - m) (z - m) (so entropy = log s - t / s needs no
large-magnitude subtraction). The target's logit is not picked out of the tiles (a select
over every [BLOCK_N, BLOCK_V] tile kept one more full tile live and made the half-precision
forward spill registers at every config on sm_80 and sm_90, `bench/kernel_compile.py`):
the split whose vocabulary range holds a token's target forms hidden . W[target] once, as
fp32 products summed over the hidden size (`_target_logit`). Padded vocabulary columns are
-inf (they add 0 to s and t). The splits' partial (m, s, t) are
merged by a small kernel in a fixed order. The split size is fixed in vocabulary tiles, not
derived from N, so a token's log-prob does not depend on the batch it came in (ratio
exactly 1 on policy).

Backward (`triton_grads`): for a slice of the vocabulary at a time, a kernel recomputes
the logits tile and writes d loss / d logits from the saved log-sum-exp and entropy and the
per-token upstream gradients (for the policy loss those carry the loss's elementwise
gradient, so no second vocabulary pass is needed for it):
    dz_v = g_lp (1[v = target] - p_v) - g_ent p_v (log p_v + entropy),  d logits = dz / T.
Then cuBLAS forms d hidden += dlogits @ W[slice] (fp32 accumulator) and
d W[slice] = dlogits.T @ hidden, which sums over all tokens inside one GEMM with fp32
accumulation. Only one [N, slice] buffer exists at a time (`slice_columns`).

Program order: both kernels walk their (row block, vocabulary piece) grid in groups of
GROUP_N row blocks, row blocks fastest inside a group, so the programs running at once
share a few row blocks of `hidden` and a few weight tiles, which stay in L2 (with row
blocks fastest over all N, every vocabulary tile would re-read all of `hidden` from HBM:
~140 GB per dlogits pass at Qwen2.5-7B shapes and N=16384). The order changes no result.

Out of memory: `triton_stats(max_rows=)` runs the forward over row chunks (a token's
result does not depend on its chunk, so the output is bitwise the same) and
`triton_grads(chunk_bytes=)` takes a smaller dlogits slice; `fastpo.kernels.api` retries
with these after a CUDA out-of-memory error.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time

import torch
import triton
import triton.language as tl

from .chunked import chunked_grads, chunked_stats, mm_f32

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Under the interpreter: "small" tiles (fast tests) or "gpu", the compiled kernels' tile
# sizes (tests of the production configuration on the CPU; set by tests only).
INTERPRET_BLOCKS = "small"
# Row blocks per program group (see the module docstring); program order only, no result changes.
GROUP_N = 8
# Bytes of the per-slice dlogits buffer in the backward: at most BWD_CHUNK_BYTES, and at most
# 1/BWD_CHUNK_FRACTION of what the whole [N, V] dlogits would take (but not under
# BWD_CHUNK_MIN_BYTES, so slices stay large GEMMs). The fraction keeps the buffer a small
# share of naive autograd's memory at small N (N=4096, V=151936 bf16: 9 slices, 132 MiB, not
# 5 slices of 256 MiB).
BWD_CHUNK_BYTES = 256 * 1024 * 1024
BWD_CHUNK_FRACTION = 8
BWD_CHUNK_MIN_BYTES = 32 * 1024 * 1024
# The splits' merge kernel: tokens per program and warps (one config; no autotuning).
COMBINE_BLOCK = 128
COMBINE_WARPS = 4


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, rmask, cmask, D, stride_h, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_V] tile of hidden @ weight.T (IEEE: exact fp32 products)."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    h_row = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_col = w_ptr + cols.to(tl.int64)[None, :] * stride_w
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        dmask = ds < D
        h = tl.load(h_row + ds[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(w_col + ds[:, None], mask=cmask[None, :] & dmask[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(h.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, w, acc)
    return acc


@triton.jit
def _grouped_ids(pid, n_a, n_b, GROUP: tl.constexpr):
    """Program id -> (a, b) on an [n_a, n_b] grid: consecutive ids take GROUP consecutive
    a's (the last group may be smaller) through every b, a fastest. Every (a, b) once."""
    per_group = GROUP * n_b
    group = pid // per_group
    a0 = group * GROUP
    size = tl.minimum(n_a - a0, GROUP)
    r = pid - group * per_group
    return a0 + r % size, r // size


@triton.jit
def _target_logit(h_ptr, w_ptr, rows, tgt, rmask, D, stride_h, stride_w, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """fp32 [BLOCK_N] hidden[row] . weight[target[row]] (exact products, fp32 sums over D)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    h_row = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_row = w_ptr + tl.maximum(tgt, 0).to(tl.int64)[:, None] * stride_w
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (ds < D)[None, :]
        h = tl.load(h_row + ds[None, :], mask=m2, other=0.0).to(tl.float32)
        w = tl.load(w_row + ds[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += tl.sum(h * w, axis=1)
    return acc


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, tgt_ptr, part_ptr, N, V, D, stride_h, stride_w, inv_temp, tiles_per_split, n_splits,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                GROUP_N: tl.constexpr):
    pid_n, pid_s = _grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), n_splits, GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    n_tiles = tl.cdiv(V, BLOCK_V)
    tile0 = pid_s * tiles_per_split
    tile1 = tl.minimum(tile0 + tiles_per_split, n_tiles)
    for tile in range(tile0, tile1):
        cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
        cmask = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, rmask, cmask, D, stride_h, stride_w,
                         BLOCK_N, BLOCK_V, BLOCK_D, IEEE) * inv_temp
        z = tl.where(cmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        zc = z - m_new[:, None]
        p = tl.exp(zc)
        pzc = p * tl.where(cmask[None, :], zc, 0.0)  # padded: 0 * 0, never 0 * -inf
        # rescale t from the old max to the new one; s == 0 only before the first tile
        shift = (tl.where(s > 0.0, m, m_new) - m_new) * s
        t = alpha * (t + shift) + tl.sum(pzc, axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new
    # the target's logit once per token, by the split that holds it (not a select over every tile)
    mine = rmask & (tgt >= tile0 * BLOCK_V) & (tgt < tile1 * BLOCK_V)
    zt = _target_logit(h_ptr, w_ptr, rows, tgt, mine, D, stride_h, stride_w, BLOCK_N, BLOCK_D) * inv_temp
    base = part_ptr + pid_s * N + rows
    stride_part = n_splits * N
    tl.store(base, m, mask=rmask)
    tl.store(base + stride_part, s, mask=rmask)
    tl.store(base + 2 * stride_part, t, mask=rmask)
    tl.store(base + 3 * stride_part, zt, mask=rmask)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, out_ptr,
                    N, V, D, v_start, v_len, stride_h, stride_w, stride_o, inv_temp, N_BUCKET,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                    GROUP_N: tl.constexpr):
    # N_BUCKET is only the autotuning key's bucket of N (unused here)
    pid_n, pid_v = _grouped_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_len, BLOCK_V), GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lcols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the slice
    cols = v_start + lcols
    rmask = rows < N
    cmask = (lcols < v_len) & (cols < V)
    z = _logits_tile(h_ptr, w_ptr, rows, cols, rmask, cmask, D, stride_h, stride_w,
                     BLOCK_N, BLOCK_V, BLOCK_D, IEEE) * inv_temp
    tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=rmask, other=0.0)
    gent = tl.load(gent_ptr + rows, mask=rmask, other=0.0)
    logp = z - lse[:, None]
    p = tl.exp(logp)
    dz = -p * (glp[:, None] + gent[:, None] * (logp + ent[:, None]))
    dz = tl.where(cols[None, :] == tgt[:, None], dz + glp[:, None], dz) * inv_temp
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_o + lcols[None, :]
    tl.store(out, dz.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _combine_kernel(part_ptr, lp_ptr, ent_ptr, lse_ptr, N, n_splits, BLOCK: tl.constexpr):
    # merge the splits' (m, s, t, z_target) in a fixed order, so a token's result never
    # depends on how many tokens share its batch
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < N
    stride = n_splits * N
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for k in range(0, n_splits):
        m = tl.maximum(m, tl.load(part_ptr + k * N + rows, mask=rmask, other=0.0))
    s = tl.zeros([BLOCK], dtype=tl.float32)
    t = tl.zeros([BLOCK], dtype=tl.float32)
    zt = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, n_splits):
        mk = tl.load(part_ptr + k * N + rows, mask=rmask, other=0.0)
        sk = tl.load(part_ptr + stride + k * N + rows, mask=rmask, other=1.0)
        tk = tl.load(part_ptr + 2 * stride + k * N + rows, mask=rmask, other=0.0)
        zt += tl.load(part_ptr + 3 * stride + k * N + rows, mask=rmask, other=0.0)
        scale = tl.exp(mk - m)  # every split covers >= 1 real column: mk finite, sk >= 1
        s += scale * sk
        t += scale * (tk + (mk - m) * sk)
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + rows, lse, mask=rmask)
    tl.store(ent_ptr + rows, log_s - t / s, mask=rmask)
    tl.store(lp_ptr + rows, zt - lse, mask=rmask)


def _config(dtype: torch.dtype) -> dict:
    """Tile sizes and launch options of the compiled kernels for `dtype`; under the
    interpreter small tiles (speed of tests) unless INTERPRET_BLOCKS == "gpu"."""
    if dtype in (torch.float32, torch.float64):
        cfg = dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, IEEE=True, num_warps=4, num_stages=2, tiles_per_split=32)
    else:
        cfg = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, IEEE=False, num_warps=8, num_stages=3, tiles_per_split=16)
    cfg["GROUP_N"] = GROUP_N
    if INTERPRET:
        if INTERPRET_BLOCKS != "gpu":
            cfg.update(BLOCK_N=16, BLOCK_V=64, BLOCK_D=32, tiles_per_split=4)
        # The interpreter's tl.dot mishandles bf16 operands (a 16x32x16 product off by ~5e10):
        # bf16 runs the dot in fp32 there, which is exact for bf16 values, so the check against
        # the reference stays meaningful. fp16 operands work, so fp16 runs the production
        # branch (IEEE=False, tl.dot on the half-precision tiles); the bf16 form of that
        # branch is only run by the GPU tests.
        cfg["IEEE"] = dtype != torch.float16
    return cfg


# On the GPU the row-block size, warps and pipeline depth are autotuned (FASTPO_TRITON_AUTOTUNE=0
# turns it off). BLOCK_V and BLOCK_D stay fixed: they set the summation order over the hidden
# size and the vocabulary splits. The forward is tuned per (V, D, dtype) only, never per N:
# its block shape and warps set the order of its reductions over a tile, so one config must
# serve every batch of a run (a token's log-prob independent of its batch: ratio exactly 1 on
# policy). The dlogits kernel (gradients only) is tuned per bucket of N as well.
AUTOTUNE = not INTERPRET and os.environ.get("FASTPO_TRITON_AUTOTUNE", "1") != "0"
_TUNE_CONFIGS = {
    False: [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bn, w, st in ((128, 8, 3), (128, 8, 4), (64, 4, 4))],
    True: [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st) for bn, w, st in ((64, 4, 2), (32, 4, 3))],
}
_TUNE_KEYS = {"fwd": ["V", "D"], "dlogits": ["V", "D", "N_BUCKET"]}
_tuned: dict = {}


def n_bucket(n: int) -> int:
    """The autotuning bucket of N for the dlogits kernel: the next power of 4 from 256 to 65536."""
    b = 256
    while b < n and b < 65536:
        b *= 4
    return b


def _interpret_bench(fn, quantiles=None, **_):
    """Autotuning's timer under the interpreter (Triton's needs a GPU driver): one timed run."""
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    return [ms] * len(quantiles) if quantiles else ms


def _kernel(name: str, ieee: bool, tuned: bool | None = None):
    """The plain kernel, or its autotuned wrapper (`tuned`, default AUTOTUNE)."""
    base = {"fwd": _fwd_kernel, "dlogits": _dlogits_kernel}[name]
    if not (AUTOTUNE if tuned is None else tuned):
        return base
    if (name, ieee) not in _tuned:
        extra = {"do_bench": _interpret_bench} if INTERPRET else {}
        _tuned[name, ieee] = triton.autotune(configs=_TUNE_CONFIGS[ieee], key=_TUNE_KEYS[name], **extra)(base)
    return _tuned[name, ieee]


def _launch_opts(cfg: dict, tuned: bool | None = None) -> dict:
    """Kernel keyword arguments: all of cfg, or what autotuning leaves to the caller."""
    drop = {"tiles_per_split"}
    if AUTOTUNE if tuned is None else tuned:
        drop |= {"BLOCK_N", "num_warps", "num_stages"}
    return {k: v for k, v in cfg.items() if k not in drop}


def _alloc(shape, dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
    """Every buffer this module allocates, in one place (where an out-of-memory error starts)."""
    return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)


def launch_device(t: torch.Tensor):
    """A context manager under which Triton launches run on `t`'s GPU.

    Triton launches on the current CUDA device (`torch.cuda.current_device()`), not on the
    device of the tensors passed: with tensors on cuda:1 and cuda:0 current (no
    `torch.cuda.set_device`, as in a process that drives two GPUs) a kernel would run on
    GPU 0 with GPU 1's addresses. Off CUDA (CPU tensors under TRITON_INTERPRET) a no-op.
    """
    if t.device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


def _on_tensor_device(fn):
    """Run `fn(hidden, ...)` with every launch inside under `launch_device(hidden)`."""
    @functools.wraps(fn)
    def run(hidden, *args, **kwargs):
        with launch_device(hidden):
            return fn(hidden, *args, **kwargs)
    return run


def _check(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if hidden.device != weight.device:
        raise ValueError(f"the Triton path needs hidden and weight on one device, got {hidden.device} and "
                         f"{weight.device}")
    if hidden.dtype == torch.float64 or weight.dtype == torch.float64:
        raise TypeError("the Triton path takes bf16/fp16/fp32 inputs, got float64 (use impl='chunked')")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"the Triton path needs hidden and weight of one dtype, got {hidden.dtype} and {weight.dtype}")


#: What Triton's launch-time specialisation checks: 16-byte-aligned pointers, and integer
#: arguments (the hidden size, the row strides) divisible by 16. Only that variant is
#: compile-checked without spills (bench/kernel_compile.py); `_aligned_inputs` hands the
#: kernels nothing else.
ALIGN = 16


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it when its data pointer is not 16-byte aligned (a view into a tensor)."""
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def _aligned_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """(hidden [N, Hp], weight [V, Hp], targets, H): the inputs as the compiled variant takes
    them. A hidden size H that is not a multiple of 16 is padded with zero columns to Hp (the
    logits hidden @ weight.T are unchanged; a copy of both, cheap against the loss); a view
    whose data does not start 16-byte aligned is copied."""
    d = hidden.shape[1]
    pad = -d % ALIGN
    if pad:
        hidden = torch.nn.functional.pad(hidden, (0, pad))
        weight = torch.nn.functional.pad(weight, (0, pad))
    return _aligned(hidden.contiguous()), _aligned(weight.contiguous()), _aligned(targets.contiguous()), d


@torch.no_grad()
@_on_tensor_device
def triton_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 max_rows: int | None = None, tuned: bool | None = None):
    """(logprob [N], entropy [N], lse [N]) fp32 of softmax(hidden @ weight.T / T); no logits held.

    hidden [N, H] and weight [V, H] contiguous, same dtype (bf16/fp16/fp32); targets [N] int64.
    max_rows: launch over row chunks of at most this many rows (rounded up to whole row
    blocks, at least one), for less memory ([4, V / 2048, rows] fp32 partial sums per chunk);
    every row keeps its place in its row block, so the results are bitwise those of one
    launch. tuned: autotune (default AUTOTUNE). Launched on hidden's device (`launch_device`).
    Any hidden size and any view work: the kernels get aligned copies (`_aligned_inputs`).
    """
    _check(hidden, weight)
    hidden, weight, targets, _ = _aligned_inputs(hidden, weight, targets)
    n, d = hidden.shape
    v = weight.shape[0]
    cfg = _config(hidden.dtype)
    n_tiles = triton.cdiv(v, cfg["BLOCK_V"])
    tps = min(cfg["tiles_per_split"], n_tiles)
    n_splits = triton.cdiv(n_tiles, tps)
    out = _alloc((3, n), torch.float32, hidden.device)
    tuned = AUTOTUNE if tuned is None else tuned
    # the largest row block any config may use: chunks of whole row blocks
    align = max(c.kwargs["BLOCK_N"] for c in _TUNE_CONFIGS[cfg["IEEE"]]) if tuned else cfg["BLOCK_N"]
    step = n if max_rows is None else triton.cdiv(max(1, int(max_rows)), align) * align
    kernel, opts = _kernel("fwd", cfg["IEEE"], tuned), _launch_opts(cfg, tuned)
    for r0 in range(0, n, max(1, step)):
        rows = min(step, n - r0)
        part = _alloc((4, n_splits, rows), torch.float32, hidden.device)

        def grid(meta, rows=rows):
            return (triton.cdiv(rows, meta["BLOCK_N"]) * n_splits,)

        kernel[grid](hidden[r0:], weight, targets[r0:], part, rows, v, d, hidden.stride(0), weight.stride(0),
                     1.0 / temperature, tps, n_splits, **opts)
        _combine_kernel[(triton.cdiv(rows, COMBINE_BLOCK),)](part, out[0, r0:], out[1, r0:], out[2, r0:], rows,
                                                             n_splits, BLOCK=COMBINE_BLOCK, num_warps=COMBINE_WARPS)
        del part
    return out[0], out[1], out[2]


def dlogits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The backward's dlogits buffer dtype: bf16 for bf16 (like bf16 autograd), else fp32
    (fp16's narrow range could flush small gradients)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def dlogits_slice_bytes(n: int, v: int, dtype: torch.dtype) -> int:
    """Bytes of the default [n, slice] dlogits buffer of `triton_grads` for inputs of `dtype`."""
    itemsize = torch.tensor([], dtype=dlogits_dtype(dtype)).element_size()
    return n * itemsize * slice_columns(n, v, _config(dtype)["BLOCK_V"], itemsize)


def default_chunk_bytes(n: int, v: int, itemsize: int) -> int:
    """The default dlogits slice budget: min(BWD_CHUNK_BYTES, max(BWD_CHUNK_MIN_BYTES,
    n * v * itemsize / BWD_CHUNK_FRACTION))."""
    return min(BWD_CHUNK_BYTES, max(BWD_CHUNK_MIN_BYTES, n * v * itemsize // BWD_CHUNK_FRACTION))


def slice_columns(n: int, v: int, block_v: int, itemsize: int, chunk_bytes: int | None = None) -> int:
    """Vocabulary columns per backward slice (a multiple of block_v, at least one tile, at
    most the padded V) for an [n, slice] dlogits buffer of `itemsize`-byte entries, evened
    out so that the last slice is not a sliver. chunk_bytes: an explicit budget; default
    `default_chunk_bytes`."""
    budget = default_chunk_bytes(n, v, itemsize) if chunk_bytes is None else int(chunk_bytes)
    per_col = max(1, n) * itemsize
    cols = min(max(block_v, budget // per_col // block_v * block_v), triton.cdiv(v, block_v) * block_v)
    n_slices = triton.cdiv(v, cols)
    return triton.cdiv(triton.cdiv(v, n_slices), block_v) * block_v


@torch.no_grad()
@_on_tensor_device
def triton_grads(hidden, weight, targets, lse, entropy, g_lp, g_ent, temperature: float = 1.0,
                 need_hidden: bool = True, need_weight: bool = True, chunk_bytes: int | None = None,
                 tuned: bool | None = None):
    """(d hidden [N, H] fp32 or None, d weight [V, H] in weight's dtype or None).

    lse, entropy [N] fp32 from `triton_stats`; g_lp, g_ent [N] upstream gradients of
    log-prob and entropy. The vocabulary is processed in slices whose [N, slice] dlogits
    buffer fits `chunk_bytes` (default: see `slice_columns`). tuned: autotune (default
    AUTOTUNE). Launched on hidden's device (`launch_device`). Raises torch.OutOfMemoryError
    as is (see `chunked.mm_f32`); ValueError for hidden and weight on different devices.
    Any hidden size and any view work: the kernels get aligned copies (`_aligned_inputs`).
    """
    _check(hidden, weight)
    hidden, weight, targets, d_in = _aligned_inputs(hidden, weight, targets)
    n, d = hidden.shape
    v = weight.shape[0]
    cfg = _config(hidden.dtype)
    bv = cfg["BLOCK_V"]
    buf_dtype = dlogits_dtype(hidden.dtype)
    v_chunk = slice_columns(n, v, bv, torch.tensor([], dtype=buf_dtype).element_size(), chunk_bytes)
    dh = _alloc((n, d), torch.float32, hidden.device, zero=True) if need_hidden else None
    dw = _alloc(weight.shape, weight.dtype, weight.device) if need_weight else None
    if n == 0:
        if need_weight:
            dw.zero_()
        return _unpadded(dh, d_in), _unpadded(dw, d_in)
    # (lse and entropy are often rows of triton_stats' one [3, N] buffer: aligned only for N % 4 == 0)
    lse, entropy = _aligned(lse.float().contiguous()), _aligned(entropy.float().contiguous())
    g_lp, g_ent = _aligned(g_lp.float().contiguous()), _aligned(g_ent.float().contiguous())
    buf = _alloc((n, v_chunk), buf_dtype, hidden.device)
    kernel, opts = _kernel("dlogits", cfg["IEEE"], tuned), _launch_opts(cfg, tuned)
    for v0 in range(0, v, v_chunk):
        vl = min(v_chunk, v - v0)

        def grid(meta, vl=vl):
            return (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(vl, bv),)

        kernel[grid](hidden, weight, targets, lse, entropy, g_lp, g_ent, buf, n, v, d, v0, vl,
                     hidden.stride(0), weight.stride(0), buf.stride(0), 1.0 / temperature, n_bucket(n), **opts)
        dl = buf[:, :vl]
        w_sl = weight[v0:v0 + vl]
        if need_hidden:
            dh += mm_f32(dl, w_sl)
        if need_weight:
            # one GEMM over all tokens with an fp32 result, a single rounding to weight's dtype
            dw[v0:v0 + vl] = mm_f32(dl.T, hidden)
    return _unpadded(dh, d_in), _unpadded(dw, d_in)


def _unpadded(grad: torch.Tensor | None, d: int) -> torch.Tensor | None:
    """A gradient [rows, Hp] of padded inputs (`_aligned_inputs`) cut back to the caller's H columns."""
    return grad if grad is None or grad.shape[1] == d else grad[:, :d].contiguous()


def probe(device: torch.device, dtype: torch.dtype) -> None:
    """Run both kernels (plain, not autotuned) on a tiny problem on `device` in `dtype` and
    check them against the chunked path; raises on a build/launch failure or a wrong result.
    `impl="auto"` calls this once before it first chooses Triton, so that a failure moves a
    run to the chunked path before any log-prob exists, not between the old log-probs and
    the update."""
    with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):  # both paths at full precision
        _probe(device, dtype)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, v = 40, 64, 2100  # two vocabulary splits, a padded last tile, a partial row block
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) / 8).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    g_lp, g_ent = torch.randn(2, n, generator=g).to(device)
    lp, ent, lse = triton_stats(hidden, weight, targets, 0.7, tuned=False)
    dh, dw = triton_grads(hidden, weight, targets, lse, ent, g_lp, g_ent, 0.7, tuned=False)
    lp_c, ent_c, lse_c = chunked_stats(hidden, weight, targets, 0.7)
    dh_c, dw_c = chunked_grads(hidden, weight, targets, lse_c, ent_c, g_lp, g_ent, 0.7)
    # loose enough for TF32 or bf16 GEMMs on the chunked side; a broken kernel is off by O(1)
    checks = {"log-prob": (lp, lp_c, 5e-3), "entropy": (ent, ent_c, 5e-3), "d hidden": (dh, dh_c, 5e-2),
              "d weight": (dw, dw_c, 5e-2)}
    for name, (a, b, tol) in checks.items():
        a, b = a.float(), b.float()
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        if not err <= tol:  # also catches NaN
            raise RuntimeError(f"the Triton kernels' {name} differs from the chunked path's by {err:.3g} "
                               f"(relative norm, tolerance {tol:g}) on a {n}x{h}x{v} {dtype} probe")
