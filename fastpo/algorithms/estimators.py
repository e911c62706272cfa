"""The advantage estimators, one registered function per name of `fastpo.registry.ESTIMATORS`.

`estimate_advantages(name, inputs)` runs estimator `name` on an `AdvantageInputs` record and
returns an `AdvantageOutputs`. Batch statistics (GAE's whitening, REINFORCE++'s
normalisation) go through the record's `batch_whiten`, which the trainer binds to its process
group (fastpo.distributed: over every process's tokens; one process: `masked_whiten`), so an
estimator is written once for one process and N. The trainer logs the figures of what an
estimator returns (fastpo.trainer.batch_advantages).

A new estimator: declare its facts in fastpo.registry, then decorate its function here with
`@register_estimator("name")`; importing this module fails when the two lists differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fastpo.algorithms.advantages import (compute_bilevel_gae, compute_gae, grpo_advantages, masked_whiten, reinforce_pp_advantages,
                                          reinforce_pp_baseline_advantages, rloo_advantages, turn_rloo_advantages)
from fastpo.registry import ESTIMATORS


@dataclass
class AdvantageInputs:
    """What an estimator reads. B trajectories, T the longest one's tokens.

    mask: [B, T] bool, the model tokens (loss mask). rewards: [B, T] fp32 token rewards
    (token-level estimators: `place_rewards`, minus a KL penalty on the reward), else None.
    scores: [B] fp32 trajectory scores (the others; minus the summed KL penalty), else None.
    group_ids: [B] int env-group ids. values: [B, T] fp32 critic values (GAE), else None.
    gamma, lam: discount and GAE lambda in [0, 1]. turn: [B, T] int, each token's turn
    (estimators that need turns), else None; high_level_gamma: bi-level GAE's discount over
    turns. whiten_advantages: GAE's advantages
    normalised over the batch. batch_whiten(x, mask, unbiased=False) -> [B, T] fp32: x
    whitened with the statistics of the whole batch (every process's part).
    """

    mask: torch.Tensor
    group_ids: torch.Tensor
    rewards: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    gamma: float = 1.0
    lam: float = 1.0
    turn: Optional[torch.Tensor] = None
    high_level_gamma: float = 0.95
    whiten_advantages: bool = True
    batch_whiten: Callable[..., torch.Tensor] = masked_whiten


@dataclass
class AdvantageOutputs:
    """advantages: [B, T] fp32, zero off the mask. returns: [B, T] fp32 targets of the value
    loss (estimators with a critic), else None."""

    advantages: torch.Tensor
    returns: Optional[torch.Tensor] = None


_ESTIMATORS: dict[str, Callable[[AdvantageInputs], AdvantageOutputs]] = {}


def register_estimator(name: str):
    """Decorator: register `fn(AdvantageInputs) -> AdvantageOutputs` as estimator `name`
    (declared in fastpo.registry.ESTIMATORS; ValueError otherwise or when taken)."""
    def add(fn):
        if name not in ESTIMATORS:
            raise ValueError(f"estimator {name!r} is not declared in fastpo.registry.ESTIMATORS")
        if name in _ESTIMATORS:
            raise ValueError(f"estimator {name!r} is registered twice")
        _ESTIMATORS[name] = fn
        return fn
    return add


def estimate_advantages(name: str, inputs: AdvantageInputs) -> AdvantageOutputs:
    """Run estimator `name` (fastpo.registry.ESTIMATORS) on `inputs`; ValueError for an unknown name."""
    if name not in _ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {', '.join(_ESTIMATORS)}")
    return _ESTIMATORS[name](inputs)


def _with_critic(x: AdvantageInputs, adv: torch.Tensor, ret: torch.Tensor) -> AdvantageOutputs:
    """A critic estimator's outputs: its returns, and its advantages whitened over the batch
    when asked."""
    if x.whiten_advantages:
        adv = x.batch_whiten(adv, x.mask)
    return AdvantageOutputs(adv, ret)


@register_estimator("gae")
def _gae(x: AdvantageInputs) -> AdvantageOutputs:
    return _with_critic(x, *compute_gae(x.rewards, x.values, x.mask, x.gamma, x.lam))


@register_estimator("bilevel_gae")
def _bilevel_gae(x: AdvantageInputs) -> AdvantageOutputs:
    return _with_critic(x, *compute_bilevel_gae(x.rewards, x.values, x.mask, x.turn, x.gamma, x.lam,
                                                x.high_level_gamma))


@register_estimator("turn_rloo")
def _turn_rloo(x: AdvantageInputs) -> AdvantageOutputs:
    return AdvantageOutputs(turn_rloo_advantages(x.rewards, x.mask, x.turn, x.group_ids))


@register_estimator("reinforce_pp")
def _reinforce_pp(x: AdvantageInputs) -> AdvantageOutputs:
    # the returns, normalised over the whole batch's tokens (one process: the function's own)
    _, ret = reinforce_pp_advantages(x.rewards, x.mask, x.gamma)
    return AdvantageOutputs(x.batch_whiten(ret, x.mask, unbiased=True))


@register_estimator("reinforce_pp_baseline")
def _reinforce_pp_baseline(x: AdvantageInputs) -> AdvantageOutputs:
    return AdvantageOutputs(reinforce_pp_baseline_advantages(
        x.scores, x.group_ids, x.mask, whiten=lambda v, m: x.batch_whiten(v, m, unbiased=True)))


@register_estimator("rloo")
def _rloo(x: AdvantageInputs) -> AdvantageOutputs:
    return AdvantageOutputs(rloo_advantages(x.scores, x.group_ids)[:, None] * x.mask)


@register_estimator("grpo")
def _grpo(x: AdvantageInputs) -> AdvantageOutputs:
    return AdvantageOutputs(grpo_advantages(x.scores, x.group_ids, scale_by_std=True)[:, None] * x.mask)


@register_estimator("drgrpo")
def _drgrpo(x: AdvantageInputs) -> AdvantageOutputs:
    return AdvantageOutputs(grpo_advantages(x.scores, x.group_ids, scale_by_std=False)[:, None] * x.mask)


if set(_ESTIMATORS) != set(ESTIMATORS):  # a declared estimator without a function, or the reverse
    raise ImportError(f"fastpo.registry declares {sorted(ESTIMATORS)}, fastpo.algorithms.estimators "
                      f"implements {sorted(_ESTIMATORS)}")
