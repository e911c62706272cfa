"""Public functions of `fastpo.kernels` and the dispatcher between implementations.

impl="reference": materialized fp32 logits (`fastpo.kernels.torch_reference`), for tests.
impl="chunked":   bounded-memory PyTorch (`fastpo.kernels.chunked`), any device.
impl="triton":    fused Triton kernels (`fastpo.kernels._triton`), CUDA tensors (or CPU
                  tensors under TRITON_INTERPRET=1, set before the first Triton call).
impl="auto":      triton on CUDA tensors when Triton imports (and its kernels pass a probe
                  on a tiny problem), chunked elsewhere.

Out of memory (torch.OutOfMemoryError) on the Triton path is handled per call, whatever
`impl`: cached blocks are freed and the call is retried in smaller pieces (row chunks in
the forward, which give bitwise the same log-probs; smaller vocabulary slices in the
backward), warning once with the shape; when the smallest pieces still do not fit, the
error is raised. It never moves a run to another implementation, so old log-probs and
the update's come from the same kernels (on-policy ratio exactly 1).
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from . import chunked as _chunked
from .chunked import OutOfMemoryError
from .losses import PolicyLossSettings, policy_loss
from .torch_reference import (aggregate, aggregation_weights, policy_loss_terms, policy_metrics, reference_logprob_entropy,
                        reference_policy_loss, sequence_log_ratio, zero_rows)

IMPLS = ("auto", "triton", "chunked", "reference")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_triton_error: str | None = None


def _triton_module():
    """The Triton implementation, imported on first use (triton is optional)."""
    # triton (optional): imported on the Triton path's first use
    from . import _triton

    return _triton


def triton_available() -> bool:
    """True when `triton` imports (it does not say that a GPU is present)."""
    global _triton_error
    try:
        _triton_module()
        return True
    except Exception as e:  # ImportError, or a broken triton install
        _triton_error = f"{type(e).__name__}: {e}"
        return False


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The implementation `impl` means for tensors on `device` (of `dtype`); ValueError on a bad name.

    "auto" -> "triton" on CUDA when Triton imports, the dtype is not float64 and the kernels
    passed their probe there (run once per device and dtype, see `_triton.probe`; a failure
    warns and makes "auto" mean "chunked" for the rest of the process), else "chunked". "triton" on a CPU tensor is allowed only under the Triton interpreter
    (TRITON_INTERPRET=1 set before fastpo.kernels first used Triton), for tests.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        ok = device.type == "cuda" and dtype != torch.float64 and _triton_failed is None and triton_available()
        return "triton" if ok and _triton_ready(device, dtype or torch.bfloat16) else "chunked"
    if impl == "triton":
        if not triton_available():
            raise ValueError(f"impl='triton' but triton cannot be imported ({_triton_error})")
        if device.type != "cuda" and not _triton_module().INTERPRET:
            raise ValueError(f"impl='triton' needs CUDA tensors (got device {device}), or the Triton interpreter: "
                             "TRITON_INTERPRET=1 set before fastpo.kernels first uses Triton")
    return impl


def _check_linear(hidden, weight, targets, temperature) -> None:
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"hidden and weight must be tensors, got {type(hidden).__name__} and {type(weight).__name__}")
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden {tuple(hidden.shape)} vs weight {tuple(weight.shape)}")
    if hidden.dtype not in _FLOATS or weight.dtype not in _FLOATS:
        raise TypeError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must have shape [N]={hidden.shape[0]}, got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError(f"hidden, weight and targets must share a device, got {hidden.device}, {weight.device}, "
                         f"{targets.device}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if targets.numel() and bool(((targets < 0) | (targets >= weight.shape[0])).any()):
        bad = targets[(targets < 0) | (targets >= weight.shape[0])][0].item()
        raise ValueError(f"targets must lie in [0, V={weight.shape[0]}), found {bad}")


def _harmonize(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One dtype for both (autograd-tracked casts): autocast's dtype inside an autocast region
    (what the LM head's matmul would use there), else the wider of the two."""
    dev = hidden.device.type
    try:
        auto = torch.is_autocast_enabled(dev)
    except TypeError:  # torch without the device argument
        auto = dev == "cuda" and torch.is_autocast_enabled()
    if auto and hidden.dtype != torch.float64 and weight.dtype != torch.float64:
        dt = torch.get_autocast_dtype(dev)
    elif hidden.dtype != weight.dtype:
        dt = torch.promote_types(hidden.dtype, weight.dtype)
    else:
        return hidden, weight
    return hidden.to(dt), weight.to(dt)


def _no_autocast(device: torch.device):
    """The kernels choose their own precision (fp32 logits); autocast must not recast their GEMMs."""
    return torch.autocast(device_type=device.type, enabled=False)


# "triton-auto": Triton chosen by impl="auto". Before auto first chooses Triton for a (device,
# dtype), both kernels run once on a tiny problem and are checked against the chunked path
# (`_triton.probe`); if that fails (a Triton/driver combination never run, a miscompile),
# fastpo warns once and auto uses the chunked path for the whole run, before any log-prob
# exists. A kernel failing later (after the probe passed) still falls back from then on,
# rather than stopping a training run. Out-of-memory errors never fall back (see the module
# docstring). impl="triton" never falls back.
_triton_failed: str | None = None
_probed: set = set()
# Each retry after an out-of-memory error takes a quarter of the rows (forward) or of the
# dlogits slice (backward); after OOM_RETRIES retries the error is raised.
OOM_RETRIES = 4
_oom_warned = False


def _auto_impl(impl_arg: str, impl: str) -> str:
    return "triton-auto" if impl_arg == "auto" and impl == "triton" else impl


def _give_up_triton(e: Exception, when: str) -> None:
    global _triton_failed
    _triton_failed = f"{type(e).__name__}: {e}"
    warnings.warn(f"fastpo.kernels: the Triton kernels failed{when} ({_triton_failed}); impl='auto' uses the "
                  "chunked PyTorch path from now on", RuntimeWarning, stacklevel=4)


def _triton_ready(device: torch.device, dtype: torch.dtype) -> bool:
    """impl='auto': True when the Triton kernels passed their probe on (device, dtype) (run
    once); False, with a warning, when it failed. Out-of-memory errors propagate."""
    key = (str(device), dtype)
    if key in _probed:
        return _triton_failed is None
    try:
        _triton_module().probe(device, dtype)
    except OutOfMemoryError:
        raise
    except Exception as e:
        _give_up_triton(e, f" their probe on {device} in {dtype}")
        return False
    _probed.add(key)
    return _triton_failed is None


def _with_fallback(impl, triton_call, chunked_call):
    if impl == "triton" or (impl == "triton-auto" and _triton_failed is None):
        try:
            return triton_call()
        except OutOfMemoryError:
            raise  # handled per call inside triton_call; never a reason to switch implementations
        except Exception as e:
            if impl == "triton":
                raise
            _give_up_triton(e, "")
    return chunked_call()


def _retry_smaller(what: str, hidden: torch.Tensor, weight: torch.Tensor, attempt):
    """attempt(level) for level 0 (full size), 1, 2, ...: after an out-of-memory error, free
    the cached blocks and retry at the next level (smaller pieces), warning once with the
    shape; raise the error after OOM_RETRIES retries."""
    global _oom_warned
    for level in range(OOM_RETRIES + 1):
        try:
            return attempt(level)
        except OutOfMemoryError as e:
            if level == OOM_RETRIES:
                raise
            why = (str(e).strip().splitlines() or [""])[0][:200]
        # out of the except block: the failed attempt's tensors went with its traceback
        if hidden.is_cuda:
            torch.cuda.empty_cache()
        if not _oom_warned:
            _oom_warned = True
            warnings.warn(f"fastpo.kernels: out of memory in the Triton {what} at N={hidden.shape[0]}, "
                          f"H={hidden.shape[1]}, V={weight.shape[0]} ({hidden.dtype}): {why}. Retrying this call "
                          "in smaller pieces (each call starts at full size again; the implementation does not "
                          "change). Warned once.", RuntimeWarning, stacklevel=5)


def _triton_stats_retrying(hidden, weight, targets, temperature):
    tr = _triton_module()
    n = hidden.shape[0]
    return _retry_smaller("forward", hidden, weight, lambda level: tr.triton_stats(
        hidden, weight, targets, temperature, max_rows=None if level == 0 else -(-n // 4 ** level)))


def _triton_grads_retrying(hidden, weight, targets, lse, ent, g_lp, g_ent, temperature, need_h, need_w):
    tr = _triton_module()
    full = tr.dlogits_slice_bytes(hidden.shape[0], weight.shape[0], hidden.dtype)
    return _retry_smaller("backward", hidden, weight, lambda level: tr.triton_grads(
        hidden, weight, targets, lse, ent, g_lp, g_ent, temperature, need_h, need_w,
        chunk_bytes=None if level == 0 else max(1, full // 4 ** level)))


def _stats(impl, hidden, weight, targets, temperature, chunk_size):
    return _with_fallback(
        impl, lambda: _triton_stats_retrying(hidden, weight, targets, temperature),
        lambda: _chunked.chunked_stats(hidden, weight, targets, temperature, chunk_size))


def _grads(impl, hidden, weight, targets, lse, ent, g_lp, g_ent, temperature, chunk_size, need_h, need_w):
    return _with_fallback(
        impl, lambda: _triton_grads_retrying(hidden, weight, targets, lse, ent, g_lp, g_ent, temperature, need_h,
                                             need_w),
        lambda: _chunked.chunked_grads(hidden, weight, targets, lse, ent, g_lp, g_ent, temperature, chunk_size,
                                       need_h, need_w))


class _LogprobEntropyFunction(torch.autograd.Function):
    """Forward: log-prob, entropy (and log-sum-exp, saved). Backward: recompute logits per tile."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, impl, chunk_size):
        with _no_autocast(hidden.device):
            lp, ent, lse = _stats(impl, hidden, weight, targets, temperature, chunk_size)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.impl, ctx.chunk_size = temperature, impl, chunk_size
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with _no_autocast(hidden.device):
            dh, dw = _grads(ctx.impl, hidden, weight, targets, lse, ent, g_lp.to(lse.dtype), g_ent.to(lse.dtype),
                            ctx.temperature, ctx.chunk_size, need_h, need_w)
        dh = dh.to(hidden.dtype) if need_h else None
        dw = dw.to(weight.dtype) if need_w else None
        return dh, dw, None, None, None, None


def linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    impl: str = "auto",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob and entropy of softmax(hidden @ weight.T / temperature), fused.

    hidden [N, H] bf16/fp16/fp32 (fp64 on the chunked and reference paths), weight [V, H]
    (the LM head), targets [N] int64 in [0, V). Returns (logprob [N], entropy [N]) in fp32
    (fp64 for fp64 inputs), in nats, without materializing the [N, V] logits (except
    impl="reference"). Both outputs are differentiable with respect to hidden and weight;
    the backward recomputes the logits tile by tile (no logits are kept).
    `chunk_size`: tokens per chunk on the chunked path (default: 64 MiB per [chunk, V] fp32
    buffer, at least 256 rows).
    Raises ValueError/TypeError naming a bad shape, dtype, device, target, temperature or
    impl.
    """
    _check_linear(hidden, weight, targets, temperature)
    hidden, weight = _harmonize(hidden, weight)
    impl = _auto_impl(impl, resolve_impl(impl, hidden.device, hidden.dtype))
    if impl == "reference":
        return reference_logprob_entropy(hidden, weight, targets, temperature)
    return _LogprobEntropyFunction.apply(hidden.contiguous(), weight.contiguous(), targets.long().contiguous(),
                                         float(temperature), impl, chunk_size)


@dataclasses.dataclass
class PolicyLossOutput:
    """Result of `linear_policy_loss` / `causal_lm_policy_loss`.

    loss: scalar fp32, differentiable with respect to hidden and weight (the model).
    logprob, entropy: per-token fp32, detached ([N], or [B, T] from the causal-LM adapter
    with 0 where not computed). metrics: detached floats (see `policy_metrics`).
    """

    loss: torch.Tensor
    logprob: torch.Tensor
    entropy: torch.Tensor
    metrics: dict[str, float]


class _PolicyLossFunction(torch.autograd.Function):
    """Forward computes the loss and, when a gradient is needed, d hidden and d weight too
    (the loss's gradient with respect to log-prob and entropy is elementwise, so it is known
    as soon as a token's log-prob and entropy are); backward only scales them, in place.

    So the gradients ([N, H] and a full [V, H]) are held from the forward until backward,
    and a backward can run once (retain_graph=True and a second backward raise autograd's
    "modified by an inplace operation" error rather than return a twice-scaled gradient).
    """

    @staticmethod
    def forward(ctx, hidden, weight, run, box):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with _no_autocast(hidden.device):
            loss, lp, ent, dh, dw, box["metrics"] = run(need_h, need_w)
        # saved tensors (not ctx attributes) so that autograd frees them after backward
        ctx.save_for_backward(dh.to(hidden.dtype) if need_h else None, dw.to(weight.dtype) if need_w else None)
        ctx.mark_non_differentiable(lp, ent)
        return loss, lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss, _g_lp, _g_ent):
        dh, dw = ctx.saved_tensors
        # The tensors are private to this call: scale in place (no second [V, H] tensor). On the
        # CPU, skipping the usual factor 1 is free; on CUDA the check would be a device sync.
        if not (g_loss.device.type == "cpu" and g_loss.item() == 1.0):
            for g in (dh, dw):
                if g is not None:
                    g.mul_(g_loss)
        return dh, dw, None, None


def _check_vec(name, x, n, device, allow_none=False):
    if x is None:
        if allow_none:
            return
        raise ValueError(f"{name} is required, got None")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.shape != (n,):
        raise ValueError(f"{name} must have shape [N]={n}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, hidden on {device}")


def _check_int(name, x) -> None:
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")


def _check_mask(loss_mask: torch.Tensor) -> None:
    """A loss mask is a weight per token: finite and >= 0 (a negative weight would flip the
    token's gradient; NaN would silently drop it)."""
    if loss_mask.dtype == torch.bool or not loss_mask.numel():
        return
    if loss_mask.dtype.is_complex:
        raise TypeError(f"loss_mask must be bool or real, got {loss_mask.dtype}")
    bad = ~torch.isfinite(loss_mask) | (loss_mask < 0) if loss_mask.dtype.is_floating_point else loss_mask < 0
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"loss_mask must be finite and >= 0, found {loss_mask[i].item()} at index {i}")


def _check_is_weights(is_weights: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """Importance-sampling weights: real, finite and >= 0 where loss_mask is set (masked-out
    entries may hold anything, like the other per-token inputs)."""
    if not is_weights.dtype.is_floating_point:
        raise TypeError(f"is_weights must be a float tensor, got {is_weights.dtype}")
    sel = loss_mask.to(torch.float32) > 0
    bad = sel & (~torch.isfinite(is_weights) | (is_weights < 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"is_weights must be finite and >= 0 on masked-in tokens, found {is_weights[i].item()} "
                         f"at index {i}")


def _selection_correction(hidden, weight, targets, temperature: float, lp, ent, g_none: tuple, g_chosen: tuple, dh,
                          dw):
    """A loss with a token choice (`PolicyLoss.select`: Clip-Cov, KL-Cov) in one sweep: the
    chunked sweep formed every token's gradient as if no token were chosen (`g_none`: per-token
    d loss / d log-prob and / d entropy); the true coefficients (`g_chosen`) differ only on the
    rows whose coefficients the choice changed, so their difference is pushed through those
    rows' logits (recomputed: [k, V], k such rows: cov_ratio x n for the covariance losses) and
    added to d hidden and d weight in place. The same gradient as a second sweep over all N
    tokens, whatever the choice; cheap when it is a few tokens."""
    d_lp, d_ent = g_chosen[0] - g_none[0], g_chosen[1] - g_none[1]
    rows = torch.nonzero((d_lp != 0) | (d_ent != 0)).flatten()
    if rows.numel() == 0:
        return
    h = hidden.index_select(0, rows)
    t = targets.index_select(0, rows)
    prep = _chunked._Prepared(h, weight, h.shape[0])
    h_c = prep.h(h)
    z = prep.logits(h_c, 1.0 / temperature)
    logp, p, s_row, _, ent_r, _ = _chunked._softmax_stats(z, t, prep.p(h.shape[0]))
    dz = _chunked._dz_(p, logp, t, ent_r, d_lp[rows].to(z.dtype), d_ent[rows].to(z.dtype), 1.0 / temperature, s_row)
    dh_r = prep.grads(dz, h_c, dw, dh is not None)  # (adds the rows' d weight into the sweep's accumulator)
    if dh is not None:
        dh.index_add_(0, rows, dh_r.to(dh.dtype))


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ref_logprob: torch.Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    temperature: float = 1.0,
    loss_agg: str = "token-mean",
    seq_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    denominator: float | None = None,
    ratio_level: str = "token",
    loss: str = "ppo",
    is_weights: torch.Tensor | None = None,
    settings: PolicyLossSettings | None = None,
    impl: str = "auto",
    chunk_size: int | None = None,
) -> PolicyLossOutput:
    """Clipped PPO / GRPO / GSPO policy loss straight from hidden states, fused with the LM head.

    hidden [N, H] bf16/fp16/fp32, weight [V, H], targets [N] int64; old_logprob,
    advantages, ref_logprob [N] float (nats); loss_mask [N] bool/float (1 = token trained
    on). The per-token objective is `reference.policy_loss_terms` (PPO clipped surrogate
    with clip_low / clip_high as in DAPO's clip-higher, optional dual clip c > 1 for
    negative advantages, minus entropy_coef * entropy, plus kl_coef * KL estimator "k1" or
    "k3" against ref_logprob), aggregated by `loss_agg` in {"token-mean",
    "seq-mean-token-sum", "seq-mean-token-mean"} over sequences given by seq_ids [N] int64
    or cu_seqlens [S+1] (offsets into N); `denominator` overrides the normalizer (see
    `reference.aggregation_weights`). Log-prob and entropy use softmax(logits / temperature).
    `ratio_level` "sequence" is GSPO (arXiv 2507.18071): every token's ratio is its
    sequence's exp(mean_t log ratio) (`reference.sequence_log_ratio`), clipped per sequence;
    it needs seq_ids or cu_seqlens. `is_weights` [N] float (finite, >= 0 on masked-in
    tokens; constants, no gradient) multiplies each token's policy-gradient term: the
    importance-sampling correction for a sampler that is not the trainer. `loss` picks the
    policy-gradient term: a registered policy loss (`fastpo.kernels.POLICY_LOSSES`; "ppo", the
    clipped surrogate above, by default; `register_policy_loss` adds one), its own settings
    (e.g. SAPO's temperatures) through `settings`. `settings`, a `PolicyLossSettings`, gives
    clip_low ... loss and those as one object (a trainer builds it once); those keywords must
    then be left at their defaults.

    Returns PolicyLossOutput(loss scalar fp32 differentiable wrt hidden and weight,
    logprob [N] fp32, entropy [N] fp32 detached, metrics dict of floats, see
    `reference.policy_metrics`). Masked-out tokens (loss_mask 0) contribute nothing, to the
    loss and to the metrics, and get exactly zero gradient, whatever their inputs hold
    (padding, -inf, even a non-finite hidden row); their logprob/entropy are still reported.

    Memory and cost: the [N, V] logits are never held (impl != "reference"). On the
    chunked/Triton paths the gradient is formed during this call, in the same pass that
    computes each logits tile (the sequence ratio needs every token's log-prob first: with
    ratio_level "sequence" the chunked path makes two passes, the forward and then the gradient
    pass recomputing the logits, as the Triton path always does; a loss with a token choice over
    the whole call, `PolicyLoss.select`, sweeps once and then recomputes the chosen rows), and held until
    `.backward()`: d hidden [N, H] and a full
    d weight [V, H] per call. So call `.backward()` per micro-batch (summing k losses before
    one backward holds k copies of d weight), run loss-only evaluation under
    `torch.no_grad()` (otherwise the backward's work is paid even if never used), and
    backward once (no retain_graph=True second pass).
    Raises ValueError/TypeError naming a bad argument: shapes, dtypes, devices, targets out
    of [0, V), a negative or non-finite loss_mask or is_weights, non-integer
    seq_ids/cu_seqlens, offsets that do not run from 0 to N, unknown
    loss_agg/kl_estimator/ratio_level/impl, out-of-range coefficients, ratio_level
    "sequence" without seq_ids or cu_seqlens.
    """
    given = PolicyLossSettings(clip_low, clip_high, dual_clip, entropy_coef, kl_coef, kl_estimator, temperature,
                               loss_agg, ratio_level, loss)
    if settings is not None:
        if given != PolicyLossSettings():
            raise ValueError("give the loss settings as settings= or as keywords, not both")
        given = settings
    loss_agg, ratio_level, temperature = given.loss_agg, given.ratio_level, given.temperature
    _check_linear(hidden, weight, targets, temperature)
    n, dev = hidden.shape[0], hidden.device
    _check_vec("old_logprob", old_logprob, n, dev)
    _check_vec("advantages", advantages, n, dev)
    _check_vec("loss_mask", loss_mask, n, dev)
    _check_mask(loss_mask)
    _check_vec("ref_logprob", ref_logprob, n, dev, allow_none=True)
    _check_vec("is_weights", is_weights, n, dev, allow_none=True)
    if is_weights is not None:
        _check_is_weights(is_weights, loss_mask)
    given.check()
    select = policy_loss(given.loss).select
    if given.kl_coef > 0 and ref_logprob is None:
        raise ValueError(f"kl_coef={given.kl_coef} needs ref_logprob, got None")
    if cu_seqlens is not None:
        if seq_ids is not None:
            raise ValueError("give seq_ids or cu_seqlens, not both")
        try:
            cu = torch.as_tensor(cu_seqlens)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"cu_seqlens must be a 1-D integer tensor or list, got {cu_seqlens!r}") from e
        _check_int("cu_seqlens", cu)
        cu = cu.to(device=dev, dtype=torch.long)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing offsets from 0 to N={n}, got {cu.tolist()}")
        seq_ids = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), cu[1:] - cu[:-1])
    if seq_ids is not None:
        _check_vec("seq_ids", seq_ids, n, dev)
        _check_int("seq_ids", seq_ids)  # any integer values, negative ones included, name sequences
    if loss_agg != "token-mean" and seq_ids is None:
        raise ValueError(f"loss_agg={loss_agg!r} needs seq_ids or cu_seqlens")
    if ratio_level == "sequence" and seq_ids is None:
        raise ValueError("ratio_level='sequence' (GSPO) needs seq_ids or cu_seqlens")
    if denominator is not None and not (isinstance(denominator, (int, float)) and denominator > 0):
        raise ValueError(f"denominator must be None or > 0, got {denominator!r}")
    hidden, weight = _harmonize(hidden, weight)
    impl = _auto_impl(impl, resolve_impl(impl, dev, hidden.dtype))
    if impl == "reference":
        loss, lp, ent, metrics = reference_policy_loss(
            hidden, weight, targets, old_logprob, advantages, loss_mask, ref_logprob, seq_ids=seq_ids,
            denominator=denominator, is_weights=is_weights, settings=given)
        return PolicyLossOutput(loss, lp, ent, metrics)

    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.long().contiguous()
    cd = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    sel = loss_mask.to(torch.float32) > 0
    some_masked = not bool(sel.all())  # one sync; the masked-row guards below cost nothing without
    zero = torch.zeros((), dtype=cd, device=dev)
    # Masked-out tokens may hold anything (padding, -inf); zero them so that nothing leaks.
    old = torch.where(sel, old_logprob.to(cd), zero)
    adv = torch.where(sel, advantages.to(cd), zero)
    ref = None if ref_logprob is None else torch.where(sel, ref_logprob.to(cd), zero)
    isw = None if is_weights is None else torch.where(sel, is_weights.to(cd), zero)
    w = aggregation_weights(loss_mask, loss_agg, seq_ids, denominator).to(cd)
    # GSPO's sequence log-ratio and a loss's chosen tokens [N] (`PolicyLoss.select`, e.g. Clip-Cov's):
    # set from all N log-probs before any term is formed
    seq = {"log_ratio": None, "selected": None}
    whole_call = ratio_level == "sequence" or select is not None
    # a token choice on the chunked path: one sweep with no token chosen, then the chosen few
    # (Clip-Cov, KL-Cov: k = cov_ratio x n) corrected (`_selection_correction`) instead of a second sweep
    one_sweep = impl == "chunked" and select is not None and ratio_level == "token"

    def terms_of(sl, lp, ent):
        slr, chosen = seq["log_ratio"], seq["selected"]
        return policy_loss_terms(lp, ent, old[sl], adv[sl], None if ref is None else ref[sl],
                                 seq_log_ratio=None if slr is None else slr[sl],
                                 is_weights=None if isw is None else isw[sl],
                                 selected=None if chosen is None else chosen[sl], settings=given)

    def set_seq_ratio(lp):
        if ratio_level == "sequence":
            seq["log_ratio"] = sequence_log_ratio(lp.to(cd), old, loss_mask, seq_ids)
        if select is not None:
            seq["selected"] = select(lp.to(cd), old, adv, loss_mask, given)

    def coef_fn(sl, lp, ent):
        """Elementwise d loss / d logprob and d loss / d entropy for tokens `sl`."""
        with torch.enable_grad():
            lp_ = lp.detach().to(cd).requires_grad_(True)
            ent_ = ent.detach().to(cd).requires_grad_(True)
            per_tok = terms_of(sl, lp_, ent_)["loss"] * w[sl]
            g_lp, g_ent = torch.autograd.grad(per_tok.sum(), (lp_, ent_))
        return torch.where(sel[sl], g_lp, zero), torch.where(sel[sl], g_ent, zero)

    def run(need_h, need_w):
        need = need_h or need_w
        # Two passes (forward, then gradients recomputing the logits): always on the Triton path;
        # on the chunked path when the sequence ratio or a token choice needs every log-prob first.
        if impl in ("triton", "triton-auto") or (need and whole_call and not one_sweep):
            lp, ent, lse = _stats(impl, hidden, weight, targets, temperature, chunk_size)
            set_seq_ratio(lp)
            dh = dw = None
            if need:
                g_lp, g_ent = coef_fn(slice(None), lp, ent)
                h_g, lse_g, ent_g = hidden, lse, ent
                if some_masked:
                    # masked rows enter the gradient pass as zeros (0 * NaN is NaN): their g is 0,
                    # so their dlogits are exactly 0 and a non-finite masked row cannot reach d weight
                    h_g = zero_rows(hidden, sel)
                    lse_g, ent_g = torch.where(sel, lse, 0.0), torch.where(sel, ent, 0.0)
                dh, dw = _grads(impl, h_g, weight, targets, lse_g, ent_g, g_lp, g_ent, temperature, chunk_size,
                                need_h, need_w)
        else:
            if need and one_sweep:
                seq["selected"] = torch.zeros(n, dtype=torch.bool, device=dev)  # the sweep's coefficients: none chosen
            lp, ent, dh, dw = _chunked.chunked_fused(hidden, weight, targets, temperature,
                                                     coef_fn if need else None, chunk_size, need_h, need_w,
                                                     grad_rows=sel if some_masked else None)
            g_none = coef_fn(slice(None), lp, ent) if need and one_sweep else None
            set_seq_ratio(lp)
            if g_none is not None:
                _selection_correction(hidden, weight, targets, temperature, lp, ent, g_none,
                                      coef_fn(slice(None), lp, ent), dh, dw)
        terms = terms_of(slice(None), lp.to(cd), ent.to(cd))
        loss = aggregate(terms["loss"], loss_mask, weights=w)
        metrics = policy_metrics(terms, ent, lp, old, loss_mask, w, ref_logprob is not None)
        return loss, lp, ent, dh, dw, metrics

    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        with _no_autocast(dev):
            loss, lp, ent, _, _, metrics = run(False, False)
        return PolicyLossOutput(loss, lp, ent, metrics)
    box: dict = {}
    loss, lp, ent = _PolicyLossFunction.apply(hidden, weight, run, box)
    return PolicyLossOutput(loss, lp, ent, box["metrics"])
