"""The games of a training configuration: its members (`env_members`: env.mixture's entries, or
the one game of env.name), the rollout settings each plays with (`member_rollout_config`) and
the settings a game fixes (`env_preset`). The names resolve through fastpo.envs (a plain-Python
game's module is imported then), imported on first use: `import fastpo.config` loads no game."""
from __future__ import annotations

from fastpo.config.fields import ConfigError
from fastpo.config.schema import RolloutConfig, TrainConfig


def env_members(cfg: TrainConfig) -> list:
    """The games of TrainConfig `cfg` as `fastpo.envs.EnvMember`s: env.mixture's entries, or one
    member (label = env.name, weight 1) for a single game. Raises ConfigError for a bad mixture."""
    from fastpo.envs import EnvError, EnvMember, parse_mixture

    if not cfg.env.mixture:
        return [EnvMember(cfg.env.name, cfg.env.name, 1.0, dict(cfg.env.options), {})]
    try:
        return parse_mixture(cfg.env.mixture)
    except EnvError as err:
        raise ConfigError(f"config key 'env.mixture': {err}") from None


def member_rollout_config(cfg: TrainConfig, member) -> RolloutConfig:
    """The RolloutConfig a member plays with: the run's `rollout` section, then (in a mixture)
    the game's own settings (e.g. Bandit's single turn), then the entry's `settings`. A single
    game's settings were applied with the presets, so its member takes the section as it is."""
    if not cfg.env.mixture:
        return cfg.rollout.rollout_config()
    from fastpo.envs import resolve_env

    return cfg.rollout.rollout_config(**{**resolve_env(member.name).settings, **member.settings})


def env_preset(name: str) -> dict:
    """The settings env `name` fixes (its spec's: `fastpo.envs.names.BUILTIN_SETTINGS` for a
    built-in game, a plain-Python game's `settings`); ConfigError naming `env.name` when the name does not resolve."""
    from fastpo.envs import EnvError, env_preset as preset

    try:
        return preset(name)
    except EnvError as e:
        raise ConfigError(f"config key 'env.name': {e}") from None
