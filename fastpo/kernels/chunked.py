"""Chunked PyTorch path: bounded memory, no Triton; what runs on the CPU.

Tokens are processed in chunks of C rows, so at most a few [C, V] buffers exist at a time
(C is chosen from a byte budget). Logits are computed in fp32 (fp64 for fp64 inputs).

Three entry points, shared by the autograd functions in `fastpo.kernels.api`:
* `chunked_stats`: log-prob, entropy and log-sum-exp per token (forward, no graph);
* `chunked_grads`: given per-token upstream gradients of log-prob and entropy, recompute
  each chunk's logits and return d hidden and d weight (backward of the generic function);
* `chunked_fused`: one pass that, per chunk, computes the logits once, the log-prob and
  entropy, asks `coef_fn` for the loss's per-token gradient (it is elementwise) and forms
  d hidden and d weight right away (the policy loss: three matmuls, like naive autograd,
  but with chunk-sized buffers).

Gradient of one token with respect to its scaled logits z = logits / T, p = softmax(z):
  d logprob / dz_v = 1[v = target] - p_v
  d entropy / dz_v = -p_v (log p_v + entropy)          (the "z - E[z]" form: no log(0))
and d / d logits = (1/T) d / dz.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from . import cpu_rows
from .torch_reference import zero_rows

# Bytes of [C, V] buffers a chunk may hold: two of 64 MiB for the eager stages (logits and
# p), or one of 128 MiB where the compiled CPU stages work in place on the logits (more rows
# per GEMM: 672 instead of 336 at V = 49152, the GEMMs then within a few % of whole-batch ones)
CHUNK_BUFFER_BYTES = 128 * 1024 * 1024
# GEMMs with fewer rows than this lose much of their speed on CPUs
MIN_CHUNK_ROWS = 256
# The elementwise stages between a chunk's GEMMs (about ten passes over [C, V]) run over
# blocks of rows of about this size (a row at a 49k vocabulary; with its two buffers within a
# core's L2), so that a block's passes after the first hit the cache instead of memory (the
# rows are independent: the same numbers but for the entropy's row dot, which a batched dot
# over one row rounds in another order, about 1e-7 relative; docs/kernels_compile.md)
ELEMENTWISE_BLOCK_BYTES = 256 * 1024

CoefFn = Callable[[slice, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _lowp_gpu(weight: torch.Tensor) -> bool:
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


# torch's CUDA out-of-memory error (torch.OutOfMemoryError, a RuntimeError, since torch 2.5)
OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
# Device type -> whether torch.mm(half, half, out_dtype=torch.float32) works there (unknown:
# try it once). The CPU build lacks it.
_MM_OUT_DTYPE: dict[str, bool] = {"cpu": False}


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with an fp32 result (into `out` [M, N] fp32 when given).

    bf16/fp16 operands of one dtype: one GEMM with fp32 output (torch.mm(out_dtype=)) where
    this torch has it, else fp32 copies of both operands (more memory; warned once). An
    out-of-memory error is raised as is, never taken for a missing feature: the fp32-copy
    route would need more memory still.
    """
    half = a.dtype in (torch.bfloat16, torch.float16)
    if half and a.dtype == b.dtype and _MM_OUT_DTYPE.get(a.device.type, True):
        try:
            if out is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except OutOfMemoryError:
            raise
        except (RuntimeError, TypeError, NotImplementedError) as e:
            _MM_OUT_DTYPE[a.device.type] = False
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            warnings.warn(f"fastpo.kernels: torch.mm(..., out_dtype=torch.float32) does not work for {a.dtype} on "
                          f"{a.device.type} here ({type(e).__name__}: {first}); fp32 copies of the operands are "
                          "multiplied instead (more memory and time; warned once)", RuntimeWarning, stacklevel=2)
    if a.dtype != b.dtype or half:
        a, b = a.float(), b.float()
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)


def chunk_rows(n_vocab: int, chunk_size: int | None, itemsize: int = 4, buffers: int = 2,
               n_tokens: int | None = None) -> int:
    """Tokens per chunk: `chunk_size` if given, else what fits CHUNK_BUFFER_BYTES in `buffers`
    [C, V] buffers, but at least MIN_CHUNK_ROWS; with `n_tokens`, the same number of chunks
    made even (2048 tokens in 672-row chunks: four of 512, not three and one of 32 that would
    stream W and d W once more for a few rows)."""
    if chunk_size is not None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return int(chunk_size)
    rows = max(MIN_CHUNK_ROWS, CHUNK_BUFFER_BYTES // max(1, buffers) // max(1, n_vocab * itemsize) // 16 * 16)
    if n_tokens:
        chunks = _ceil_div(int(n_tokens), rows)
        rows = min(rows, _ceil_div(_ceil_div(int(n_tokens), chunks), 16) * 16)
    return rows


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _buffers(hidden: torch.Tensor) -> int:
    """[C, V] buffers a chunk needs: one where the compiled CPU stages (`cpu_rows`) take it."""
    return 1 if hidden.device.type == "cpu" and _compute_dtype(hidden) == torch.float32 \
        and cpu_rows.status() == "ok" else 2


class _Prepared:
    """Weight in the compute dtype (once per call) and the GEMMs of one chunk."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, rows: int):
        self.cd = _compute_dtype(hidden)
        self.lowp = _lowp_gpu(weight) and hidden.dtype == weight.dtype
        self.w = weight if self.lowp else weight.to(self.cd)
        # [C, V] buffers reused by every chunk: logits / log p, and p / dlogits (made on first
        # use: the compiled CPU stages work in place on the logits and need only the first)
        self.shape = (max(1, min(rows, hidden.shape[0])), weight.shape[0])
        self.zbuf = torch.empty(self.shape, dtype=self.cd, device=hidden.device)
        self.pbuf: torch.Tensor | None = None

    def h(self, h_c: torch.Tensor) -> torch.Tensor:
        return h_c if self.lowp else h_c.to(self.cd)

    def logits(self, h_c: torch.Tensor, inv_t: float = 1.0) -> torch.Tensor:
        """(h_c / T) @ W.T into the z buffer (fp32/fp64: the temperature scales the small operand)."""
        out = self.zbuf[: h_c.shape[0]]
        if not self.lowp:
            return torch.mm(h_c * inv_t if inv_t != 1.0 else h_c, self.w.T, out=out)
        mm_f32(h_c, self.w.T, out=out)
        return out.mul_(inv_t) if inv_t != 1.0 else out  # scaling bf16 inputs would round them

    def p(self, rows: int) -> torch.Tensor:
        if self.pbuf is None:
            self.pbuf = torch.empty(self.shape, dtype=self.cd, device=self.zbuf.device)
        return self.pbuf[:rows]

    def grads(self, dz: torch.Tensor, h_c: torch.Tensor, dw: torch.Tensor | None, need_h: bool,
              first: bool = False, out_h: torch.Tensor | None = None):
        """dz @ W for one chunk (None unless need_h; written into `out_h`, the chunk's rows of d
        hidden, where given: by the GEMM itself when the dtypes match); adds dz.T @ h into the
        accumulator dw in place (`first`: writes it instead, so dw may start uninitialised: no
        zero fill of [V, H])."""
        d = dz.to(self.w.dtype) if self.lowp else dz
        if not need_h:
            dh = None
        elif out_h is not None and out_h.dtype == d.dtype:
            dh = torch.mm(d, self.w, out=out_h)
        else:
            dh = torch.mm(d, self.w)
            if out_h is not None:
                dh = out_h.copy_(dh)
        if dw is not None:
            if self.lowp:
                if first:
                    mm_f32(d.T, h_c, out=dw)
                else:
                    dw += mm_f32(d.T, h_c)
            elif first:
                torch.mm(d.T, h_c, out=dw)
            else:
                dw.addmm_(d.T, h_c)
        return dh


def _dw_buffer(weight: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
    """The d weight accumulator [V, H]: left uninitialised when a first chunk will write it
    (`_Prepared.grads(first=True)`), zeros when there are no tokens."""
    make = torch.empty if n > 0 else torch.zeros
    return make(weight.shape, dtype=dtype, device=weight.device)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) for [C, V] tensors without a [C, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _softmax_stats(z: torch.Tensor, t: torch.Tensor, p: torch.Tensor):
    """In place: z (scaled logits [C, V]) becomes log p; p (a buffer) becomes exp(z - max),
    the softmax times s (the division by s is folded into later per-row factors).
    Returns (logp, p, s [C], lse [C], entropy [C], logprob [C]); no [C, V] temporaries.
    """
    m = z.amax(dim=-1, keepdim=True)
    z.sub_(m)
    torch.exp(z, out=p)
    s = p.sum(-1)
    log_s = s.log()
    logp = z.sub_(log_s.unsqueeze(-1))
    entropy = -_rowdot(p, logp) / s
    logprob = logp.gather(1, t.unsqueeze(-1)).squeeze(-1)
    return logp, p, s, m.squeeze(-1) + log_s, entropy, logprob


def _block_rows(z: torch.Tensor) -> int:
    """Rows per elementwise block of the [C, V] chunk `z` (ELEMENTWISE_BLOCK_BYTES; CPU only: on
    a GPU each block would be more kernel launches for no gain)."""
    if z.device.type != "cpu":
        return z.shape[0]
    return max(1, ELEMENTWISE_BLOCK_BYTES // max(1, z.shape[1] * z.element_size()))


def _softmax_stats_blocked(z: torch.Tensor, t: torch.Tensor, p: torch.Tensor):
    """`_softmax_stats` over blocks of rows (`_block_rows`); the same results up to the rounding
    of the entropy's row dots (a batched dot of one row sums in another order)."""
    r, c = _block_rows(z), z.shape[0]
    if r >= c:
        return _softmax_stats(z, t, p)
    out = torch.empty(4, c, dtype=z.dtype, device=z.device)  # s, lse, entropy, logprob
    for a in range(0, c, r):
        b = min(c, a + r)
        _, _, s_b, lse_b, ent_b, lp_b = _softmax_stats(z[a:b], t[a:b], p[a:b])
        out[0, a:b], out[1, a:b], out[2, a:b], out[3, a:b] = s_b, lse_b, ent_b, lp_b
    return z, p, out[0], out[1], out[2], out[3]


def _no_entropy(g_ent: torch.Tensor) -> bool:
    """No entropy term in the loss (every d loss / d entropy is 0): `_dz_`'s one-pass form.
    Checked on the CPU only: on a GPU the check would be a device sync per chunk."""
    return g_ent.device.type == "cpu" and not bool(g_ent.any())


def _dz_blocked(p, logp, t, ent, g_lp, g_ent, inv_t: float, s=None) -> torch.Tensor:
    """`_dz_` over blocks of rows (`_block_rows`); the same result, in place on p. Without an
    entropy term `_dz_` is one pass over p: then over the whole chunk (blocks would only add
    per-call overhead)."""
    r, c = _block_rows(p), p.shape[0]
    no_ent = _no_entropy(g_ent)
    if r >= c or no_ent:
        return _dz_(p, logp, t, ent, g_lp, g_ent, inv_t, s, no_entropy=no_ent)
    for a in range(0, c, r):
        b = min(c, a + r)
        _dz_(p[a:b], logp[a:b], t[a:b], ent[a:b], g_lp[a:b], g_ent[a:b], inv_t, None if s is None else s[a:b],
             no_entropy=no_ent)
    return p


def _dz_from_lse(z, lse, p, t, ent, g_lp, g_ent, inv_t: float) -> torch.Tensor:
    """d loss / d logits of a chunk whose scaled logits `z` (in place: log p) and log-sum-exp are
    known, into the buffer `p`, over blocks of rows (`_block_rows`)."""
    r, c = _block_rows(z), z.shape[0]
    no_ent = _no_entropy(g_ent)
    for a in range(0, c, r):
        b = min(c, a + r)
        logp = z[a:b].sub_(lse[a:b].unsqueeze(-1))
        _dz_(torch.exp(logp, out=p[a:b]), logp, t[a:b], ent[a:b], g_lp[a:b], g_ent[a:b], inv_t, no_entropy=no_ent)
    return p


def _dz_(p: torch.Tensor, logp: torch.Tensor, t: torch.Tensor, ent: torch.Tensor, g_lp: torch.Tensor,
         g_ent: torch.Tensor, inv_t: float, s: torch.Tensor | None = None,
         no_entropy: bool | None = None) -> torch.Tensor:
    """In place on p (and logp): d loss / d logits of a chunk from per-token upstream gradients.

    dz = -softmax * (g_lp + g_ent (log p + H)) + g_lp 1[target], times 1/T; with softmax =
    p / s, that is p * (a log p + b) with per-row a = -g_ent / (s T), b = -(g_lp + g_ent H) / (s T).
    """
    scale = inv_t if s is None else inv_t / s
    b = (-(g_lp + g_ent * ent) * scale).unsqueeze(-1)
    if no_entropy is None:
        no_entropy = _no_entropy(g_ent)
    if no_entropy:  # entropy_coef 0: dz = p * b, two [C, V] passes fewer
        dz = p.mul_(b)
    else:
        a = (-g_ent * scale).unsqueeze(-1)
        # (torch.addcmul would fuse the two passes but rounds differently; no gain was measured)
        dz = p.mul_(logp.mul_(a).add_(b))
    dz.scatter_add_(1, t.unsqueeze(-1), (g_lp * inv_t).unsqueeze(-1))
    return dz


@torch.no_grad()
def chunked_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob [N], entropy [N], lse [N]) in the compute dtype; lse is of the scaled logits."""
    n = hidden.shape[0]
    c = chunk_rows(weight.shape[0], chunk_size, buffers=_buffers(hidden), n_tokens=n)
    prep = _Prepared(hidden, weight, c)
    out = torch.empty(3, n, dtype=prep.cd, device=hidden.device)
    inv_t = 1.0 / temperature
    for s in range(0, n, c):
        e = min(n, s + c)
        z = prep.logits(prep.h(hidden[s:e]), inv_t)
        if cpu_rows.usable(z, targets[s:e]):
            lse, ent, lp = cpu_rows.row_stats(z, targets[s:e])
        else:
            _, _, _, lse, ent, lp = _softmax_stats_blocked(z, targets[s:e], prep.p(e - s))
        out[0, s:e], out[1, s:e], out[2, s:e] = lp, ent, lse
    return out[0], out[1], out[2]


@torch.no_grad()
def chunked_grads(hidden, weight, targets, lse, entropy, g_lp, g_ent, temperature: float = 1.0,
                  chunk_size: int | None = None, need_hidden: bool = True, need_weight: bool = True):
    """d hidden [N, H] (hidden's dtype) and d weight [V, H] (fp32/fp64 accumulator), or None.

    g_lp, g_ent [N]: upstream gradients of log-prob and entropy; lse, entropy [N] from
    `chunked_stats`. Recomputes each chunk's logits.
    """
    n = hidden.shape[0]
    c = chunk_rows(weight.shape[0], chunk_size, buffers=_buffers(hidden), n_tokens=n)
    prep = _Prepared(hidden, weight, c)
    inv_t = 1.0 / temperature
    dh = torch.empty_like(hidden) if need_hidden else None
    dw = _dw_buffer(weight, prep.cd, n) if need_weight else None
    for s in range(0, n, c):
        e = min(n, s + c)
        h_c = prep.h(hidden[s:e])
        z = prep.logits(h_c, inv_t)
        if cpu_rows.usable(z, targets[s:e]):
            dz = cpu_rows.row_dz_(z, targets[s:e], lse[s:e], entropy[s:e], g_lp[s:e], g_ent[s:e], inv_t)
        else:
            dz = _dz_from_lse(z, lse[s:e].to(z.dtype), prep.p(e - s), targets[s:e], entropy[s:e].to(z.dtype),
                              g_lp[s:e].to(z.dtype), g_ent[s:e].to(z.dtype), inv_t)
        prep.grads(dz, h_c, dw, need_hidden, first=s == 0, out_h=dh[s:e] if need_hidden else None)
    return dh, dw


@torch.no_grad()
def chunked_fused(hidden, weight, targets, temperature: float, coef_fn: CoefFn | None,
                  chunk_size: int | None = None, need_hidden: bool = True, need_weight: bool = True,
                  grad_rows: torch.Tensor | None = None):
    """One pass: (logprob [N], entropy [N], d hidden or None, d weight or None).

    coef_fn(rows: slice, logprob_chunk, entropy_chunk) -> (g_lp, g_ent) gives the upstream
    gradient of the loss for those tokens; it must be elementwise in the tokens. With
    coef_fn None only the forward is done. grad_rows [N] bool (default: all): rows outside
    it get exactly zero d hidden and stay out of d weight, even when their hidden state is
    not finite (masked-out padding); their log-prob and entropy are still computed.
    """
    n = hidden.shape[0]
    c = chunk_rows(weight.shape[0], chunk_size, buffers=_buffers(hidden), n_tokens=n)
    prep = _Prepared(hidden, weight, c)
    inv_t = 1.0 / temperature
    stats = torch.empty(2, n, dtype=prep.cd, device=hidden.device)
    grad = coef_fn is not None and (need_hidden or need_weight)
    dh = torch.empty_like(hidden) if grad and need_hidden else None
    dw = _dw_buffer(weight, prep.cd, n) if grad and need_weight else None
    for s in range(0, n, c):
        e = min(n, s + c)
        h_c = prep.h(hidden[s:e])
        z = prep.logits(h_c, inv_t)
        fast = cpu_rows.usable(z, targets[s:e])
        if fast:  # the gradient is formed in place on z, from the exp the statistics leave there
            rs = cpu_rows.row_stats(z, targets[s:e], store_exp=grad)
            _, ent, lp = rs
        else:
            logp, p, s_row, _, ent, lp = _softmax_stats_blocked(z, targets[s:e], prep.p(e - s))
        stats[0, s:e], stats[1, s:e] = lp, ent
        if not grad:
            continue
        g_lp, g_ent = coef_fn(slice(s, e), lp, ent)
        if fast:
            dz = cpu_rows.row_dz_(z, targets[s:e], rs, ent, g_lp, g_ent, inv_t)
        else:
            dz = _dz_blocked(p, logp, targets[s:e], ent, g_lp.to(z.dtype), g_ent.to(z.dtype), inv_t, s_row)
        if grad_rows is not None:
            # 0 * NaN is NaN: a non-finite excluded row must be zeroed, not weighted by 0
            # (masked_fill_/where, not nonzero(): no device sync per chunk on CUDA)
            keep = grad_rows[s:e, None]
            if dz.device.type == "cpu":  # only the excluded rows, not a pass over all of dz
                dz.index_fill_(0, (~keep).view(-1).nonzero().view(-1), 0.0)
            else:
                dz.masked_fill_(~keep, 0.0)
            h_c = zero_rows(h_c, keep)
        prep.grads(dz, h_c, dw, need_hidden, first=s == 0, out_h=dh[s:e] if need_hidden else None)
    return stats[0], stats[1], dh, dw
