"""Rollout filtering: which env groups the update trains on, chosen by in-group reward std.

RAGEN (arXiv 2504.20073, Sec. 4.2): trajectories from prompts whose outcomes vary little
teach little and feed the "Echo Trap"; StarPO-S keeps the top p% of env groups by the
standard deviation of their trajectories' rewards (p = 25% by default). RAGEN's current
head (`ragen/trainer/rollout_filter.py`, its guide `docs/guide_rollout_filtering.md`)
widened that into a family of strategies, and added soft advantage reweighting. fastpo's
names, beside RAGEN head's (`actor_rollout_ref.rollout.rollout_filter_*` and
`algorithm.soft_advantage_reweight` there, `algorithm.*` here):

| fastpo | RAGEN head | meaning |
|---|---|---|
| `filter_strategy` | `rollout_filter_strategy` | `top_k`, `top_p` or `min_p` (below) |
| `filter_ratio` | `rollout_filter_value` | the strategy's number: fraction of groups, probability mass or ratio to the best |
| `filter_mode` `top` / `bottom` / `none` | `rollout_filter_type` `largest` / `smallest` (no filter: `top_p` with value 1 and include_zero) | rank high-std groups first, low-std first, or keep all |
| `filter_mode` `dynamic` | (DAPO's dynamic sampling; verl `filter_groups`) | draw more groups until `env_groups` of them vary (`dynamic_sampling_filter`) |
| `filter_keep_zero_std` | `rollout_filter_include_zero` | whether groups of zero reward std may be kept |
| `filter_top_p_mode` `linear` / `softmax` | `rollout_filter_top_p_prob_mode` | how `top_p` turns stds into mass |
| `filter_eps` | `rollout_filter_selection_eps` | slack of the linear `top_p` threshold |
| `soft_advantage_reweight` | `algorithm.soft_advantage_reweight` | scale advantages by std / max std instead of dropping |

The strategies, for the candidate groups (all groups, or those with std > 1e-10 when
zero-std groups are not kept), ranked by std (mode top: highest first; bottom: lowest
first; ties by lower group id), r = `filter_ratio`, G = all env groups:

- `top_k` (default; the paper's StarPO-S): the first max(1, int(r * G)) ranked candidates
  (the floor, as RAGEN at the paper's commit; 0.35 of 8 groups keeps 2), at most all.
- `top_p`, mode `linear` (RAGEN's recommended rule): walk the ranked candidates adding their
  stds until the sum reaches r * (sum of all candidates' stds) - eps, stopping early at a
  std <= 0; if the sum never reaches that threshold, no group is kept (the update is
  skipped; an all-zero-std batch under mode top is such a case). r >= 1 keeps every
  candidate.
- `top_p`, mode `softmax`: probabilities softmax(std) (softmax(-std) for mode bottom); the
  fewest ranked candidates whose probability mass reaches r (always at least one).
- `min_p`: mode top keeps the candidates with std >= r * max std; mode bottom those with
  std <= min std / r.

`soft_advantage_weights` gives RAGEN's soft reweighting: every trajectory's advantages are
multiplied by its group's std / (the largest group std of the batch + 1e-6), so a group
without reward spread contributes nothing and none is dropped.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

#: Rollout-filter strategies (RAGEN head's `rollout_filter_strategy`).
FILTER_STRATEGIES = ("top_k", "top_p", "min_p")


def kept_group_count(groups: int, mode: str, ratio: float) -> int:
    """Number of env groups StarPO-S keeps: all for mode "none" and at most all for
    "dynamic" (DAPO's dynamic sampling), else int(ratio * groups) (the floor, as RAGEN at the
    paper's commit: 0.35 of 8 groups keeps 2), at least 1."""
    if mode in ("none", "dynamic"):
        return groups
    return max(1, min(groups, int(ratio * groups)))


#: A group std at or below this counts as zero (RAGEN's test, |std| > 1e-10).
ZERO_STD = 1e-10


@dataclasses.dataclass
class FilterResult:
    """Outcome of `filter_groups`.

    `indices` [B'] int64: trajectories kept, in their original order (B' = 0 when the
    strategy keeps no group: the caller skips the update). `kept_groups` [G']: group ids
    kept. `group_std` {group id: std}. `kept_ratio` = B' / B. `std_before` / `std_after`:
    mean group std over all groups / over the kept ones (0 when none is kept).
    `zero_std_groups`: groups whose std is zero (<= 1e-10).
    """

    indices: torch.Tensor
    kept_groups: list
    group_std: dict
    kept_ratio: float
    std_before: float
    std_after: float
    zero_std_groups: int = 0


def group_reward_std(scores: torch.Tensor, group_ids: torch.Tensor) -> dict:
    """In-group reward std per env group: {group id (int): unbiased std (float)}.

    A group of one trajectory, or one whose scores are all equal, has std exactly 0; the
    others are computed in float64. (In float32, eight or more equal scores that are not
    binary fractions, e.g. Sokoban's -0.1 step penalty, leave a std near 1e-8, above the
    zero-spread threshold 1e-10: such groups counted as varying; `grpo_advantages` has the
    same rule.) Args: scores [B] float, group_ids [B] int. Raises ValueError on shape
    mismatch.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    out = {}
    s = scores.to(torch.float64)
    for g in torch.unique(group_ids).tolist():
        x = s[group_ids == g]
        out[int(g)] = 0.0 if x.numel() < 2 or bool((x == x[0]).all()) else float(x.std(unbiased=True))
    return out


def select_groups(stds: dict, strategy: str = "top_k", mode: str = "top", ratio: float = 0.25,
                  top_p_mode: str = "linear", eps: float = 0.01, keep_zero_std: bool = True) -> list:
    """The env groups a strategy keeps, from their in-group reward stds (module docstring).

    Args: stds {group id: std >= 0}; strategy "top_k" | "top_p" | "min_p"; mode "top" |
    "bottom" | "none" (none keeps all); ratio > 0; top_p_mode "linear" | "softmax"; eps >= 0
    (linear top_p); keep_zero_std. Returns the kept group ids, sorted (possibly empty).
    Raises ValueError for an unknown strategy, mode or top_p_mode, or a ratio <= 0.
    """
    if strategy not in FILTER_STRATEGIES:
        raise ValueError(f"unknown filter strategy {strategy!r}; use one of {', '.join(FILTER_STRATEGIES)}")
    if mode not in ("top", "bottom", "none"):
        raise ValueError(f"unknown filter mode {mode!r}; use 'top', 'bottom' or 'none'")
    if top_p_mode not in ("linear", "softmax"):
        raise ValueError(f"unknown top_p mode {top_p_mode!r}; use 'linear' or 'softmax'")
    if not ratio > 0:
        raise ValueError(f"filter ratio {ratio} must be > 0")
    groups = sorted(stds)
    if mode == "none":
        return groups
    cand = [g for g in groups if keep_zero_std or abs(stds[g]) > ZERO_STD]
    if not cand:
        return []
    sign = -1.0 if mode == "top" else 1.0
    ranked = sorted(cand, key=lambda g: (sign * stds[g], g))
    if strategy == "top_k":
        k = kept_group_count(len(groups), mode, ratio)
        return sorted(ranked[:min(k, len(ranked))])
    if strategy == "min_p":
        if mode == "top":
            bound = max(stds[g] for g in cand) * ratio
            return [g for g in cand if stds[g] >= bound - ZERO_STD]
        bound = min(stds[g] for g in cand) / (ratio + ZERO_STD)
        return [g for g in cand if stds[g] <= bound + ZERO_STD]
    # top_p
    if ratio >= 1:
        return cand
    if top_p_mode == "softmax":
        logits = torch.tensor([-sign * stds[g] for g in ranked], dtype=torch.float64)
        mass = torch.cumsum(torch.softmax(logits, 0), 0)
        k = int((mass < ratio).sum()) + 1  # the first prefix whose mass reaches the ratio
        return sorted(ranked[:min(k, len(ranked))])
    threshold = ratio * sum(stds[g] for g in cand) - eps
    total, count = 0.0, 0
    for g in ranked:
        if total >= threshold or stds[g] <= 0:
            break
        total += stds[g]
        count += 1
    return sorted(ranked[:count]) if total >= threshold else []


def filter_groups(scores: torch.Tensor, group_ids: torch.Tensor, ratio: float = 0.25, mode: str = "top",
                  strategy: str = "top_k", top_p_mode: str = "linear", eps: float = 0.01,
                  keep_zero_std: bool = True) -> FilterResult:
    """Select env groups by in-group reward std (StarPO-S and RAGEN head's strategies).

    The defaults are the paper's StarPO-S: mode "top" with strategy "top_k" keeps the
    max(1, int(ratio * G)) groups with the highest std (the floor, as RAGEN at the paper's
    commit; ties broken by lower group id, so the choice is deterministic); "bottom" the
    lowest (the paper's reverse ablation); "none" keeps everything. The other strategies
    and options are described in the module docstring (`select_groups`). When every group
    holds one trajectory the in-group std is undefined: all groups are kept, with a
    RuntimeWarning.

    Args: scores [B] float (trajectory rewards), group_ids [B] int. Returns FilterResult
    (its `indices` may be empty: see `select_groups`). Raises ValueError for an unknown
    mode, strategy or top_p_mode, or a ratio outside (0, 1].
    """
    check_filter_args(mode, ratio)
    largest = int(torch.unique(group_ids, return_counts=True)[1].max()) if group_ids.numel() else 0
    return filter_from_stds(group_reward_std(scores, group_ids), group_ids, largest, ratio, mode, strategy,
                            top_p_mode, eps, keep_zero_std)


def check_filter_args(mode: str, ratio: float) -> None:
    """Raise ValueError for a filter mode other than top/bottom/none or a ratio outside (0, 1]."""
    if mode not in ("top", "bottom", "none"):
        raise ValueError(f"unknown filter mode {mode!r}; use 'top', 'bottom' or 'none'")
    if not 0 < ratio <= 1:
        raise ValueError(f"filter ratio {ratio} must be in (0, 1]")


def filter_from_stds(stds: dict, group_ids: torch.Tensor, largest_group: int, ratio: float, mode: str,
                     strategy: str, top_p_mode: str, eps: float, keep_zero_std: bool,
                     count=None) -> FilterResult:
    """The selection behind `filter_groups`, from the groups' stds already computed (all of
    them: a data-parallel run passes the gathered global ones, `fastpo.distributed`).

    group_ids [B] int: the trajectories whose `indices` are returned; largest_group: the most
    trajectories in one group (1 means no in-group std: filtering is skipped with a
    RuntimeWarning); count: optional reduction (kept, total) -> (kept, total) for
    `kept_ratio` (default: these B trajectories' own counts).
    """
    groups = sorted(stds)
    if mode != "none" and groups and largest_group == 1:
        warnings.warn(f"filter mode {mode!r} with one trajectory per env group: the in-group reward std is "
                      "undefined, so filtering is skipped (every group kept)", RuntimeWarning, stacklevel=3)
        mode = "none"
    chosen = select_groups(stds, strategy, mode, ratio, top_p_mode, eps, keep_zero_std)
    keep = torch.zeros_like(group_ids, dtype=torch.bool)
    for g in chosen:
        keep |= group_ids == g
    idx = torch.nonzero(keep, as_tuple=False).flatten()
    kept, total = count(idx.numel(), group_ids.numel()) if count else (idx.numel(), group_ids.numel())
    mean = lambda gs: float(sum(stds[g] for g in gs) / len(gs)) if gs else 0.0  # noqa: E731
    return FilterResult(indices=idx, kept_groups=list(chosen), group_std=stds, kept_ratio=float(kept) / max(1, total),
                        std_before=mean(groups), std_after=mean(chosen),
                        zero_std_groups=sum(1 for g in groups if abs(stds[g]) <= ZERO_STD))


def varying_groups(stds: dict) -> list:
    """The group ids of {group id: reward std} whose rewards vary (std > 1e-10), in id order."""
    return [g for g in sorted(stds) if abs(stds[g]) > ZERO_STD]


def dynamic_sampling_filter(scores: torch.Tensor, group_ids: torch.Tensor, target: int) -> FilterResult:
    """DAPO's dynamic sampling (arXiv 2503.14476, Sec. 3.2, Alg. 1): keep the env groups
    whose rewards vary (std > 1e-10: a group whose trajectories all score alike has zero
    advantage under the group estimators and teaches nothing), the first `target` of them by
    group id (the order they were drawn in), the rest dropped. The caller draws more groups
    while fewer than `target` vary (fastpo.trainer: `algorithm.dynamic_max_draws`). Unlike
    StarPO-S's top fraction, the batch's size is fixed, not its share.

    Args: scores [B] float, group_ids [B] int, target >= 1. Returns FilterResult (no group
    kept when none varies: the caller skips the update).
    """
    return dynamic_from_stds(group_reward_std(scores, group_ids), group_ids, target)


def dynamic_from_stds(stds: dict, group_ids: torch.Tensor, target: int, count=None) -> FilterResult:
    """`dynamic_sampling_filter` from the groups' reward stds {group id: std} (every process's
    groups in a data-parallel run), keeping this process's trajectories `group_ids` of the
    chosen groups. count(kept, n) -> (kept, n) over every process (None: these counts are the
    whole batch's) gives kept_ratio."""
    if target < 1:
        raise ValueError(f"dynamic sampling needs a target of at least 1 group, got {target}")
    chosen = varying_groups(stds)[:target]
    keep = torch.zeros_like(group_ids, dtype=torch.bool)
    for g in chosen:
        keep |= group_ids == g
    idx = torch.nonzero(keep, as_tuple=False).flatten()
    kept, n = (idx.numel(), len(group_ids)) if count is None else count(idx.numel(), len(group_ids))
    mean = lambda gs: float(sum(stds[g] for g in gs) / len(gs)) if gs else 0.0  # noqa: E731
    return FilterResult(indices=idx, kept_groups=chosen, group_std=stds, kept_ratio=kept / max(1, n),
                        std_before=mean(sorted(stds)), std_after=mean(chosen),
                        zero_std_groups=sum(1 for g in stds if abs(stds[g]) <= ZERO_STD))


def soft_advantage_weights(scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6,
                           top: float | None = None) -> torch.Tensor:
    """RAGEN head's soft advantage reweighting: per trajectory, its group's reward std divided
    by (the largest group std in the batch + eps).

    Args: scores [B] float (trajectory rewards), group_ids [B] int; top: the largest group
    std of the whole batch when `scores` is only part of it (e.g. one process's share), else
    None (taken from `scores`). Returns weights [B] float32 in [0, 1) (all 0 when no group
    has reward spread). Multiply each trajectory's advantages by its weight. Raises
    ValueError on shape mismatch.
    """
    stds = group_reward_std(scores, group_ids)
    top = max(stds.values(), default=0.0) if top is None else float(top)
    w = {g: s / (top + eps) for g, s in stds.items()}
    return torch.tensor([w[int(g)] for g in group_ids.tolist()], dtype=torch.float32)
