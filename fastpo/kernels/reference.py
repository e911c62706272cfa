"""The specification: plain PyTorch on materialized fp32 logits, written to be read.

Everything fast in `fastpo.kernels` (the chunked PyTorch path and the Triton kernels) is
tested against the functions here. Two layers:

* `reference_logprob_entropy` materializes the [N, V] logits, so it is only for tests and
  small shapes.
* `policy_loss_terms`, `aggregation_weights` and `policy_metrics` are the per-token PPO /
  GRPO loss on [N] vectors. They are elementwise (or cheap reductions over N), so the fused
  paths reuse them as is: the per-token gradient of the loss with respect to log-prob and
  entropy comes from autograd on these [N] vectors and is then folded into the kernel that
  recomputes the logits.

Notation (one token i of N): z = hidden_i @ weight.T / temperature (nats), p = softmax(z),
logprob_i = log p[target_i], entropy_i = -sum_v p_v log p_v.
"""
from __future__ import annotations

import dataclasses
import math

import torch


def zero_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`x` [N, ...] with the rows where `keep` [N] bool is False set to exactly 0. A select,
    not a product: 0 * NaN is NaN, so a non-finite masked row must be replaced, not weighted."""
    keep = keep.reshape(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k3")
# "token": PPO's per-token ratio; "sequence": GSPO's length-normalised sequence ratio.
RATIO_LEVELS = ("token", "sequence")
# The policy-gradient term: PPO's clipped surrogate, CISPO, SAPO, and the two covariance-based
# variants of PPO (Clip-Cov, KL-Cov); see `policy_loss_terms`.
POLICY_LOSSES = ("ppo", "cispo", "sapo", "clip_cov", "kl_cov")
# The losses whose tokens are chosen by a statistic over the whole call (`covariance_selection`).
COVARIANCE_LOSSES = ("clip_cov", "kl_cov")
# Log-ratios are clamped to this range before exp(): a token whose probability moved by
# more than e^20 would otherwise overflow the ratio (and its gradient) to inf.
LOG_RATIO_CLAMP = 20.0


def reference_logprob_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy of softmax(hidden @ weight.T / temperature).

    hidden [N, H] and weight [V, H] (any float dtype, upcast to fp32, or kept in fp64),
    targets [N] int64 in [0, V). Returns (logprob [N], entropy [N]) in fp32 (fp64 for fp64
    inputs), in nats; differentiable through autograd. Materializes [N, V] logits.
    """
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = (hidden.to(dtype) @ weight.to(dtype).T) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    logprob = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprob, entropy


def sequence_log_ratio(
    logprob: torch.Tensor, old_logprob: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor
) -> torch.Tensor:
    """GSPO's sequence log-ratio (arXiv 2507.18071, eq. 7), broadcast back to the tokens.

    For sequence i with tokens t (loss_mask m_t > 0, a float mask weighting them):
        log s_i = sum_t m_t (logprob_t - old_logprob_t) / sum_t m_t,
    the log of the geometric mean of the token ratios, so s_i does not grow with length.
    logprob, old_logprob [N] float (nats), loss_mask [N] bool/float, seq_ids [N] int (equal
    ids form one sequence). Returns [N] in logprob's dtype, detached: entry t is log s of
    t's sequence (0 for a sequence without a masked-in token). Not clamped; the caller
    clamps the ratio as for token ratios. Masked-out entries may hold anything.
    """
    lp = logprob.detach()
    m = loss_mask.to(lp.dtype)
    sel = m > 0
    d = torch.where(sel, lp - old_logprob.to(lp.dtype), torch.zeros((), dtype=lp.dtype, device=lp.device))
    _, inv = torch.unique(seq_ids, return_inverse=True)
    n_ids = int(inv.max().item()) + 1 if inv.numel() else 0
    num = torch.zeros(n_ids, dtype=lp.dtype, device=lp.device).index_add_(0, inv, d * torch.where(sel, m, 0.0))
    den = torch.zeros(n_ids, dtype=lp.dtype, device=lp.device).index_add_(0, inv, torch.where(sel, m, 0.0))
    return (num / den.clamp(min=1e-12))[inv]


def covariance_selection(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                         loss_mask: torch.Tensor, settings: PolicyLossSettings) -> torch.Tensor:
    """The tokens Clip-Cov detaches or KL-Cov penalises (arXiv 2505.22617, Alg. 1 and 2), as
    verl computes them: bool [N], False off the mask.

    With n masked-in tokens (loss_mask > 0) and means over them, each token's centred
    covariance between log-prob and advantage is cov_i = (A_i - mean A) (logprob_i - mean logprob),
    and k = max(1, floor(cov_ratio * n)) tokens are chosen (none when n = 0):
    "kl_cov": the k largest cov_i; "clip_cov": k drawn at random (torch.randperm with a
    generator seeded by `cov_seed`, on the CPU) among the tokens with clip_cov_lb < cov_i <
    clip_cov_ub that PPO's clip does not already cover (all of them when fewer). Statistics of
    this call: the trainer calls once per micro-batch, as verl's loss does. logprob,
    old_logprob, advantages [N] float (nats; detached here), loss_mask [N] bool/float.
    """
    s = settings
    sel = loss_mask.to(torch.float32) > 0
    lp = logprob.detach().to(torch.float64)
    adv = advantages.detach().to(torch.float64)
    chosen = torch.zeros_like(sel)
    n = int(sel.sum())
    if n == 0:
        return chosen
    k = max(1, int(s.cov_ratio * n))
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    cov = (torch.where(sel, adv, zero) - adv[sel].mean()) * (torch.where(sel, lp, zero) - lp[sel].mean())
    if s.loss == "kl_cov":
        idx = torch.topk(torch.where(sel, cov, -torch.inf), k).indices
    else:
        ratio = torch.exp((lp - old_logprob.detach().to(lp.dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        clipped = -adv * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high) > -adv * ratio
        band = sel & ~clipped & (cov > s.clip_cov_lb) & (cov < s.clip_cov_ub)
        candidates = torch.nonzero(band).reshape(-1)
        order = torch.randperm(candidates.numel(), generator=torch.Generator().manual_seed(s.cov_seed))
        idx = candidates[order[:k].to(candidates.device)]
    chosen[idx] = True
    return chosen


def policy_loss_terms(logprob: torch.Tensor, entropy: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                      ref_logprob: torch.Tensor | None = None, *, seq_log_ratio: torch.Tensor | None = None,
                      is_weights: torch.Tensor | None = None, cov_selected: torch.Tensor | None = None,
                      settings: PolicyLossSettings | None = None, **options) -> dict[str, torch.Tensor]:
    """Per-token clipped PPO / GRPO objective (a loss: lower is better), all tensors [N].

    The settings (clip_low, clip_high, dual_clip, entropy_coef, kl_coef, kl_estimator; the
    others of `PolicyLossSettings` are not used here) come as `settings` or as its keywords
    in `options` (defaults: PolicyLossSettings'), checked when the settings are built.

    ratio r = exp(logprob - old_logprob) (log-ratio clamped to +-20),
    pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))   (PPO, Schulman et al. 2017,
         eq. 7, with separate low/high epsilons: "clip-higher", DAPO arXiv 2503.14476),
    dual clip (Ye et al. 2020, arXiv 1912.09729): for A < 0, pg = min(pg, -A c), c > 1,
    pg *= is_weights (when given: importance-sampling weights for a sampler that is not
         the trainer, constants, as verl's rollout correction; see
         fastpo.algorithms.rollout_correction),
    kl = logprob - ref_logprob (k1) or exp(ref - lp) - (ref - lp) - 1 (k3, Schulman's
         unbiased low-variance estimator of KL(pi || pi_ref)),
    loss = pg - entropy_coef * entropy + kl_coef * kl.

    GSPO (arXiv 2507.18071): with `seq_log_ratio` [N] (`sequence_log_ratio`, detached),
    the ratio is the sequence's, r_t = s_i * pi(y_t) / sg[pi(y_t)] (the paper's GSPO-token):
    its value is s_i for every token of sequence i, so the clipping decides per sequence
    (for a sequence-constant advantage), and its gradient flows through token t's own
    log-prob only. With "seq-mean-token-mean" aggregation and one advantage per sequence
    this is exactly GSPO's sequence objective and gradient.

    `settings.loss` replaces the PPO term pg (the KL, entropy and IS-weight terms stay):

    - "cispo" (MiniMax-M1, arXiv 2506.13585, eq. 4): pg = -sg(clip(r, 1 - clip_low,
      1 + clip_high)) * A * logprob. The IS weight is clipped and detached; every token keeps
      the gradient of its log-prob (PPO's clip zeroes it for a token that moved too far).
      The paper sets no lower bound (a large eps_low): clip_low >= 1.
      Its value holds logprob itself, so pg is not comparable to PPO's in size.
    - "sapo" (Soft Adaptive Policy Optimization, arXiv 2511.20347): pg = -A * f(r) with the
      soft gate f(r) = (4 / tau) * sigmoid(tau * (r - 1)), tau = sapo_tau_pos where A > 0,
      sapo_tau_neg elsewhere; f(1) = 2 / tau, f'(1) = 1 (the on-policy gradient is PPO's),
      and the gradient fades smoothly as r leaves 1 instead of stopping at a clip.
    - "clip_cov" (arXiv 2505.22617, Alg. 1): PPO's pg, with the tokens of `cov_selected` [N]
      bool (`covariance_selection`) detached: their pg keeps its value, their gradient is 0.
    - "kl_cov" (arXiv 2505.22617, Alg. 2): the unclipped pg = -A r, plus
      kl_cov_coef * |logprob - old_logprob| on the tokens of `cov_selected`.

    Returns a dict with "loss", "pg", "kl" (zeros when no ref_logprob), "ratio", and boolean
    "clip_low" (A < 0 and the lower clip is active; CISPO: r below 1 - clip_low), "clip_high"
    (A > 0 and the upper clip is active; CISPO: r above 1 + clip_high), "dual_clip" (the dual
    clip is active), and with a covariance loss "cov_selected". Differentiable with respect
    to logprob and entropy.
    """
    s = settings if settings is not None else PolicyLossSettings(**options)
    clip_low, clip_high, dual_clip = s.clip_low, s.clip_high, s.dual_clip
    if seq_log_ratio is None:
        log_ratio = logprob - old_logprob
    else:
        log_ratio = seq_log_ratio + (logprob - logprob.detach())  # value s_i, gradient d logprob_t
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    extra = {}
    if s.loss == "cispo":
        weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
        pg = -advantages * weight * logprob
        is_clip_high, is_clip_low = ratio.detach() > 1.0 + clip_high, ratio.detach() < 1.0 - clip_low
        is_dual = torch.zeros_like(is_clip_high)
    elif s.loss == "sapo":
        tau_pos, tau_neg = (torch.tensor(t, dtype=ratio.dtype, device=ratio.device)
                            for t in (s.sapo_tau_pos, s.sapo_tau_neg))
        tau = torch.where(advantages > 0, tau_pos, tau_neg)
        pg = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
        is_clip_high = is_clip_low = is_dual = torch.zeros_like(ratio, dtype=torch.bool)
    else:
        pg_unclipped = -advantages * ratio
        pg_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        if s.loss == "kl_cov":
            pg = pg_unclipped
            clipped = torch.zeros_like(ratio, dtype=torch.bool)
        else:
            pg = torch.maximum(pg_unclipped, pg_clipped)
            clipped = pg_clipped > pg_unclipped
        is_clip_high = clipped & (ratio > 1.0)
        is_clip_low = clipped & (ratio < 1.0)
        if dual_clip is not None:
            pg_dual = -advantages * dual_clip
            is_dual = (advantages < 0) & (pg > pg_dual)
            pg = torch.where(is_dual, pg_dual, pg)
        else:
            is_dual = torch.zeros_like(clipped)
        if s.loss in COVARIANCE_LOSSES:
            if cov_selected is None:
                raise ValueError(f"loss={s.loss!r} needs cov_selected (fastpo.kernels.covariance_selection), got None")
            chosen = cov_selected.bool()
            if s.loss == "clip_cov":
                pg = torch.where(chosen, pg.detach(), pg)
            else:
                penalty = s.kl_cov_coef * (logprob - old_logprob).abs()
                pg = torch.where(chosen, pg + penalty, pg)
            extra["cov_selected"] = chosen
    if is_weights is not None:
        pg = pg * is_weights
    if ref_logprob is not None:
        if s.kl_estimator == "k1":
            kl = logprob - ref_logprob
        else:
            d = (ref_logprob - logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            kl = torch.exp(d) - d - 1.0
    else:
        kl = torch.zeros_like(logprob)
    loss = pg - s.entropy_coef * entropy + s.kl_coef * kl
    return {"loss": loss, "pg": pg, "kl": kl, "ratio": ratio,
            "clip_low": is_clip_low, "clip_high": is_clip_high, "dual_clip": is_dual, **extra}


def aggregation_weights(
    loss_mask: torch.Tensor,
    loss_agg: str = "token-mean",
    seq_ids: torch.Tensor | None = None,
    denominator: float | None = None,
) -> torch.Tensor:
    """Weights w [N] fp32 such that the aggregated loss is sum_i w_i * loss_i.

    loss_mask [N] bool or float (a float mask weights tokens). seq_ids [N] int (any values;
    tokens with equal ids form one sequence), needed by the seq-mean-* modes. Modes
    (verl's names): "token-mean" = sum(m l) / sum(m); "seq-mean-token-sum" = mean over
    sequences of sum(m l); "seq-mean-token-mean" = mean over sequences of sum(m l) / sum(m).
    Sequences are those with at least one masked-in token. `denominator`, when given,
    replaces sum(m) (token-mean) or the number of sequences (seq-mean-*), e.g. the global
    count over all micro-batches for gradient accumulation. With no masked-in token every
    weight is 0. Raises ValueError on an unknown mode or missing seq_ids.
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    m = loss_mask.to(torch.float32)
    if loss_agg == "token-mean":
        denom = m.sum() if denominator is None else torch.tensor(float(denominator), device=m.device)
        return m / denom.clamp(min=1e-12)
    if seq_ids is None:
        raise ValueError(f"loss_agg={loss_agg!r} needs seq_ids (one id per token), got None")
    _, inv = torch.unique(seq_ids, return_inverse=True)
    n_ids = int(inv.max().item()) + 1 if inv.numel() else 0
    per_seq = torch.zeros(n_ids, dtype=torch.float32, device=m.device).index_add_(0, inv, m)
    if denominator is None:
        n_seqs = (per_seq > 0).sum().to(torch.float32).clamp(min=1.0)
    else:
        n_seqs = torch.tensor(float(denominator), device=m.device).clamp(min=1e-12)
    if loss_agg == "seq-mean-token-sum":
        return m / n_seqs
    return m / per_seq.clamp(min=1e-12)[inv] / n_seqs


def aggregate(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg: str = "token-mean",
    seq_ids: torch.Tensor | None = None,
    denominator: float | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The aggregated loss sum_i w_i * loss_i over the masked-in tokens (loss_mask > 0), with
    w = `aggregation_weights(loss_mask, loss_agg, seq_ids, denominator)` unless `weights` [N]
    (already computed) are given: the one loss aggregation of fastpo's policy and value losses
    (verl's `agg_loss`). per_token, loss_mask, seq_ids [N]. Masked-out entries are dropped with
    a select, so a NaN or inf there never reaches the loss or its gradient. Returns a scalar in
    per_token's dtype (0 with no masked-in token). Raises what `aggregation_weights` raises.
    """
    if weights is None:
        weights = aggregation_weights(loss_mask, loss_agg, seq_ids, denominator).to(per_token.dtype)
    sel = loss_mask.to(torch.float32) > 0
    return torch.where(sel, per_token * weights, torch.zeros((), dtype=per_token.dtype, device=per_token.device)).sum()


@dataclasses.dataclass(frozen=True)
class PolicyLossSettings:
    """The policy loss's settings as one object (Liger keeps them on its loss module): what
    `linear_policy_loss` also takes one keyword each (`settings=`), with the same defaults and
    meaning (see `policy_loss_terms` and `aggregation_weights`): clip_low / clip_high >= 0,
    clip_low < 1 and clip_high >= clip_low (PPO's clip range, DAPO's clip-higher; for "cispo"
    any clip_low, >= 1 meaning no lower bound on the IS weight, as its paper runs it),
    dual_clip None or > 1, entropy_coef and kl_coef >= 0, kl_estimator in KL_ESTIMATORS,
    temperature > 0 (the logits' divisor), loss_agg in LOSS_AGGS, ratio_level in
    RATIO_LEVELS; `loss` in
    POLICY_LOSSES ("ppo", "cispo", "sapo", "clip_cov", "kl_cov", see `policy_loss_terms`) with
    its own settings: sapo_tau_pos / sapo_tau_neg > 0 (SAPO's gate temperatures for positive
    and other advantages; verl's 1.0 / 1.05), cov_ratio in (0, 1] (the fraction of a call's
    tokens Clip-Cov detaches or KL-Cov penalises; 0.0002 as verl), clip_cov_lb < clip_cov_ub
    (Clip-Cov's covariance band, 1 and 5), kl_cov_coef > 0 (KL-Cov's penalty, 1), cov_seed
    (Clip-Cov's random pick, `covariance_selection`). dual_clip only with "ppo" / "clip_cov";
    GSPO's ratio_level "sequence" only with "ppo" / "cispo".

    Checked when built (`check`): a bad setting raises ValueError with a one-line message
    naming the value. The defaults are verl's (clip 0.2 / 0.2, no entropy bonus, the k3 KL
    estimator, token-mean), so that a loss moved from verl or TRL computes the same objective;
    fastpo's trainer builds its own from its config (0.2 / 0.28, entropy 0.001, k1,
    seq-mean-token-mean: the StarPO-S paper's), see `fastpo.trainer.policy_loss_settings`.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    temperature: float = 1.0
    loss_agg: str = "token-mean"
    ratio_level: str = "token"
    loss: str = "ppo"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    cov_seed: int = 0

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the first bad setting (temperature is checked with the
        hidden states, by the caller)."""
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        for name in ("clip_low", "clip_high", "entropy_coef", "kl_coef"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        # CISPO's IS weight may go without a lower bound (its paper's setting): clip_low >= 1 puts
        # 1 - clip_low at or below 0, under every ratio; PPO's clip range must stay a range
        if self.clip_low >= 1.0 and self.loss != "cispo":
            raise ValueError(f"clip_low must be < 1 (the ratio's lower bound is 1 - clip_low), got {self.clip_low}")
        if self.clip_high < self.clip_low and self.loss != "cispo":
            raise ValueError(f"clip_high must be >= clip_low (clip-higher widens the upper bound), got clip_high="
                             f"{self.clip_high} < clip_low={self.clip_low}")
        d = self.dual_clip
        if d is not None and not (isinstance(d, (int, float)) and math.isfinite(d) and d > 1.0):
            raise ValueError(f"dual_clip must be None or a finite constant > 1, got {d!r}")
        if self.loss not in POLICY_LOSSES:
            raise ValueError(f"loss must be one of {POLICY_LOSSES}, got {self.loss!r}")
        if d is not None and self.loss not in ("ppo", "clip_cov"):
            raise ValueError(f"dual_clip={d} applies to PPO's clipped surrogate (loss 'ppo' or 'clip_cov'), not "
                             f"loss={self.loss!r}; use dual_clip=None")
        if self.ratio_level == "sequence" and self.loss not in ("ppo", "cispo"):
            raise ValueError(f"ratio_level='sequence' (GSPO) is defined for loss 'ppo' and 'cispo', not "
                             f"loss={self.loss!r}")
        for name in ("sapo_tau_pos", "sapo_tau_neg", "cov_ratio", "kl_cov_coef"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.cov_ratio > 1:
            raise ValueError(f"cov_ratio is a fraction of the tokens, at most 1, got {self.cov_ratio}")
        lb, ub = self.clip_cov_lb, self.clip_cov_ub
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (lb, ub)) or not lb < ub:
            raise ValueError(f"clip_cov_lb < clip_cov_ub needed (finite), got {lb!r} and {ub!r}")
        if isinstance(self.cov_seed, bool) or not isinstance(self.cov_seed, int) or self.cov_seed < 0:
            raise ValueError(f"cov_seed must be an integer >= 0, got {self.cov_seed!r}")



def policy_metrics(
    terms: dict[str, torch.Tensor],
    entropy: torch.Tensor,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    with_kl: bool,
) -> dict[str, float]:
    """Detached scalar metrics over the masked-in tokens (one device sync).

    clipfrac_low / clipfrac_high / clipfrac / clipfrac_dual: fraction of tokens where that
    clip is active; approx_kl: mean k3 estimate of KL(pi_old || pi) = (r - 1) - log r;
    ratio_mean / max / min; entropy: mean token entropy (nats); pg_loss: the aggregated
    policy-gradient term (same weights as the loss); kl: mean KL to the reference (when
    used); covfrac: the fraction of tokens Clip-Cov detached or KL-Cov penalised (with those
    losses). Token counts ignore the mask's weights (a token is in when loss_mask > 0). All
    0.0 when no token is masked in. Masked-out tokens are dropped with torch.where, so a
    NaN or inf there (e.g. from a non-finite padding row) never reaches a metric.
    """
    sel = loss_mask.to(torch.float32) > 0
    n = sel.sum().to(torch.float32).clamp(min=1.0)
    ratio = terms["ratio"].detach()
    log_ratio = (logprob.detach() - old_logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    any_sel = sel.any()

    def mean(x):
        x = x.detach()
        return torch.where(sel, x.float() if x.dtype == torch.bool else x, 0.0).sum() / n

    vals = {
        "clipfrac_low": mean(terms["clip_low"]),
        "clipfrac_high": mean(terms["clip_high"]),
        "clipfrac": mean(terms["clip_low"] | terms["clip_high"]),
        "clipfrac_dual": mean(terms["dual_clip"]),
        "approx_kl": mean((ratio - 1.0) - log_ratio),
        "ratio_mean": mean(ratio),
        "ratio_max": torch.where(any_sel, torch.where(sel, ratio, -torch.inf).amax(dim=0, keepdim=True), 0.0)
        if ratio.numel() else torch.zeros((), device=ratio.device),
        "ratio_min": torch.where(any_sel, torch.where(sel, ratio, torch.inf).amin(dim=0, keepdim=True), 0.0)
        if ratio.numel() else torch.zeros((), device=ratio.device),
        "entropy": mean(entropy),
        "pg_loss": torch.where(sel, terms["pg"].detach() * weights, 0.0).sum(),
    }
    if with_kl:
        vals["kl"] = mean(terms["kl"])
    if "cov_selected" in terms:
        vals["covfrac"] = mean(terms["cov_selected"])
    keys = list(vals)
    out = torch.stack([vals[k].to(torch.float64).reshape(()) for k in keys]).tolist()
    return dict(zip(keys, out))


def reference_policy_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, old_logprob: torch.Tensor,
                          advantages: torch.Tensor, loss_mask: torch.Tensor, ref_logprob: torch.Tensor | None = None, *,
                          seq_ids: torch.Tensor | None = None, denominator: float | None = None,
                          is_weights: torch.Tensor | None = None, settings: PolicyLossSettings | None = None,
                          **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """The whole policy loss on materialized logits: (loss, logprob, entropy, metrics).

    Same arguments and meaning as `fastpo.kernels.linear_policy_loss` (no validation here);
    the loss settings come as `settings` or as PolicyLossSettings' keywords in `options`.
    loss is a differentiable scalar; masked-out tokens are removed with torch.where so that
    their gradient is exactly zero whatever their inputs hold. Their hidden rows are
    replaced by zeros before the logits (the backward of log_softmax on a non-finite row
    would give NaN even with a zero upstream gradient); their returned logprob/entropy come
    from the real rows, computed without a graph.
    """
    s = settings if settings is not None else PolicyLossSettings(**options)
    temperature = s.temperature
    sel = loss_mask.to(torch.float32) > 0
    h_in = zero_rows(hidden, sel)
    logprob, entropy = reference_logprob_entropy(h_in, weight, targets, temperature)
    zero = torch.zeros((), dtype=logprob.dtype, device=logprob.device)
    old = torch.where(sel, old_logprob.to(logprob.dtype), zero)
    adv = torch.where(sel, advantages.to(logprob.dtype), zero)
    ref = None if ref_logprob is None else torch.where(sel, ref_logprob.to(logprob.dtype), zero)
    isw = None if is_weights is None else torch.where(sel, is_weights.to(logprob.dtype), zero)
    slr = sequence_log_ratio(logprob, old, loss_mask, seq_ids) if s.ratio_level == "sequence" else None
    cov = covariance_selection(logprob, old, adv, loss_mask, s) if s.loss in COVARIANCE_LOSSES else None
    terms = policy_loss_terms(logprob, entropy, old, adv, ref, seq_log_ratio=slr, is_weights=isw, cov_selected=cov,
                              settings=s)
    w = aggregation_weights(loss_mask, s.loss_agg, seq_ids, denominator).to(logprob.dtype)
    loss = aggregate(terms["loss"], loss_mask, weights=w)
    metrics = policy_metrics(terms, entropy, logprob, old, loss_mask, w, ref_logprob is not None)
    logprob, entropy = logprob.detach(), entropy.detach()
    if not bool(sel.all()):
        with torch.no_grad():
            lp_all, ent_all = reference_logprob_entropy(hidden, weight, targets, temperature)
        logprob, entropy = torch.where(sel, logprob, lp_all), torch.where(sel, entropy, ent_all)
    return loss, logprob, entropy, metrics
