"""Triton kernels: log-prob, entropy and their backward straight from hidden states.

Forward (`triton_stats`): each program owns BLOCK_N tokens and one contiguous range of
vocabulary tiles (a "split"); per tile it computes the logits tile with tl.dot (fp32
accumulation) and folds it into a running max m (started at -inf), a running sum
s = sum exp(z - m) and t = sum exp(z - m) (z - m) (so entropy = log s - t / s needs no
large-magnitude subtraction), and picks the target logit when it lies in the tile. Padded
vocabulary columns are -inf (they add 0 to s and t). The splits' partial (m, s, t) are
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
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Bytes of the per-slice dlogits buffer in the backward: at most BWD_CHUNK_BYTES, and at most
# 1/BWD_CHUNK_FRACTION of what the whole [N, V] dlogits would take (but not under
# BWD_CHUNK_MIN_BYTES, so slices stay large GEMMs). The fraction keeps the buffer a small
# share of naive autograd's memory at small N (N=4096, V=151936 bf16: 9 slices, 132 MiB, not
# 5 slices of 256 MiB).
BWD_CHUNK_BYTES = 256 * 1024 * 1024
BWD_CHUNK_FRACTION = 8
BWD_CHUNK_MIN_BYTES = 32 * 1024 * 1024


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
def _fwd_kernel(h_ptr, w_ptr, tgt_ptr, part_ptr, N, V, D, stride_h, stride_w, inv_temp, tiles_per_split,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_splits = tl.num_programs(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    t = tl.zeros([BLOCK_N], dtype=tl.float32)
    zt = tl.zeros([BLOCK_N], dtype=tl.float32)
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
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    base = part_ptr + pid_s * N + rows
    stride_part = n_splits * N
    tl.store(base, m, mask=rmask)
    tl.store(base + stride_part, s, mask=rmask)
    tl.store(base + 2 * stride_part, t, mask=rmask)
    tl.store(base + 3 * stride_part, zt, mask=rmask)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, out_ptr,
                    N, V, D, v_start, v_len, stride_h, stride_w, stride_o, inv_temp,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    # row blocks vary fastest, so programs running together share the same weight tile
    n_row_blocks = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_n = pid % n_row_blocks
    pid_v = pid // n_row_blocks
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
    """Tile sizes and launch options; small tiles under the interpreter (speed of tests)."""
    ieee = dtype in (torch.float32, torch.float64)
    if INTERPRET:
        # The interpreter's tl.dot mishandles bf16 operands (triton 3.9: logits off by 1e10):
        # bf16 runs the dot in fp32 there, which is exact for bf16 values, so the check against
        # the reference stays meaningful. fp16 operands work, so fp16 runs the production
        # branch (IEEE=False, tl.dot on the half-precision tiles); the bf16 form of that
        # branch is only run by the GPU tests.
        return dict(BLOCK_N=16, BLOCK_V=64, BLOCK_D=32, IEEE=dtype != torch.float16, tiles_per_split=4)
    if ieee:
        return dict(BLOCK_N=64, BLOCK_V=64, BLOCK_D=32, IEEE=True, num_warps=4, num_stages=2, tiles_per_split=32)
    return dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, IEEE=False, num_warps=8, num_stages=3, tiles_per_split=16)


# On the GPU the row-block size, warps and pipeline depth are autotuned per (V, D, dtype)
# (FASTPO_TRITON_AUTOTUNE=0 turns it off). BLOCK_V and BLOCK_D stay fixed: they set the
# summation order over the hidden size and the vocabulary splits, which must not change
# between the old-log-prob pass and the update (ratio exactly 1 on policy).
AUTOTUNE = not INTERPRET and os.environ.get("FASTPO_TRITON_AUTOTUNE", "1") != "0"
_TUNE_CONFIGS = {
    False: [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bn, w, st in ((128, 8, 3), (128, 8, 4), (64, 4, 4))],
    True: [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st) for bn, w, st in ((64, 4, 2), (32, 4, 3))],
}
_tuned: dict = {}


def _kernel(name: str, ieee: bool):
    """The plain kernel, or its autotuned wrapper on the GPU."""
    base = {"fwd": _fwd_kernel, "dlogits": _dlogits_kernel}[name]
    if not AUTOTUNE:
        return base
    if (name, ieee) not in _tuned:
        _tuned[name, ieee] = triton.autotune(configs=_TUNE_CONFIGS[ieee], key=["V", "D"])(base)
    return _tuned[name, ieee]


def _launch_opts(cfg: dict) -> dict:
    """Kernel keyword arguments: all of cfg, or what autotuning leaves to the caller."""
    drop = {"tiles_per_split"} | ({"BLOCK_N", "num_warps", "num_stages"} if AUTOTUNE else set())
    return {k: v for k, v in cfg.items() if k not in drop}


def _check(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if hidden.dtype == torch.float64 or weight.dtype == torch.float64:
        raise TypeError("the Triton path takes bf16/fp16/fp32 inputs, got float64 (use impl='chunked')")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"the Triton path needs hidden and weight of one dtype, got {hidden.dtype} and {weight.dtype}")


@torch.no_grad()
def triton_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(logprob [N], entropy [N], lse [N]) fp32 of softmax(hidden @ weight.T / T); no logits held.

    hidden [N, H] and weight [V, H] contiguous, same dtype (bf16/fp16/fp32); targets [N] int64.
    """
    _check(hidden, weight)
    n, d = hidden.shape
    v = weight.shape[0]
    cfg = _config(hidden.dtype)
    n_tiles = triton.cdiv(v, cfg["BLOCK_V"])
    tps = min(cfg["tiles_per_split"], n_tiles)
    n_splits = triton.cdiv(n_tiles, tps)
    part = torch.empty(4, n_splits, n, dtype=torch.float32, device=hidden.device)
    if n:
        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]), n_splits)

        _kernel("fwd", cfg["IEEE"])[grid](hidden, weight, targets, part, n, v, d, hidden.stride(0),
                                          weight.stride(0), 1.0 / temperature, tps, **_launch_opts(cfg))
    out = torch.empty(3, n, dtype=torch.float32, device=hidden.device)
    if n:
        _combine_kernel[(triton.cdiv(n, 128),)](part, out[0], out[1], out[2], n, n_splits, BLOCK=128)
    return out[0], out[1], out[2]


def slice_columns(n: int, v: int, block_v: int, itemsize: int, chunk_bytes: int | None = None) -> int:
    """Vocabulary columns per backward slice (a multiple of block_v, at least one tile, at
    most the padded V) for an [n, slice] dlogits buffer of `itemsize`-byte entries, evened
    out so that the last slice is not a sliver. chunk_bytes: an explicit budget; default
    min(BWD_CHUNK_BYTES, max(BWD_CHUNK_MIN_BYTES, n * v * itemsize / BWD_CHUNK_FRACTION))."""
    if chunk_bytes is None:
        budget = min(BWD_CHUNK_BYTES, max(BWD_CHUNK_MIN_BYTES, n * v * itemsize // BWD_CHUNK_FRACTION))
    else:
        budget = int(chunk_bytes)
    per_col = max(1, n) * itemsize
    cols = min(max(block_v, budget // per_col // block_v * block_v), triton.cdiv(v, block_v) * block_v)
    n_slices = triton.cdiv(v, cols)
    return triton.cdiv(triton.cdiv(v, n_slices), block_v) * block_v


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result (bf16 GEMM with fp32 output where torch has it)."""
    if a.dtype != b.dtype:
        return torch.mm(a.float(), b.float())
    if a.dtype in (torch.bfloat16, torch.float16):
        if a.is_cuda:
            try:
                return torch.mm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError, NotImplementedError):
                pass
        return torch.mm(a.float(), b.float())
    return torch.mm(a, b)


@torch.no_grad()
def triton_grads(hidden, weight, targets, lse, entropy, g_lp, g_ent, temperature: float = 1.0,
                 need_hidden: bool = True, need_weight: bool = True, chunk_bytes: int | None = None):
    """(d hidden [N, H] fp32 or None, d weight [V, H] in weight's dtype or None).

    lse, entropy [N] fp32 from `triton_stats`; g_lp, g_ent [N] upstream gradients of
    log-prob and entropy. The vocabulary is processed in slices whose [N, slice] dlogits
    buffer fits `chunk_bytes` (default: see `slice_columns`).
    """
    _check(hidden, weight)
    n, d = hidden.shape
    v = weight.shape[0]
    cfg = _config(hidden.dtype)
    bv = cfg["BLOCK_V"]
    # bf16 dlogits like bf16 autograd; fp16's narrow range could flush small gradients: fp32
    buf_dtype = torch.bfloat16 if hidden.dtype == torch.bfloat16 else torch.float32
    v_chunk = slice_columns(n, v, bv, torch.tensor([], dtype=buf_dtype).element_size(), chunk_bytes)
    dh = torch.zeros(n, d, dtype=torch.float32, device=hidden.device) if need_hidden else None
    dw = torch.empty_like(weight) if need_weight else None
    if n == 0:
        if need_weight:
            dw.zero_()
        return dh, dw
    lse, entropy = lse.float().contiguous(), entropy.float().contiguous()
    g_lp, g_ent = g_lp.float().contiguous(), g_ent.float().contiguous()
    buf = torch.empty(n, v_chunk, dtype=buf_dtype, device=hidden.device)
    kernel = _kernel("dlogits", cfg["IEEE"])
    for v0 in range(0, v, v_chunk):
        vl = min(v_chunk, v - v0)

        def grid(meta, vl=vl):
            return (triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(vl, bv),)

        kernel[grid](hidden, weight, targets, lse, entropy, g_lp, g_ent, buf, n, v, d, v0, vl,
                     hidden.stride(0), weight.stride(0), buf.stride(0), 1.0 / temperature, **_launch_opts(cfg))
        dl = buf[:, :vl]
        w_sl = weight[v0:v0 + vl]
        if need_hidden:
            dh += _mm_f32(dl, w_sl)
        if need_weight:
            # one GEMM over all tokens with an fp32 result, a single rounding to weight's dtype
            dw[v0:v0 + vl] = _mm_f32(dl.T, hidden)
    return dh, dw
