"""The training configuration (`fastpo.config`):

- schema: the dataclasses (`TrainConfig` and its sections) with the paper's defaults, each
  key's documentation and rule beside its field; algorithm: the `algorithm` section;
  imitation: the `sft` and `dagger` sections of the imitation commands;
- fields: the field machinery (keys, rules, types, dotted overrides, merging);
- loading: building a configuration (defaults -> presets -> env preset -> file -> overrides)
  and reading a run's saved one; presets: the named presets; files: config files and run
  `config.yaml`;
- validation: the rules relating keys (`validate`); usercode: the user's games, reward.fn and
  rubric tried before any model loads; members: the games of a configuration.

    cfg = load_config(env="sokoban", preset="cpu", overrides=["rollout.group_size=8"])

The names below are the package's public API; fastpo's own modules import from the module
that defines a name.
"""
from fastpo.config.algorithm import AlgorithmConfig
from fastpo.config.fields import ConfigError
from fastpo.config.imitation import DaggerConfig, SFTConfig
from fastpo.config.loading import config_from_dict, default_run_folder, load_config, load_run_config, read_run_config
from fastpo.config.members import env_preset
from fastpo.config.presets import PRESETS
from fastpo.config.schema import (
    EnvConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RolloutSection,
    TrainConfig,
    TrainerSection,
    context_window_turns,
    eval_horizon,
    eval_seeds,
)
from fastpo.config.validation import validate

__all__ = [
    "AlgorithmConfig", "ConfigError", "DaggerConfig", "EnvConfig", "ModelConfig", "OptimConfig", "PRESETS",
    "RolloutConfig", "RolloutSection", "SFTConfig", "TrainConfig", "TrainerSection", "config_from_dict",
    "context_window_turns", "default_run_folder", "env_preset", "eval_horizon", "eval_seeds",
    "load_config", "load_run_config", "read_run_config", "validate",
]
