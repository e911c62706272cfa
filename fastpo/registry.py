"""The names and facts of the advantage estimators and loss aggregations, without torch.

The configuration (fastpo.config, which imports no torch) takes its allowed values of
`algorithm.adv_estimator`, `algorithm.loss_agg` and `algorithm.value_loss_agg` from here; the
trainer asks an estimator's facts here instead of comparing names. The implementations live
in `fastpo.algorithms` (`fastpo.algorithms.estimators`: one function registered per name
with `register_estimator`; a name declared here without one, or one registered without a
declaration here, fails at import).

A new estimator: one `Estimator(...)` line below and one decorated function there. (The policy
losses are each one function registered with its facts in fastpo.kernels.losses, which the
config reads when it validates.)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Estimator:
    """What the trainer needs to know of an advantage estimator.

    token_level: scores each model token from token rewards (GAE, REINFORCE++), so a KL
    penalty goes on the reward by default (`TrainConfig.kl_in_reward`); else it scores whole
    trajectories (their summed rewards). needs_groups: its baseline is the env group's other
    trajectories (rollout.group_size >= 2). needs_critic: it needs a value model (a value
    head, on the policy's trunk or a separate critic), and yields returns for its loss.
    batch_statistics: it normalises over the whole batch's tokens, so a process left with no
    trajectory still joins those statistics (data parallel). paper: where it comes from.
    needs_turns: it reads each token's turn (the turn structure of a multi-turn trajectory).
    loss_agg: the loss aggregation its paper pairs it with, used when `algorithm.loss_agg` is
    null (`TrainConfig.loss_agg`): the RAGEN paper's "seq-mean-token-mean" but for Dr.GRPO,
    whose point is to drop that per-trajectory 1/|tau_i| ("seq-mean-token-sum-norm").
    """

    name: str
    token_level: bool
    needs_groups: bool
    needs_critic: bool
    batch_statistics: bool
    paper: str
    needs_turns: bool = False
    loss_agg: str = "seq-mean-token-mean"


#: The advantage estimators by name (`algorithm.adv_estimator`), in the config's order.
ESTIMATORS: dict[str, Estimator] = {e.name: e for e in (
    Estimator("gae", token_level=True, needs_groups=False, needs_critic=True, batch_statistics=True,
              paper="PPO with generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438)"),
    Estimator("grpo", token_level=False, needs_groups=True, needs_critic=False, batch_statistics=False,
              paper="(R - group mean) / (group std + 1e-6) (GRPO, arXiv 2402.03300)"),
    Estimator("drgrpo", token_level=False, needs_groups=True, needs_critic=False, batch_statistics=False,
              paper="R - group mean, no std division, a constant loss normaliser (Dr.GRPO, arXiv 2503.20783)",
              loss_agg="seq-mean-token-sum-norm"),
    Estimator("rloo", token_level=False, needs_groups=True, needs_critic=False, batch_statistics=False,
              paper="R minus the mean of the group's other trajectories (RLOO, arXiv 2402.14740)"),
    Estimator("reinforce_pp", token_level=True, needs_groups=False, needs_critic=False, batch_statistics=True,
              paper="token returns normalised over the batch (REINFORCE++, arXiv 2501.03262)"),
    Estimator("reinforce_pp_baseline", token_level=False, needs_groups=True, needs_critic=False,
              batch_statistics=True, paper="R - group mean, normalised over the batch's tokens (REINFORCE++-baseline)"),
    Estimator("bilevel_gae", token_level=True, needs_groups=False, needs_critic=True, batch_statistics=True,
              needs_turns=True, paper="a GAE over turns, then one inside each turn (RAGEN head's bi-level GAE)"),
    Estimator("turn_rloo", token_level=True, needs_groups=True, needs_critic=False, batch_statistics=False,
              needs_turns=True, paper="each turn's reward-to-go minus the group's leave-one-out mean at that turn"),
)}
ESTIMATOR_NAMES: tuple[str, ...] = tuple(ESTIMATORS)


@dataclass(frozen=True)
class LossAggregation:
    """How token losses become a mini-batch's loss (verl's `loss_agg_mode` names).

    per_token: the mini-batch's denominator counts its scored tokens ("token-mean"); else it
    counts its trajectories with a scored token (the seq-mean modes). constant_norm: that
    count is multiplied by a constant token count C (`TrainConfig.loss_norm`), Dr.GRPO's
    normaliser. kernel_mode: the fastpo.kernels aggregation that computes it with that
    denominator. The equations are fastpo.kernels.torch_reference.aggregate's (the loss
    specification): "seq-mean-token-sum-norm" is its "seq-mean-token-sum" with denominator
    (trajectories x C), i.e. sum_i sum_t l_it / (G C) (Dr.GRPO, arXiv 2503.20783, Sec. 3.2:
    no 1/|o_i|, a constant in its place; verl's mode of that name)."""

    name: str
    per_token: bool
    constant_norm: bool = False
    kernel_mode: str = ""

    def __post_init__(self):
        if not self.kernel_mode:
            object.__setattr__(self, "kernel_mode", self.name)


#: The loss aggregations by name (`algorithm.loss_agg`, `algorithm.value_loss_agg`).
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {a.name: a for a in (
    LossAggregation("token-mean", per_token=True),
    LossAggregation("seq-mean-token-sum", per_token=False),
    LossAggregation("seq-mean-token-mean", per_token=False),
    LossAggregation("seq-mean-token-sum-norm", per_token=False, constant_norm=True, kernel_mode="seq-mean-token-sum"),
)}
LOSS_AGGREGATION_NAMES: tuple[str, ...] = tuple(LOSS_AGGREGATIONS)


def estimator(name: str) -> Estimator:
    """The facts of estimator `name`; ValueError naming it and the known ones otherwise."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def loss_aggregation(name: str) -> LossAggregation:
    """The facts of loss aggregation `name`; ValueError naming it and the known ones otherwise."""
    if name not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {name!r}; choose from {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[name]


def loss_denominator_of(loss_agg: str, scored_tokens: int, scored_trajectories: int, norm: int = 1) -> float:
    """The normaliser of a mini-batch's loss under `loss_agg`, from its counts (over every
    process's part of it): its scored tokens for a per-token aggregation, else its
    trajectories with a scored token (at least 1), times `norm` (tokens, >= 1) for a
    constant-norm one ("seq-mean-token-sum-norm"). So that micro-batch losses, each divided by
    it, accumulate to the mini-batch's loss (fastpo.kernels.aggregation_weights' denominator,
    with the aggregation's `kernel_mode`)."""
    agg = loss_aggregation(loss_agg)
    if agg.per_token:
        return float(max(1, scored_tokens))
    return float(scored_trajectories or 1) * (norm if agg.constant_norm else 1)
