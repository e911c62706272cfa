"""StarPO / StarPO-S algorithm pieces: advantages (GAE, GRPO, Dr.GRPO), rollout filtering, value loss.

The policy loss itself (clipped ratio, clip-higher, dual clip, entropy bonus, KL, aggregation)
is computed from hidden states by `fastpo.kernels`; these functions prepare its inputs.
"""
from fastpo.algorithms.advantages import (
    apply_kl_penalty,
    compute_gae,
    grpo_advantages,
    masked_whiten,
    place_rewards,
)
from fastpo.algorithms.filtering import (FilterResult, filter_groups, group_reward_std, select_groups,
                                        soft_advantage_weights)
from fastpo.algorithms.losses import aggregate_loss, clipped_value_loss

__all__ = [
    "apply_kl_penalty",
    "compute_gae",
    "grpo_advantages",
    "masked_whiten",
    "place_rewards",
    "FilterResult",
    "filter_groups",
    "group_reward_std",
    "select_groups",
    "soft_advantage_weights",
    "aggregate_loss",
    "clipped_value_loss",
]
