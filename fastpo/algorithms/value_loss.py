"""Loss aggregation and the critic's clipped value loss (PPO, Schulman et al. 2017; verl's form)."""
from __future__ import annotations

from typing import Optional

import torch

from fastpo.kernels.torch_reference import aggregate


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   seq_ids: Optional[torch.Tensor] = None, denominator: Optional[float] = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the masked tokens: `fastpo.kernels.aggregate`,
    the aggregation the policy loss uses, on [B, T] rows or flat [N] tokens.

    - "token-mean": sum over masked tokens / number of masked tokens.
    - "seq-mean-token-sum": per sequence the sum over its masked tokens, then the mean over
      sequences that have any masked token.
    - "seq-mean-token-mean": per sequence the mean over its masked tokens, then the mean.
    Sequences are the rows of a [B, T] input, or, for a flat [N] input, given by `seq_ids` [N].
    `denominator` replaces the token count (token-mean) or the sequence count (seq-mean-*),
    e.g. a mini-batch's count when micro-batch losses are accumulated.

    Returns a 0-dim fp32 tensor (0 when nothing is masked). Raises ValueError on an unknown
    mode, mismatched shapes or missing seq_ids.
    """
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ")
    if seq_ids is None and per_token.dim() == 2:
        seq_ids = torch.arange(per_token.shape[0], device=per_token.device)[:, None].expand_as(per_token)
    if seq_ids is None and mode != "token-mean":
        raise ValueError("a flat per-token loss needs seq_ids for sequence aggregation")
    return aggregate(per_token.to(torch.float32).reshape(-1), mask.reshape(-1), mode,
                     None if seq_ids is None else seq_ids.reshape(-1), denominator)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip: float = 0.5, mode: str = "token-mean",
                       seq_ids: Optional[torch.Tensor] = None,
                       denominator: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, -c, c),
    aggregated by `aggregate_loss` (mode, seq_ids, denominator: the policy loss's aggregation).

    Args: values (current critic output, differentiable), old_values, returns, mask — all the
    same shape ([B, T] or [N]); clip c > 0 in reward units. Returns (scalar fp32 loss,
    {"value_loss", "value_clipfrac", "value_mean", "value_error"} detached floats; value_loss
    is the token mean over these masked tokens whatever the mode, comparable across calls).
    Raises ValueError if clip <= 0.
    """
    if clip <= 0:
        raise ValueError(f"value clip must be > 0, got {clip}")
    v = values.to(torch.float32)
    v_clip = old_values + torch.clamp(v - old_values, -clip, clip)
    l1 = (v - returns) ** 2
    l2 = (v_clip - returns) ** 2
    worst = torch.maximum(l1, l2)
    loss = 0.5 * aggregate_loss(worst, mask, mode, seq_ids, denominator)
    with torch.no_grad():
        m = mask.to(torch.float32)
        n = m.sum().clamp_min(1.0)
        metrics = {
            "value_loss": float(0.5 * ((worst * m).sum() / n)),
            "value_clipfrac": float(((l2 > l1).float() * m).sum() / n),
            "value_mean": float((v * m).sum() / n),
            "value_error": float((l1 * m).sum() / n),
        }
    return loss, metrics
