"""The user's code a training configuration names, imported and tried before any model loads
(`check_user_code`): each game built with its options (a plain-Python game also played once,
its reference lines checked), the judge's rubric read and checked, reward.fn imported. Errors are
one-line ConfigErrors naming the key. fastpo.envs, fastpo.rubric and fastpo.rewards are imported
on first use, as in fastpo.config.members: `import fastpo.config` loads neither a game nor torch
(which fastpo.rewards imports)."""
from __future__ import annotations

from typing import Optional

from fastpo.config.fields import ConfigError
from fastpo.config.members import member_rollout_config
from fastpo.config.schema import TrainConfig, eval_horizon, eval_seeds


def check_user_code(cfg: TrainConfig, members: Optional[list] = None) -> None:
    """Build each game of TrainConfig `cfg` once with its options (`members`: env.mixture's
    checked members, None for one game in env.name; a plain-Python game's reference lines are
    checked on the evaluation's seeds and horizon), check the judge's rubric (its text or its
    file) and import reward.fn. Raises ConfigError naming the key."""
    if members is None:
        check_env_options(cfg.env.name, cfg.env.options, (eval_seeds(cfg), eval_horizon(cfg.rollout)))
    for m in members or []:
        check_env_options(m.name, m.options, (eval_seeds(cfg), eval_horizon(member_rollout_config(cfg, m))),
                          member=m)
    for key in ("judge_rubric", "judge_rubric_file"):
        value = getattr(cfg.reward, key)
        if value is not None:
            from fastpo.rubric import check_rubric, read_rubric

            try:
                (check_rubric if key == "judge_rubric" else read_rubric)(value)
            except ValueError as e:
                raise ConfigError(f"config key 'reward.{key}' = {value[:60]!r}: {e}") from None
    if cfg.reward.fn is not None:
        from fastpo.rewards import load_reward_fn

        try:
            load_reward_fn(cfg.reward.fn)
        except ValueError as e:
            raise ConfigError(f"config key 'reward.fn' = {cfg.reward.fn!r}: {e}") from None


def check_env_options(name: str, options: dict, bounds: Optional[tuple] = None, member=None) -> None:
    """Dry run: build one instance of env `name` with `options` (no model; cheap;
    `fastpo.envs.check_env`). Sokoban with non-default options also resets it once (under a
    second), which finds impossible levels such as more boxes than a room holds; a
    plain-Python game is played once and its reference lines checked on `bounds` = (eval
    seeds, horizon).

    Raises ConfigError naming `env.options` for an unknown key or a bad value, and the env for
    a name that does not resolve.
    """
    from fastpo.envs import EnvError, check_env, resolve_env

    key, opts = ("env.name", f"'env.options' = {options!r}") if member is None else \
        (f"env.mixture ({member.label})", f"'env.mixture' ({member.label}) options {options!r}")
    try:
        resolve_env(name)
    except EnvError as e:
        raise ConfigError(f"config key '{key}': {e}") from None
    try:
        check_env(name, options, bounds)
    except EnvError as e:
        raise ConfigError(f"config key '{key}' = {name!r}: {e}" if not options else
                          f"config key {opts} for env {name!r}: {e}") from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError(f"config key {opts} for env {name!r}: {e}") from None
