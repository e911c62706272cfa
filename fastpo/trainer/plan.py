"""The run's plan: each setting that several parts of the trainer act on, decided once at
set-up and read (never re-derived) by the parts.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from fastpo.config.schema import TrainConfig
from fastpo.registry import estimator


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What the parts read instead of deciding it again.

    kl_coef: the KL coefficient (0: no reference model); kl_in_reward: the KL goes on the
    reward before the advantages (`TrainConfig.kl_in_reward`), else into the loss.
    filter_mode: StarPO-S's effective filter ("none" with group_size 1: no in-group std).
    needs_critic / separate_critic: a value head, on the policy's trunk or its own body.
    old_logprob_source: "sampler" | "recompute" (`fastpo.trainer.old_logprob.resolve_old_logprob`; None
    until the engine exists, then decided by `fastpo.trainer.setup.build_parts`).
    per_group_streams: each env group samples from its own stream (`rollout.sampling_streams`
    "group", or "auto" in a process group), else one stream for the batch.
    """

    kl_coef: float
    kl_in_reward: bool
    filter_mode: str
    needs_critic: bool
    separate_critic: bool
    old_logprob_source: Optional[str] = None
    per_group_streams: bool = False

    @property
    def reference_model(self) -> bool:
        """A frozen reference model is needed (a KL term)."""
        return self.kl_coef > 0


def rl_plan(cfg: TrainConfig, distributed: bool) -> RunPlan:
    """The plan of a StarPO run of `cfg` (`old_logprob_source` decided once the engine exists:
    `dataclasses.replace`); `distributed`: several processes."""
    a, r = cfg.algorithm, cfg.rollout
    return RunPlan(kl_coef=a.kl_coef, kl_in_reward=cfg.kl_in_reward,
                   filter_mode=a.filter_mode if r.group_size > 1 else "none",
                   needs_critic=estimator(a.adv_estimator).needs_critic, separate_critic=a.critic == "separate",
                   per_group_streams=distributed or r.sampling_streams == "group")


#: The plan of a supervised run: no critic, no reference model, no filter.
SUPERVISED = RunPlan(kl_coef=0.0, kl_in_reward=False, filter_mode="none", needs_critic=False, separate_critic=False,
                     old_logprob_source="recompute")
