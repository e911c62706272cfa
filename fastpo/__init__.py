"""fastpo: a kernel-optimized trainer for multi-turn RL of LLM agents (StarPO, arXiv 2504.20073).

The public API, each name imported on first use (PEP 562 module `__getattr__`), so that
`import fastpo` loads neither torch nor transformers and `import fastpo.kernels` loads torch
alone:

    import fastpo
    cfg = fastpo.load_config(env="frozenlake", preset="tiny", overrides=["model.name=random:tiny-llama"])
    records = fastpo.train(cfg)      # one metrics dict per iteration, as metrics.jsonl
    result = fastpo.evaluate(cfg)    # what `fastpo eval` reports for cfg.model.name

- `train(cfg, resume=False, overwrite=False)`: `fastpo train` without the command line
  (fastpo.trainer.train).
- `evaluate(cfg, console=None, samples_dir=None)`: `fastpo eval` without the command line
  (fastpo.evaluation.policy.run_eval); the evaluation's parts are in `fastpo.evaluation`.
- `load_config(env=None, preset=None, file=None, overrides=None)`: defaults -> presets ->
  env preset -> YAML file -> dotted overrides, validated; raises `ConfigError`.
- the config classes: `TrainConfig` and its sections `ModelConfig`, `EnvConfig`,
  `RolloutSection`, `AlgorithmConfig`, `OptimConfig`, `TrainerSection`; `ConfigError`.
"""

import importlib

__version__ = "0.1.0"

#: public name -> (module, attribute)
_EXPORTS = {
    "train": ("fastpo.trainer", "train"),
    "evaluate": ("fastpo.evaluation.policy", "run_eval"),
    "load_config": ("fastpo.config", "load_config"),
    "ConfigError": ("fastpo.config", "ConfigError"),
    "TrainConfig": ("fastpo.config", "TrainConfig"),
    "ModelConfig": ("fastpo.config", "ModelConfig"),
    "EnvConfig": ("fastpo.config", "EnvConfig"),
    "RolloutSection": ("fastpo.config", "RolloutSection"),
    "AlgorithmConfig": ("fastpo.config", "AlgorithmConfig"),
    "OptimConfig": ("fastpo.config", "OptimConfig"),
    "TrainerSection": ("fastpo.config", "TrainerSection"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastpo' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
