"""Importance-sampling correction for a sampler that is not the trainer (rollout correction).

Three policies take part in an update (decoupled PPO, Hilton et al. 2021, arXiv 2110.00641;
verl's rollout correction):

* pi_sampler: what generated the tokens (the sampler's recorded log-probs: SGLang in bf16
  with a top-p renormalised distribution, or an older policy for reused or replayed
  rollouts);
* pi_old: the trainer's policy when the update started (the old log-probs it recomputes),
  the anchor of PPO's clipped ratio pi / pi_old;
* pi: the policy being trained.

The gap pi_sampler -> pi_old is corrected by a constant weight per token, from the ratio
rho_t = pi_old(y_t) / pi_sampler(y_t):

* "tis" (truncated IS; Espeholt et al. 2018's truncation, slime's `--use-tis`, verl's
  token/sequence `rollout_is`): w = min(rho, C);
* "mis" (masked IS; verl's rejection sampling): w = rho where 1/C <= rho <= C, and units
  outside that band are dropped from the loss altogether (their loss mask is cleared);
* "none": no correction (w = 1), diagnostics only.

At level "token" each token has its own rho_t; at level "sequence" a trajectory has one,
rho = prod_t rho_t (the ratio of the trajectory's probabilities; environment transitions
cancel), broadcast to its tokens. The weights multiply the policy-gradient term of the loss
(`fastpo.kernels.linear_policy_loss(is_weights=...)`).
"""
from __future__ import annotations

import dataclasses

import torch

IS_CORRECTIONS = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence")
# log-ratios clamped before exp() (as the loss's ratios): a sequence's summed log-ratio can
# be large, and e^20 is far beyond any cap
LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass
class RolloutCorrection:
    """Result of `rollout_correction`.

    weights [B, T] fp32: the per-token weight on the policy-gradient term, 0 off the mask.
    keep [B, T] bool: the loss mask to train with (the input mask, minus what "mis" dropped).
    metrics: detached floats: is_ratio_mean / is_ratio_max / is_ratio_min (of rho, over
    tokens at level "token", over trajectories at level "sequence"), is_weight_mean (of w,
    same units), is_truncated_frac (the fraction of those units truncated, "tis", or
    masked, "mis"; 0 for "none"), mismatch_kl (the mean over model tokens of the k3
    estimator (rho - 1) - log rho of KL(pi_sampler || pi_old), in nats).
    """

    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict


@torch.no_grad()
def rollout_correction(old_logprob: torch.Tensor, sample_logprob: torch.Tensor, loss_mask: torch.Tensor,
                       mode: str = "tis", level: str = "token", cap: float = 2.0) -> RolloutCorrection:
    """Importance-sampling weights correcting the sampler -> trainer gap (see the module doc).

    Args: old_logprob [B, T] float (the trainer's, pi_old) and sample_logprob [B, T] float
    (the sampler's), in nats, aligned with the trajectories' tokens; loss_mask [B, T] bool
    (model tokens; off the mask the log-probs may hold anything); mode in IS_CORRECTIONS;
    level in IS_LEVELS; cap C > 1 (the truncation bound, and [1/C, C] the band "mis"
    keeps). A row is one trajectory. Returns RolloutCorrection.
    Raises ValueError on a shape mismatch, an unknown mode or level, or cap <= 1.
    """
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"IS correction mode must be one of {IS_CORRECTIONS}, got {mode!r}")
    if level not in IS_LEVELS:
        raise ValueError(f"IS level must be one of {IS_LEVELS}, got {level!r}")
    if not (isinstance(cap, (int, float)) and cap > 1 and cap < float("inf")):
        raise ValueError(f"IS cap must be a finite number > 1, got {cap!r}")
    mask = loss_mask.bool()
    for name, x in (("old_logprob", old_logprob), ("sample_logprob", sample_logprob)):
        if x.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(mask.shape)} (same as loss_mask)")
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_rho = torch.where(mask, old_logprob.float() - sample_logprob.float(), zero)
    log_rho_tok = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho_tok = torch.exp(log_rho_tok)
    n_tok = mask.sum()
    # k3 per model token; its mean is KL(pi_sampler || pi_old) under the sampler's tokens
    k3 = torch.where(mask, (rho_tok - 1.0) - log_rho_tok, zero)
    mismatch_kl = k3.sum() / n_tok.clamp(min=1)
    if level == "token":
        units, rho = mask, rho_tok  # one unit per model token
    else:
        has = mask.any(dim=1)
        rho_seq = torch.exp(log_rho.sum(dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        units, rho = has, rho_seq
    if mode == "none":
        w_unit = torch.ones_like(rho)
        kept_unit = torch.ones_like(rho, dtype=torch.bool)
        changed = torch.zeros_like(rho, dtype=torch.bool)
    elif mode == "tis":
        w_unit = rho.clamp(max=float(cap))
        kept_unit = torch.ones_like(rho, dtype=torch.bool)
        changed = rho > cap
    else:  # mis
        kept_unit = (rho >= 1.0 / cap) & (rho <= cap)
        w_unit = torch.where(kept_unit, rho, torch.zeros_like(rho))
        changed = ~kept_unit
    if level == "token":
        weights, keep = torch.where(mask, w_unit, zero), mask & kept_unit
    else:
        weights = torch.where(mask, w_unit[:, None], zero)
        keep = mask & kept_unit[:, None]
    n_units = units.sum().clamp(min=1)

    def mean(x):
        return torch.where(units, x.float(), zero).sum() / n_units

    any_unit = bool(units.any())
    vals = {
        "is_ratio_mean": mean(rho),
        "is_ratio_max": torch.where(units, rho, -torch.inf).max() if any_unit else zero,
        "is_ratio_min": torch.where(units, rho, torch.inf).min() if any_unit else zero,
        "is_weight_mean": mean(w_unit),
        "is_truncated_frac": mean(changed),
        "mismatch_kl": mismatch_kl,
    }
    metrics = dict(zip(vals, torch.stack([v.to(torch.float64).reshape(()) for v in vals.values()]).tolist()))
    return RolloutCorrection(weights=weights, keep=keep, metrics=metrics)
