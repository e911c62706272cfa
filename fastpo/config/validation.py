"""The rules relating a training configuration's keys (`validate`): each refuses an impossible
combination with a one-line ConfigError naming the key and its value, before any model loads.
A rule on one key alone lives on its field (`checked`, fastpo.config.fields) and is applied here
to every section; the rules of the `sft` and `dagger` sections are here too (`check_imitation`).
With check_env, `validate` also imports and tries the user's code the configuration names
(fastpo.config.usercode)."""
from __future__ import annotations

import math
from typing import Any, Optional

from fastpo.config.algorithm import AlgorithmConfig
from fastpo.config.fields import FLOAT32_MAX, ConfigError, check_fields, section_items
from fastpo.config.imitation import OPTIONAL_SECTIONS
from fastpo.config.members import member_rollout_config
from fastpo.config.schema import TrainConfig
from fastpo.config.usercode import check_user_code
from fastpo.registry import estimator


def validate(cfg: TrainConfig, check_env: bool = True) -> TrainConfig:
    """Refuse impossible values with a ConfigError naming the key; returns `cfg`. With
    check_env (the default) each game is also built with its options and the user's code the
    configuration names is imported (`check_user_code`); with check_env=False the env name is
    checked but no instance is built with env.options (for a look-up that only needs other keys,
    e.g. which model `fastpo eval` loads)."""
    r, a, o, t = cfg.rollout, cfg.algorithm, cfg.optim, cfg.trainer

    def need(cond: bool, key: str, value: Any, why: str) -> None:
        if not cond:
            raise ConfigError(f"config key {key!r} = {value!r}: {why}")

    optional = [getattr(cfg, n) for n in OPTIONAL_SECTIONS if getattr(cfg, n) is not None]
    for section in (cfg.model, cfg.env, r, a, o, t, cfg.reward, *optional):
        for key, v in section_items(section):
            vals = v if isinstance(v, list) else [v]
            # beyond float32's range a finite float is inf in the tensors it enters (every update skipped)
            if any(isinstance(x, float) and not (math.isfinite(x) and abs(x) <= FLOAT32_MAX) for x in vals):
                name = {id(cfg.model): "model", id(cfg.env): "env", id(r): "rollout", id(a): "algorithm",
                        id(o): "optim", id(t): "trainer", id(cfg.reward): "reward",
                        **{id(getattr(cfg, n)): n for n in OPTIONAL_SECTIONS}}[id(section)]
                raise ConfigError(f"config key '{name}.{key}' = {v!r}: must be a finite number within float32's "
                                  f"range (+-{FLOAT32_MAX:.4g}), in which fastpo computes")
    # single-field rules live on the fields (`checked`); what follows relates fields
    for section, name in ((cfg.model, "model"), (cfg.env, "env"), (r, "rollout"), (a, "algorithm"), (o, "optim"),
                          (t, "trainer"), (cfg.reward, "reward")):
        check_fields(section, f"{name}.")
    for name in OPTIONAL_SECTIONS:
        if getattr(cfg, name) is not None:
            check_fields(getattr(cfg, name), f"{name}.")
    check_imitation(cfg)
    rw = cfg.reward
    need(rw.judge_model is None or rw.judge_rubric is not None or rw.judge_rubric_file is not None,
         "reward.judge_model", rw.judge_model, "names a judge, but no rubric is set (reward.judge_rubric or "
         "reward.judge_rubric_file)")
    need(rw.judge_scale != "number" or rw.judge_min < rw.judge_max, "reward.judge_max", rw.judge_max,
         f"must be above reward.judge_min ({rw.judge_min})")
    need(r.max_new_tokens < r.max_context, "rollout.max_new_tokens", r.max_new_tokens,
         f"must be below rollout.max_context ({r.max_context})")
    need(r.engine == "native" or cfg.model.lora_rank == 0, "rollout.engine", r.engine,
         "the SGLang engine takes full weights; LoRA (model.lora_rank > 0) needs rollout.engine=native")
    need(bool(cfg.model.lora_target_modules) and all(isinstance(m, str) and m for m in cfg.model.lora_target_modules),
         "model.lora_target_modules", cfg.model.lora_target_modules,
         "must list the names of the modules LoRA adapts, e.g. [q_proj, v_proj]")
    _check_policy_loss(a, need)
    need(a.overlong_buffer <= r.max_new_tokens, "algorithm.overlong_buffer", a.overlong_buffer,
         f"must be <= rollout.max_new_tokens ({r.max_new_tokens}): the penalty ramps over the last tokens before it")
    if estimator(a.adv_estimator).needs_groups:
        need(r.group_size >= 2, "rollout.group_size", r.group_size,
             f"must be >= 2 for adv_estimator={a.adv_estimator!r} (its baseline is the env group)")
    _check_off_policy(cfg, need)
    need(r.context_window == "full" or (r.reuse == 1 and r.replay == 0), "rollout.context_window",
         r.context_window, "a bounded context window does not support rollout.reuse > 1 or rollout.replay > 0 yet")
    need(r.context_window == "full" or r.engine == "native", "rollout.context_window", r.context_window,
         "a bounded context window needs rollout.engine=native (it evicts KV entries per session)")
    need(len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas),
         "optim.betas", o.betas, "must be two numbers in [0, 1)")
    need(o.mini_batch_size <= cfg.train_batch_size, "optim.mini_batch_size", o.mini_batch_size,
         f"is larger than the training batch ({cfg.kept_groups} kept env groups x {r.group_size} "
         f"trajectories = {cfg.train_batch_size})")
    need(t.eval_seed_offset + t.eval_seeds <= 2**32, "trainer.eval_seed_offset", t.eval_seed_offset,
         f"+ trainer.eval_seeds ({t.eval_seeds}) must be <= 2**32 (env seeds are 32-bit)")
    if t.wandb:
        import importlib.util

        need(importlib.util.find_spec("wandb") is not None, "trainer.wandb", t.wandb,
             "wandb is not installed (pip install wandb)")
    members = _check_mixture(cfg, need)
    if check_env:
        check_user_code(cfg, members)
    return cfg


def _check_policy_loss(a: AlgorithmConfig, need) -> None:
    """algorithm.policy_loss is a registered loss; every registered loss's own settings keep
    their rules (`fastpo.kernels.losses.settings_problem`); the clip bounds form PPO's range and
    GSPO's sequence ratio is used as the loss's facts (`PolicyLoss`) allow."""
    from fastpo.kernels import losses  # torch: `import fastpo.config` loads none, validating does

    need(a.policy_loss in losses.POLICY_LOSSES, "algorithm.policy_loss", a.policy_loss,
         f"must be one of {', '.join(losses.POLICY_LOSSES)} (the registered policy losses; "
         "fastpo.kernels.register_policy_loss adds one)")
    problem = losses.settings_problem(a.loss_settings)
    if problem is not None:
        name, value, why = problem
        need(False, f"algorithm.{name}", value, why)
    loss = losses.POLICY_LOSSES[a.policy_loss]
    unbounded = ", ".join(n for n, x in losses.POLICY_LOSSES.items() if not x.clip_range)
    need(a.clip_high >= a.clip_low or not loss.clip_range, "algorithm.clip_high", a.clip_high,
         f"must be >= algorithm.clip_low ({a.clip_low})")
    need(a.clip_low < 1 or not loss.clip_range, "algorithm.clip_low", a.clip_low,
         f"must be < 1 (the ratio's lower clip bound is 1 - clip_low; only the IS weight of policy_loss "
         f"{unbounded} may go without a lower bound, clip_low >= 1)")
    need(a.ratio_level == "token" or loss.sequence_ratio, "algorithm.ratio_level", a.ratio_level,
         f"GSPO's sequence ratio is defined for policy_loss "
         f"{' and '.join(n for n, x in losses.POLICY_LOSSES.items() if x.sequence_ratio)}, not {a.policy_loss!r}")


def _check_off_policy(cfg: TrainConfig, need) -> None:
    """Rollout reuse, replay and the importance-sampling correction (issue 13's keys)."""
    a = cfg.algorithm
    need(not (a.ratio_level == "sequence" and a.is_correction != "none" and a.is_level == "token"),
         "algorithm.is_level", a.is_level,
         f"contradicts algorithm.ratio_level='sequence' (GSPO) with is_correction={a.is_correction!r}: a "
         "trajectory's one ratio cannot take per-token weights; use algorithm.is_level=sequence")


def _check_mixture(cfg: TrainConfig, need) -> Optional[list]:
    """The members of env.mixture (None without one), each resolved and its rollout settings
    checked; ConfigError naming env.mixture or env.name for what is wrong."""
    from fastpo.envs import MIXTURE, EnvError, parse_mixture, resolve_env

    e = cfg.env
    if not e.mixture:
        need(e.name != MIXTURE, "env.name", e.name, "names a mixture: list its games in env.mixture "
             "(e.g. env.mixture=[sokoban, frozenlake]) or give --env a,b")
        return None
    need(e.name == MIXTURE, "env.name", e.name, f"is set beside env.mixture: give one game in env.name or several in "
         f"env.mixture (whose run's env.name is {MIXTURE!r})")
    need(not e.options, "env.options", e.options, "applies to one game: in a mixture give each entry its own "
         "'options'")
    try:
        members = parse_mixture(e.mixture)
        for m in members:
            resolve_env(m.name)
    except EnvError as err:
        raise ConfigError(f"config key 'env.mixture': {err}") from None
    for i, m in enumerate(members):
        try:
            member_rollout_config(cfg, m)
        except ValueError as err:
            raise ConfigError(f"config key 'env.mixture' entry {i} ({m.label}): {err}") from None
    return members


def check_batch_size(batch_size: int, n: int, what: str) -> None:
    """ConfigError when a step would take more than the whole data set (every step would
    repeat the same data, and an epoch would no longer be `n` items)."""
    if batch_size > n:
        raise ConfigError(f"config key 'sft.batch_size' = {batch_size}: more than the {n} {what}; "
                          f"choose at most {n}")


def check_imitation(cfg: TrainConfig) -> None:
    """The checks relating the optional sections to the rest of TrainConfig `cfg` (each
    section's own fields are checked by `check_fields`): an expert data set no smaller than a
    step; expert seeds (when round 0 or `fastpo sft` plays them) and the rounds' levels outside
    the eval seeds; a round's expert trajectories within its levels; no data file under
    `fastpo dagger`, which makes its data from the expert. Raises ConfigError naming the key."""
    sft, dag, t = cfg.sft, cfg.dagger, cfg.trainer
    lo, hi = t.eval_seed_offset, t.eval_seed_offset + t.eval_seeds
    if dag is not None:
        if sft is not None and sft.data:
            raise ConfigError(f"config key 'sft.data' = {sft.data!r}: fastpo dagger makes its data from the game's "
                              f"expert; to train on a file, use fastpo sft sft.data=FILE")
        if dag.expert_trajectories > dag.levels:
            raise ConfigError(f"config key 'dagger.expert_trajectories' = {dag.expert_trajectories}: more than the "
                              f"{dag.levels} levels of a round (dagger.levels); the expert plays the round's first "
                              f"levels")
        a, b = dag.seed_offset, dag.seed_offset + dag.rounds * dag.levels
        if a < hi and lo < b:
            raise ConfigError(f"config key 'dagger.seed_offset' = {dag.seed_offset}: the levels of {dag.rounds} rounds "
                              f"[{a}, {b}) overlap the eval seeds [{lo}, {hi}); choose levels outside them")
    if sft is None or sft.data:
        return
    check_batch_size(sft.batch_size, sft.trajectories, "expert trajectories (sft.trajectories)")
    if (dag is None or dag.sft_round) and sft.seed_offset < hi and lo < sft.seed_offset + sft.trajectories:
        raise ConfigError(f"config key 'sft.seed_offset' = {sft.seed_offset}: the expert seeds "
                          f"[{sft.seed_offset}, {sft.seed_offset + sft.trajectories}) overlap the eval seeds "
                          f"[{lo}, {hi}); choose expert seeds outside them")

