"""The policy-loss menu's cost (issue 35): each loss's fused forward + backward beside PPO's clip.

`linear_policy_loss` with each registered loss (fastpo.kernels.POLICY_LOSSES: cispo, sapo,
clip_cov, kl_cov, and any registered beside them) against loss = ppo, on the
kernel part's inputs and shape (CPU: the chunked path, H=576, V=49152, N=2048 fp32, --quick
N=128 with 64-token chunks; CUDA: the Triton path, H=896, V=151936, N=4096 bf16), timed in
one alternation (A B C ... A B C) so that machine load hits every loss alike, plus each
call's peak memory beyond its inputs and returned gradients. Target: at most 1.05x PPO's
time, and the same peak memory (no extra [N x V] tensor: at most 1.05x PPO's, which keeps one
chunk's logits or none). On the chunked path Clip-Cov and KL-Cov sweep the vocabulary once as
PPO does, with no token chosen, then correct the few chosen tokens' gradients (their token
choice is a statistic of the whole call, `PolicyLoss.select`: k = cov_ratio x n rows
recomputed); the Triton path sweeps twice for every loss.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record  # noqa: E402
from part_kernels import OPTS, _extra_peak, _inputs, _step, _time_interleaved  # noqa: E402

PART = "losses"
BASELINE = "ppo"


def _losses() -> dict[str, dict]:
    """Each registered loss's settings here: its own at their defaults (verl's), the dual clip
    for a loss that takes one, and a `cov_ratio` of 0.2% of the tokens (the covariance losses'
    share: verl's 0.02% rounds to a token or two at these sizes). The baseline first."""
    from fastpo.kernels import POLICY_LOSSES

    out = {}
    for name in sorted(POLICY_LOSSES, key=lambda n: n != BASELINE):
        loss = POLICY_LOSSES[name]
        own = dict(dual_clip=3.0) if loss.dual_clip else {}
        own.update({s.name: 0.002 for s in loss.settings if s.name == "cov_ratio"})
        out[name] = own
    return out


def _fns(data, impl, chunk_size):
    from fastpo.kernels import PolicyLossSettings, linear_policy_loss

    hidden, weight, targets, old, adv, mask = data
    out = {}
    for loss, own in _losses().items():
        settings = PolicyLossSettings(loss=loss, **OPTS, **own)
        out[loss] = (lambda s: lambda h, w: linear_policy_loss(h, w, targets, old, adv, mask, settings=s, impl=impl,
                                                               chunk_size=chunk_size).loss)(settings)
    return out


def run(ctx: BenchContext) -> list[Record]:
    """Side-by-side records for `python bench/throughput.py --part losses`."""
    if ctx.device == "cuda":
        n, h, v, dtype, impl, chunk = 4096, 896, 151936, torch.bfloat16, "triton", None
        sync = torch.cuda.synchronize
    else:
        n, h, v, dtype, impl = (128 if ctx.quick else 2048), 576, 49152, torch.float32, "chunked"
        chunk = 64 if ctx.quick else None
        sync = None
    data = _inputs(n, h, v, dtype, ctx.device, ctx.seed)
    fns = _fns(data, impl, chunk)
    shape = f"N={n} H={h} V={v} {str(dtype).replace('torch.', '')}, {impl}" + (f", chunk_size={chunk}" if chunk else "")
    _step(fns[BASELINE], data[0], data[1])  # warm-up: the first call's one-off allocations count for no loss
    mems = {k: _extra_peak(fn, data[0], data[1], ctx.device) for k, fn in fns.items()}
    timed = _time_interleaved(fns, data[0], data[1], ctx, sync)
    from fastpo.kernels import policy_loss

    t_ppo, s_ppo, _ = timed[BASELINE]
    records = []
    for loss in list(fns)[1:]:
        t, s, _ = timed[loss]
        cov = policy_loss(loss).select is not None and impl == "chunked"
        why = ("PPO's one vocabulary sweep, then the chosen tokens' rows recomputed to correct their gradients"
               if cov else "the same sweeps as PPO's; only the [N] per-token terms differ")
        records.append(Record(PART, f"{loss} fwd+bwd time vs ppo ({shape})", "s", t, t_ppo, False, s, s_ppo,
                              "ppo (clip-higher, dual clip)", target=1 / 1.05,
                              notes=f"median of {ctx.repeats} runs, alternating with every loss; {why}"))
        records.append(Record(PART, f"{loss} peak memory vs ppo ({shape})", "MiB", mems[loss] / 2**20,
                              mems[BASELINE] / 2**20, False, baseline_name=BASELINE, target=1 / 1.05,
                              notes="beyond inputs and returned gradients; no [N x V] tensor is held by either"))
    return records
