"""StarPO / StarPO-S algorithm pieces: advantages (GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++), rollout
filtering, value loss, importance-sampling correction for a sampler that is not the trainer.

The policy loss itself (clipped ratio, clip-higher, dual clip, entropy bonus, KL, aggregation)
is computed from hidden states by `fastpo.kernels`; these functions prepare its inputs.
"""
from fastpo.algorithms.advantages import (
    apply_kl_penalty,
    compute_bilevel_gae,
    compute_gae,
    grpo_advantages,
    masked_whiten,
    place_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    turn_rloo_advantages,
)
from fastpo.algorithms.estimators import (AdvantageInputs, AdvantageOutputs, estimate_advantages,
                                          register_estimator)
from fastpo.algorithms.correction import IS_CORRECTIONS, IS_LEVELS, RolloutCorrection, rollout_correction
from fastpo.algorithms.filtering import (FilterResult, dynamic_sampling_filter, filter_groups, group_reward_std,
                                         select_groups, soft_advantage_weights)
from fastpo.algorithms.value_loss import aggregate_loss, clipped_value_loss
from fastpo.algorithms.overlong import overlong_penalty, truncated_turn_mask

__all__ = [
    "apply_kl_penalty",
    "compute_bilevel_gae",
    "compute_gae",
    "grpo_advantages",
    "masked_whiten",
    "place_rewards",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "turn_rloo_advantages",
    "AdvantageInputs",
    "AdvantageOutputs",
    "estimate_advantages",
    "register_estimator",
    "IS_CORRECTIONS",
    "IS_LEVELS",
    "RolloutCorrection",
    "rollout_correction",
    "FilterResult",
    "filter_groups",
    "dynamic_sampling_filter",
    "overlong_penalty",
    "truncated_turn_mask",
    "group_reward_std",
    "select_groups",
    "soft_advantage_weights",
    "aggregate_loss",
    "clipped_value_loss",
]
