"""StarPO-S rollout filtering: keep the env groups whose in-group reward std is highest.

RAGEN (arXiv 2504.20073, Sec. 4.2): trajectories from prompts whose outcomes vary little
teach little and feed the "Echo Trap"; StarPO-S keeps the top p% of env groups by the
standard deviation of their trajectories' rewards (p = 25% by default).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from fastpo.config import kept_group_count


@dataclasses.dataclass
class FilterResult:
    """Outcome of `filter_groups`.

    `indices` [B'] int64: trajectories kept, in their original order. `kept_groups` [G']:
    group ids kept. `group_std` {group id: std}. `kept_ratio` = B' / B.
    """

    indices: torch.Tensor
    kept_groups: list
    group_std: dict
    kept_ratio: float
    std_before: float
    std_after: float


def group_reward_std(scores: torch.Tensor, group_ids: torch.Tensor) -> dict:
    """In-group reward std per env group: {group id (int): unbiased std (float)}.

    A group of one trajectory has std 0. Args: scores [B] float, group_ids [B] int.
    Raises ValueError on shape mismatch.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    out = {}
    for g in torch.unique(group_ids).tolist():
        x = scores[group_ids == g].to(torch.float32)
        out[int(g)] = float(x.std(unbiased=True)) if x.numel() > 1 else 0.0
    return out


def filter_groups(scores: torch.Tensor, group_ids: torch.Tensor, ratio: float = 0.25,
                  mode: str = "top") -> FilterResult:
    """Select env groups by in-group reward std (StarPO-S).

    mode "top" keeps the max(1, int(ratio * G)) groups with the highest std (the floor, as
    RAGEN at the paper's commit; ties broken by lower group id, so the choice is
    deterministic), "bottom" the lowest (the paper's reverse ablation), "none" keeps
    everything. When every group holds one trajectory the in-group std is undefined: all
    groups are kept, with a RuntimeWarning.

    Args: scores [B] float (trajectory rewards), group_ids [B] int. Returns FilterResult.
    Raises ValueError for an unknown mode or a ratio outside (0, 1].
    """
    if mode not in ("top", "bottom", "none"):
        raise ValueError(f"unknown filter mode {mode!r}; use 'top', 'bottom' or 'none'")
    if not 0 < ratio <= 1:
        raise ValueError(f"filter ratio {ratio} must be in (0, 1]")
    stds = group_reward_std(scores, group_ids)
    groups = sorted(stds)
    k = kept_group_count(len(groups), mode, ratio)
    if mode != "none" and groups and int(torch.unique(group_ids, return_counts=True)[1].max()) == 1:
        warnings.warn(f"filter mode {mode!r} with one trajectory per env group: the in-group reward std is "
                      "undefined, so filtering is skipped (every group kept)", RuntimeWarning, stacklevel=2)
        mode, k = "none", len(groups)
    if mode == "top":
        chosen = sorted(groups, key=lambda g: (-stds[g], g))[:k]
    elif mode == "bottom":
        chosen = sorted(groups, key=lambda g: (stds[g], g))[:k]
    else:
        chosen = groups
    keep = torch.zeros_like(group_ids, dtype=torch.bool)
    for g in chosen:
        keep |= group_ids == g
    idx = torch.nonzero(keep, as_tuple=False).flatten()
    mean = lambda gs: float(sum(stds[g] for g in gs) / len(gs)) if gs else 0.0  # noqa: E731
    return FilterResult(indices=idx, kept_groups=sorted(chosen), group_std=stds,
                        kept_ratio=float(idx.numel()) / max(1, scores.numel()),
                        std_before=mean(groups), std_after=mean(chosen))
