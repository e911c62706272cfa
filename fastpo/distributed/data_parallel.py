"""The global batch of a data-parallel iteration: env groups split across ranks whole, with
seeds independent of the world size (`split_groups`, `rank_seeds`; `split_evenly` for the
evaluation's seeds), the StarPO-S filter ranking every rank's groups together
(`global_filter`, from all-gathered per-group reward stds), the loss normaliser of a
mini-batch spread over ranks (`global_loss_denominator`) and equal micro-batch counts under
FSDP (`micro_batch_count`)."""
from __future__ import annotations

import torch

from fastpo.algorithms.filtering import (check_filter_args, dynamic_from_stds, dynamic_sampling_filter,
                                         filter_from_stds, filter_groups, group_reward_std)
from fastpo.distributed.collectives import all_gather_rows, all_reduce
from fastpo.distributed.context import DistContext, DistributedError
from fastpo.registry import loss_denominator_of
from fastpo.seeds import iteration_seeds


def split_groups(n_groups: int, world_size: int, rank: int) -> range:
    """The env groups rank `rank` rolls out: a contiguous block, whole groups only (in-group
    statistics need every trajectory of a group on one rank), block sizes differing by at
    most one, earlier ranks taking the extra groups. Raises DistributedError when there are
    fewer groups than ranks or the rank is out of range."""
    if n_groups < world_size:
        raise DistributedError(f"rollout.env_groups={n_groups} is below the number of processes ({world_size}); "
                               f"each process needs at least one whole env group")
    return split_evenly(n_groups, world_size, rank)


def split_evenly(n: int, world_size: int, rank: int) -> range:
    """Rank `rank`'s contiguous block of `n` items (e.g. the evaluation's seeds): block sizes
    differ by at most one, earlier ranks take the extra items, and a rank gets an empty range
    when n < world_size; the blocks in rank order are range(n). Raises DistributedError when
    the rank is out of range."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DistributedError(f"rank {rank} is outside [0, {world_size})")
    base, extra = divmod(int(n), world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def rank_seeds(seed: int, iteration: int, n_groups: int, world_size: int, rank: int) -> tuple[list[int], list[int]]:
    """(global group ids, env seeds) of this rank's share of iteration `iteration`: a slice
    of `fastpo.seeds.iteration_seeds(seed, iteration, n_groups)`, so group g has the same
    seed whatever the world size."""
    groups = split_groups(n_groups, world_size, rank)
    seeds = iteration_seeds(seed, iteration, n_groups)
    return list(groups), [seeds[g] for g in groups]


def gather_group_stds(ctx: DistContext, local: dict) -> dict:
    """{group id: reward std} of every rank's groups (from `group_reward_std` on each rank's
    trajectories), the same dict on every rank. Only (id, std) pairs travel, never
    trajectories; values are sent as float64, so a float std arrives unchanged. Raises
    DistributedError when one group id comes from two ranks (a group split across ranks)."""
    if not ctx.initialized:
        return dict(local)
    rows = torch.tensor([[float(g), float(s)] for g, s in sorted(local.items())], dtype=torch.float64).reshape(-1, 2)
    out: dict = {}
    for g, s in all_gather_rows(ctx, rows).tolist():
        g = int(g)
        if g in out:
            raise DistributedError(f"env group {g} is on two ranks; a group must stay whole on one rank")
        out[g] = s
    return out


def global_filter(ctx: DistContext, scores: torch.Tensor, group_ids: torch.Tensor, ratio: float = 0.25,
                  mode: str = "top", strategy: str = "top_k", top_p_mode: str = "linear", eps: float = 0.01,
                  keep_zero_std: bool = True):
    """`fastpo.algorithms.filter_groups` on the global batch: StarPO-S ranks every rank's env
    groups together (their stds are all-gathered) and each rank keeps its own trajectories
    of the chosen groups.

    Args as `filter_groups`, for this rank's trajectories: scores [B_r] float, group_ids [B_r]
    int (global group ids, whole groups). Returns a FilterResult whose `indices` index this
    rank's trajectories and whose `kept_groups`, `group_std`, `kept_ratio`, `std_before`,
    `std_after` and `zero_std_groups` are global (equal on every rank, and equal to
    `filter_groups` on the concatenated batch). Raises ValueError as `filter_groups`.
    """
    if not ctx.initialized:
        return filter_groups(scores, group_ids, ratio, mode, strategy, top_p_mode, eps, keep_zero_std)
    check_filter_args(mode, ratio)
    stds = gather_group_stds(ctx, group_reward_std(scores, group_ids) if scores.numel() else {})
    local_max = int(torch.unique(group_ids, return_counts=True)[1].max()) if group_ids.numel() else 0
    largest = int(all_reduce(ctx, [local_max], "max")[0])
    return filter_from_stds(stds, group_ids, largest, ratio, mode, strategy, top_p_mode, eps, keep_zero_std,
                            count=lambda kept, n: all_reduce(ctx, [kept, n], "sum"))


def global_dynamic_filter(ctx: DistContext, scores: torch.Tensor, group_ids: torch.Tensor, target: int):
    """`fastpo.algorithms.filtering.dynamic_sampling_filter` on the global batch: the first
    `target` varying groups by global group id (draw order) among every rank's, each rank
    keeping its own trajectories of them; the FilterResult's figures are global, its indices
    this rank's."""
    if not ctx.initialized:
        return dynamic_sampling_filter(scores, group_ids, target)
    stds = gather_group_stds(ctx, group_reward_std(scores, group_ids) if scores.numel() else {})
    return dynamic_from_stds(stds, group_ids, target, count=lambda kept, n: all_reduce(ctx, [kept, n], "sum"))


def scored_counts(masks: list, indices: list[int]) -> tuple[int, int]:
    """(scored tokens, trajectories with a scored token) of trajectories `indices` on this
    rank. masks: [T_i] bool/int loss masks; a token is scored from position 1 on (the
    one-token shift), as in `fastpo.trainer.loss_denominator`."""
    tokens = sum(int(masks[i][1:].sum()) for i in indices)
    seqs = sum(1 for i in indices if bool(masks[i][1:].any()))
    return tokens, seqs


def global_counts(ctx: DistContext, masks: list, indices: list[int]) -> tuple[int, int]:
    """`scored_counts` summed over ranks: the global batch's (scored tokens, trajectories)."""
    tokens, seqs = scored_counts(masks, indices)
    t, s = all_reduce(ctx, [tokens, seqs], "sum")
    return int(t), int(s)


def global_loss_denominator(ctx: DistContext, loss_agg: str, masks: list, indices: list[int], norm: int = 1) -> float:
    """The loss normaliser of a mini-batch spread over ranks: its global scored-token count for
    "token-mean", else its global count of trajectories with a scored token (the seq-mean
    modes; times `norm` for "seq-mean-token-sum-norm"); at least 1. Every rank divides by it,
    so that the sum over ranks of the ranks' gradients is the one-process gradient of the
    whole mini-batch (`fastpo.trainer.loss_denominator` on the concatenation)."""
    return loss_denominator_of(loss_agg, *global_counts(ctx, masks, indices), norm)


def micro_batch_count(ctx: DistContext, n: int) -> int:
    """The number of micro-batches every rank runs in a mini-batch: the largest rank's `n`.
    FSDP's collectives run in each forward and backward, so a rank with fewer micro-batches
    runs empty ones (loss mask all zero: no gradient) up to this count instead of waiting."""
    return int(all_reduce(ctx, [n], "max")[0])
