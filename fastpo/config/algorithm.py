"""The `algorithm` section of the training configuration (`AlgorithmConfig`): advantage
estimator, StarPO-S rollout filtering, the policy loss (a registered one, fastpo.kernels.losses)
with its own settings as keys of the section, clipping, KL, importance-sampling correction
and the critic. Each key's meaning is the `doc` beside its field; the rules relating keys are in
fastpo.config.validation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from fastpo.config.fields import ConfigError, at_least, checked, flat_settings, key
from fastpo.registry import ESTIMATOR_NAMES, LOSS_AGGREGATION_NAMES


def _policy_losses():
    """fastpo.kernels.losses: the registered policy losses with their facts and settings. Imported
    on first use, not at the top: a loss is a torch function registered beside its facts, and
    `import fastpo.config` loads no torch (validating a config does, as it has to)."""
    from fastpo.kernels import losses

    return losses


def _policy_loss_names() -> tuple[str, ...]:
    return tuple(_policy_losses().POLICY_LOSSES)


def _policy_loss_settings() -> dict:
    """The registered losses' own settings (the keys of `AlgorithmConfig.loss_settings`); one
    named like an algorithm key would be read as that key, so it is refused here."""
    declared = _policy_losses().loss_settings()
    taken = [n for n in declared if n in AlgorithmConfig.__dataclass_fields__]
    if taken:
        raise ConfigError(f"a registered policy loss takes a setting named {taken[0]!r}, which is the config key "
                          f"'algorithm.{taken[0]}' already: give the setting another name")
    return declared


def _in_unit(v: Any) -> bool:
    return 0 <= v <= 1


@dataclass
class AlgorithmConfig:
    """The `algorithm` section: StarPO / StarPO-S settings: advantages, rollout filtering, the
    policy loss and its clipping, KL, the critic."""

    adv_estimator: Literal[ESTIMATOR_NAMES] = key(  # fastpo.registry.ESTIMATORS
        "gae",
        doc='"gae" (PPO with a critic), "grpo" ((R - mean)/(std + 1e-6) per env group), "drgrpo" (R - mean, no std '
            'division; Dr.GRPO), "rloo" (R minus the mean of the group\'s other trajectories; RLOO), "reinforce_pp" '
            "(each model token's discounted return, normalised over the batch; REINFORCE++) or "
            '"reinforce_pp_baseline" (R - group mean, normalised over the batch\'s tokens), or "bilevel_gae" '
            "(RAGEN's bi-level GAE with a critic: a GAE over turns with `high_level_gamma`, then one inside each "
            'turn), or "turn_rloo" (turn-level credit without a critic: each turn\'s reward-to-go minus the '
            "leave-one-out mean of the group's rewards-to-go at that turn; use reward_position=turn); "
            "fastpo.algorithms.advantages.")
    gamma: float = checked(1.0, _in_unit, "must be in [0, 1]", doc="discount over model tokens (GAE, REINFORCE++).")
    lam: float = checked(1.0, _in_unit, "must be in [0, 1]", doc="GAE's lambda.")
    high_level_gamma: float = checked(
        0.95, _in_unit, "must be in [0, 1]",
        doc="bilevel_gae's discount over turns (RAGEN's `high_level_gamma`, 0.95); `gamma` is then its discount over "
            "the tokens inside a turn.")
    reward_position: Literal["last_token", "turn"] = key(
        "last_token",
        doc='where a trajectory\'s reward sits for GAE: "last_token" (the last model token of the trajectory, the '
            "paper's default) or \"turn\" (each turn's reward on that turn's last model token).")
    whiten_advantages: bool = key(True, doc="normalise GAE's advantages over the batch's model tokens.")
    filter_mode: Literal["top", "bottom", "none", "dynamic"] = key(
        "top",
        doc='StarPO-S rollout filtering: "top" keeps the `filter_ratio` of env groups with the highest in-group '
            'reward std, "bottom" the lowest, "none" keeps all; "dynamic" is DAPO\'s dynamic sampling: env groups '
            "whose rewards do not vary are dropped and more are drawn (fresh seeds) until `rollout.env_groups` of "
            "them vary or `dynamic_max_draws` rollouts were made.")
    dynamic_max_draws: int = checked(
        3, at_least(1), "must be >= 1",
        doc="filter_mode=dynamic's cap: rollouts of `rollout.env_groups` groups per iteration, the first included "
            "(verl's max_num_gen_batches); with fewer varying groups by then the update trains on those.")
    filter_ratio: float = checked(
        0.25, lambda v: 0 < v <= 1, "must be in (0, 1]",
        doc="the filter strategy's number (top_k: the share of groups kept).")
    filter_strategy: Literal["top_k", "top_p", "min_p"] = key(
        "top_k",
        doc="RAGEN head's rollout filters (fastpo/algorithms/filtering.py): \"top_k\" (the paper's: int(filter_ratio "
            'x groups), at least 1), "top_p" (the groups whose stds make up `filter_ratio` of the total), "min_p" '
            "(std >= filter_ratio x the best).")
    filter_top_p_mode: Literal["linear", "softmax"] = key(
        "linear",
        doc='top_p\'s measure: "linear" (stds, with slack `filter_eps`) or "softmax" (softmax mass of the stds).')
    filter_eps: float = checked(
        0.01, at_least(0), "must be >= 0",
        doc="top_p linear's slack (RAGEN's `rollout_filter_selection_eps`).")
    filter_keep_zero_std: bool = key(True, doc="false drops groups without reward spread first.")
    soft_advantage_reweight: bool = key(
        False,
        doc="scale each trajectory's advantages by its group's reward std / the batch's largest group std (RAGEN "
            "head), with or without filtering.")
    overlong_buffer: int = checked(
        0, at_least(0), "must be >= 0 (0 = no overlong reward shaping)",
        doc="DAPO's overlong reward shaping (0 = off): a response (one turn) longer than rollout.max_new_tokens - "
            "overlong_buffer tokens gets a reward of -overlong_penalty_factor * (its excess / overlong_buffer), down "
            "to -overlong_penalty_factor at the limit, on that turn.")
    overlong_penalty_factor: float = checked(1.0, at_least(0), "must be >= 0", doc="the shaping's largest penalty.")
    overlong_filter: bool = key(
        False,
        doc="DAPO's overlong filtering: a turn whose response stopped at rollout.max_new_tokens leaves the loss (the "
            "trajectory's other turns stay).")
    policy_loss: str = key(
        "ppo", choices=_policy_loss_names,
        doc="the policy-gradient term, a registered policy loss (fastpo.kernels.POLICY_LOSSES: the built-in ones "
            "with their equations in docs/algorithms.md, or one of your own, `fastpo.kernels.register_policy_loss`, "
            "registered before the config loads). dual_clip applies to the losses that take it; the keys below it to "
            "their own loss.")
    loss_settings: dict = flat_settings(
        _policy_loss_settings,
        doc="every registered policy loss's own settings by name (the rows that follow `algorithm.policy_loss`): "
            "each a key of this section itself (`algorithm.sapo_tau_pos=1.2`), declared with its loss "
            "(fastpo.kernels.LossSetting: default, rule, meaning), also read and set as an attribute "
            "(`algorithm.sapo_tau_pos`).")
    clip_low: float = checked(
        0.2, lambda v: v > 0, "must be > 0",
        doc="PPO's lower clip bound (ratio >= 1 - clip_low; < 1). With policy_loss=cispo the IS weight's lower "
            "bound, and >= 1 means none (CISPO's paper sets none).")
    clip_high: float = key(
        0.28,
        doc="PPO's upper clip bound (ratio <= 1 + clip_high; clip-higher when above clip_low; >= clip_low but with "
            "cispo).")
    dual_clip: Optional[float] = checked(
        3.0, lambda v: v is None or v > 1, "must be > 1 or null",
        doc="dual-clip bound on the loss for negative advantages (null = off).")
    entropy_coef: float = checked(
        0.001, at_least(0), "must be >= 0",
        doc="weight of the entropy bonus in the policy loss.")
    kl_coef: float = checked(
        0.0, at_least(0), "must be >= 0",
        doc="> 0 penalises KL to a frozen reference model (plain StarPO).")
    kl_estimator: Literal["k1", "k3"] = key("k1", doc='the KL estimator, "k1" or "k3".')
    kl_in_reward: Optional[bool] = key(
        None,
        doc="true puts the KL penalty per token on the reward before the advantages (verl's `apply_kl_penalty`, r_t "
            "- kl_coef * kl_t, what RAGEN's PPO runs did); false adds + kl_coef * kl_t to the policy loss (what its "
            "GRPO runs did); null picks the reward for gae and reinforce_pp and the loss for the group estimators.")
    loss_agg: Optional[Literal[LOSS_AGGREGATION_NAMES]] = key(  # fastpo.registry.LOSS_AGGREGATIONS
        None,
        doc="how token losses become the mini-batch loss; null (the default) takes the one the advantage estimator's "
            "paper pairs with it (fastpo.registry's Estimator `loss_agg`; `TrainConfig.loss_agg`): "
            "\"seq-mean-token-mean\", the RAGEN paper's objective (1/G) sum_i (1/|tau_i|) sum_t (each trajectory's "
            "token mean, then the mean over trajectories), for every estimator but drgrpo, which takes "
            '"seq-mean-token-sum-norm": sum_i sum_t / (G C), no per-trajectory 1/|tau_i| and a constant C '
            '(`loss_scale_factor`; Dr.GRPO, arXiv 2503.20783). "token-mean" (verl\'s default) divides by all tokens '
            'of the mini-batch; "seq-mean-token-sum" sums each trajectory\'s tokens.')
    loss_scale_factor: Optional[int] = checked(
        None, lambda v: v is None or v >= 1, "must be >= 1 or null",
        doc='the constant C of "seq-mean-token-sum-norm" in tokens; null = rollout.max_new_tokens x '
            "rollout.max_turns, the most model tokens a trajectory can hold (Dr.GRPO's code divides by the "
            "generation budget).")
    old_logprob: Literal["recompute", "sampler", "auto"] = key(
        "auto",
        doc='PPO\'s old log-probs "recompute"d by the trainer after the rollout, taken from the "sampler", or '
            '"auto": the sampler\'s exactly when they are the same quantity (native engine on the trained fp32 '
            "module; fastpo.trainer.old_logprob).")
    ratio_level: Literal["token", "sequence"] = key(
        "token",
        doc='PPO\'s per-token ratio ("token") or GSPO\'s sequence ratio ("sequence", arXiv 2507.18071: exp of the '
            "mean token log-ratio of a trajectory, clipped per trajectory).")
    is_correction: Literal["none", "tis", "mis"] = key(
        "none",
        doc='importance-sampling correction of the sampler -> trainer gap (fastpo.algorithms.correction): "none", '
            '"tis" (weight min(rho, is_cap), rho = pi_old / pi_sampler) or "mis" (weight rho, units whose rho leaves '
            "[1/is_cap, is_cap] dropped from the loss).")
    is_level: Literal["token", "sequence"] = key(
        "token",
        doc='the correction\'s unit: "token" or "sequence" (one rho per trajectory).')
    is_cap: float = checked(
        2.0, lambda v: v > 1, "must be > 1 (importance weights are truncated at is_cap, and mis keeps [1/is_cap, "
        "is_cap])",
        doc="the correction's truncation bound.")
    # critic (PPO only)
    critic: Literal["separate", "shared"] = key(
        "separate",
        doc='PPO\'s critic: "separate" (its own model) or "shared" (a value head on the policy\'s trunk).')
    value_clip: float = checked(
        0.5, lambda v: v > 0, "must be > 0",
        doc="the value loss's clip range around the old values.")
    value_coef: float = checked(0.5, at_least(0), "must be >= 0", doc="weight of the value loss (shared critic).")
    value_loss_agg: Literal[LOSS_AGGREGATION_NAMES] = key(
        "token-mean",
        doc="the critic's clipped value loss aggregated like `loss_agg` (the same function, "
            'fastpo.kernels.aggregate); "token-mean" by default: over all model tokens of the mini-batch.')

    def __getattr__(self, name: str) -> Any:
        # a registered loss's own setting as an attribute (cfg.algorithm.sapo_tau_pos), held in loss_settings
        held = self.__dict__.get("loss_settings")
        if held is not None and not name.startswith("_"):
            if name in held:
                return held[name]
            declared = _policy_losses().loss_settings().get(name)  # registered after this config was built
            if declared is not None:
                return declared.default
        raise AttributeError(f"'AlgorithmConfig' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dataclass_fields__ or name.startswith("_") or name not in _policy_losses().loss_settings():
            object.__setattr__(self, name, value)
        else:
            self.loss_settings[name] = value
