"""The specification: plain PyTorch on materialized fp32 logits, written to be read.

Everything fast in `fastpo.kernels` (the chunked PyTorch path and the Triton kernels) is
tested against the functions here. Two layers:

* `reference_logprob_entropy` materializes the [N, V] logits, so it is only for tests and
  small shapes.
* `policy_loss_terms`, `aggregation_weights` and `policy_metrics` are the per-token PPO /
  GRPO loss on [N] vectors, the policy-gradient term being a registered policy loss
  (`fastpo.kernels.losses`: PPO's clip and the others, each one function). They are
  elementwise (or cheap reductions over N, or a loss's token choice over the whole call), so
  the fused paths reuse them as is: the per-token gradient of the loss with respect to
  log-prob and entropy comes from autograd on these [N] vectors and is then folded into the
  kernel that recomputes the logits.

Notation (one token i of N): z = hidden_i @ weight.T / temperature (nats), p = softmax(z),
logprob_i = log p[target_i], entropy_i = -sum_v p_v log p_v.
"""
from __future__ import annotations

import torch

from .losses import LOG_RATIO_CLAMP, LOSS_AGGS, PolicyLossInputs, PolicyLossSettings, policy_loss


#: The terms `policy_loss_terms` returns for every loss (a loss's own events come beside them).
TERMS = ("loss", "pg", "kl", "ratio", "clip_low", "clip_high", "dual_clip")


def zero_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`x` [N, ...] with the rows where `keep` [N] bool is False set to exactly 0. A select,
    not a product: 0 * NaN is NaN, so a non-finite masked row must be replaced, not weighted."""
    keep = keep.reshape(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))



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


def policy_loss_terms(logprob: torch.Tensor, entropy: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                      ref_logprob: torch.Tensor | None = None, *, seq_log_ratio: torch.Tensor | None = None,
                      is_weights: torch.Tensor | None = None, selected: torch.Tensor | None = None,
                      settings: PolicyLossSettings | None = None, **options) -> dict[str, torch.Tensor]:
    """Per-token policy objective (a loss: lower is better), all tensors [N]: the registered
    policy loss `settings.loss` (fastpo.kernels.losses: PPO's clipped surrogate by default) and
    what every loss shares around it.

    The settings (clip_low, clip_high, dual_clip, entropy_coef, kl_coef, kl_estimator, loss and
    its own settings; the others of `PolicyLossSettings` are not used here) come as `settings`
    or as its keywords in `options` (defaults: PolicyLossSettings'), checked when the settings
    are built.

    ratio r = exp(logprob - old_logprob) (log-ratio clamped to +-20),
    pg = the loss's term from r, logprob, old_logprob, advantages A, entropy (`PolicyLossInputs`);
         PPO's: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (Schulman et al. 2017, eq. 7,
         with DAPO's clip-higher),
    dual clip (Ye et al. 2020, arXiv 1912.09729), for a loss that takes it (`PolicyLoss.dual_clip`):
         for A < 0, pg = min(pg, -A c), c = dual_clip > 1,
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

    `selected` [N] bool: the tokens a loss with a whole-call token choice chose
    (`PolicyLoss.select`, e.g. Clip-Cov's `clip_cov_selection`); such a loss raises
    ValueError without it.

    Returns a dict with "loss", "pg", "kl" (zeros when no ref_logprob), "ratio", and boolean
    "clip_low" / "clip_high" (the loss's lower / upper clip is active; PPO: A < 0 and r below
    1 - clip_low / A > 0 and r above 1 + clip_high), "dual_clip" (the dual clip is active),
    and the loss's own per-token events by their metric names (Clip-Cov's "covfrac").
    Differentiable with respect to logprob and entropy.
    """
    s = settings if settings is not None else PolicyLossSettings(**options)
    loss = policy_loss(s.loss)
    if seq_log_ratio is None:
        log_ratio = logprob - old_logprob
    else:
        log_ratio = seq_log_ratio + (logprob - logprob.detach())  # value s_i, gradient d logprob_t
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    if loss.select is not None and selected is None:
        raise ValueError(f"loss={s.loss!r} needs selected (its token choice, PolicyLoss.select), got None")
    g = loss.fn(PolicyLossInputs(logprob, old_logprob, ratio, advantages, entropy, selected), s)
    pg, none = g.pg, torch.zeros_like(ratio, dtype=torch.bool)
    is_clip_low = none if g.clip_low is None else g.clip_low
    is_clip_high = none if g.clip_high is None else g.clip_high
    if s.dual_clip is not None and loss.dual_clip:  # the settings refuse a dual clip for a loss without one
        pg_dual = -advantages * s.dual_clip
        is_dual = (advantages < 0) & (pg > pg_dual)
        pg = torch.where(is_dual, pg_dual, pg)
    else:
        is_dual = none
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
    terms = {"loss": pg - s.entropy_coef * entropy + s.kl_coef * kl, "pg": pg, "kl": kl, "ratio": ratio,
             "clip_low": is_clip_low, "clip_high": is_clip_high, "dual_clip": is_dual}
    for name, flag in (g.fractions or {}).items():
        if name in TERMS:
            raise ValueError(f"loss={s.loss!r} reports a fraction named {name!r}, which is a term of every loss")
        terms[name] = flag
    return terms


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
    used); and the fraction of tokens of each of the loss's own events (the terms beyond
    `TERMS`, e.g. covfrac: the tokens Clip-Cov detached or KL-Cov penalised). Token counts
    ignore the mask's weights (a token is in when loss_mask > 0). All 0.0 when no token is
    masked in. Masked-out tokens are dropped with torch.where, so a
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
    for name in terms:
        if name not in TERMS:  # the loss's own events (`PolicyGradient.fractions`)
            vals[name] = mean(terms[name])
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
    select = policy_loss(s.loss).select
    chosen = None if select is None else select(logprob, old, adv, loss_mask, s)
    terms = policy_loss_terms(logprob, entropy, old, adv, ref, seq_log_ratio=slr, is_weights=isw, selected=chosen,
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
