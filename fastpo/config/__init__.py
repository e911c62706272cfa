"""The training configuration (`fastpo.config`): the schema with the paper's defaults and the
cross-field checks (schema), the `sft` and `dagger` sections of the imitation commands
(imitation), the field machinery: rules, types, dotted overrides, merging (fields), the named
presets (presets), config files and run `config.yaml` (files).

    cfg = load_config(env="sokoban", preset="cpu", overrides=["rollout.group_size=8"])

The names below are the package's public API; fastpo's own modules import from the module
that defines a name.
"""
from fastpo.config.fields import ConfigError
from fastpo.config.imitation import DaggerConfig, SFTConfig
from fastpo.config.presets import PRESETS
from fastpo.config.schema import (
    AlgorithmConfig,
    EnvConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    RolloutSection,
    TrainConfig,
    TrainerSection,
    config_from_dict,
    context_window_turns,
    default_run_folder,
    env_preset,
    eval_horizon,
    eval_seeds,
    load_config,
    load_run_config,
    read_run_config,
    validate,
)

__all__ = [
    "AlgorithmConfig", "ConfigError", "DaggerConfig", "EnvConfig", "ModelConfig", "OptimConfig", "PRESETS",
    "RolloutConfig", "RolloutSection", "SFTConfig", "TrainConfig", "TrainerSection", "config_from_dict",
    "context_window_turns", "default_run_folder", "env_preset", "eval_horizon", "eval_seeds",
    "load_config", "load_run_config", "read_run_config", "validate",
]
