"""Loss aggregation and the critic's clipped value loss (PPO, Schulman et al. 2017; verl's form)."""
from __future__ import annotations

from typing import Optional

import torch


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   seq_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the masked tokens.

    - "token-mean": sum over masked tokens / number of masked tokens.
    - "seq-mean-token-sum": per sequence the sum over its masked tokens, then the mean over
      sequences that have any masked token.
    - "seq-mean-token-mean": per sequence the mean over its masked tokens, then the mean.
    Sequences are the rows of a [B, T] input, or, for a flat [N] input, given by `seq_ids` [N].

    Returns a 0-dim fp32 tensor (0 when nothing is masked). Raises ValueError on an unknown
    mode or missing seq_ids.
    """
    m = mask.to(torch.float32)
    x = per_token.to(torch.float32) * m
    if x.shape != m.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} differ")
    if mode == "token-mean":
        return x.sum() / m.sum().clamp_min(1.0)
    if mode not in ("seq-mean-token-sum", "seq-mean-token-mean"):
        raise ValueError(f"unknown loss aggregation {mode!r}")
    if x.dim() == 2 and seq_ids is None:
        sums, counts = x.sum(dim=1), m.sum(dim=1)
    else:
        if seq_ids is None:
            raise ValueError("a flat per-token loss needs seq_ids for sequence aggregation")
        ids = seq_ids.reshape(-1).long()
        n = int(ids.max().item()) + 1 if ids.numel() else 0
        sums = torch.zeros(n, dtype=torch.float32, device=x.device).index_add_(0, ids, x.reshape(-1))
        counts = torch.zeros(n, dtype=torch.float32, device=x.device).index_add_(0, ids, m.reshape(-1))
    has = counts > 0
    if not bool(has.any()):
        return x.sum() * 0.0
    per_seq = sums if mode == "seq-mean-token-sum" else sums / counts.clamp_min(1.0)
    return per_seq[has].mean()


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip: float = 0.5, mode: str = "token-mean",
                       seq_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, -c, c).

    Args: values (current critic output, differentiable), old_values, returns, mask — all the
    same shape ([B, T] or [N]); clip c > 0 in reward units. Returns (scalar fp32 loss,
    {"value_clipfrac", "value_mean", "value_error"} detached floats).
    Raises ValueError if clip <= 0.
    """
    if clip <= 0:
        raise ValueError(f"value clip must be > 0, got {clip}")
    v = values.to(torch.float32)
    v_clip = old_values + torch.clamp(v - old_values, -clip, clip)
    l1 = (v - returns) ** 2
    l2 = (v_clip - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.maximum(l1, l2), mask, mode, seq_ids)
    with torch.no_grad():
        m = mask.to(torch.float32)
        n = m.sum().clamp_min(1.0)
        metrics = {
            "value_clipfrac": float(((l2 > l1).float() * m).sum() / n),
            "value_mean": float((v * m).sum() / n),
            "value_error": float((l1 * m).sum() / n),
        }
    return loss, metrics
