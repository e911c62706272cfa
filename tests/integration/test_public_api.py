"""`import fastpo` is the public API (train, load_config, evaluate, the config classes), each
name imported on first use: `import fastpo` loads no torch, `import fastpo.kernels` torch alone."""
import subprocess
import sys

import pytest


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_fastpo_is_light_and_kernels_load_torch_alone():
    code = (
        "import sys, fastpo\n"
        "heavy = ('torch', 'transformers', 'numba', 'fastpo.trainer', 'fastpo.evaluate', 'fastpo.config')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "fastpo.TrainConfig\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "import fastpo.kernels\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    assert _run(code).splitlines() == ["[]", "['fastpo.config']", "['fastpo.config', 'torch']"]


def test_public_names_are_the_implementations():
    import fastpo
    import fastpo.config as config
    import fastpo.evaluate as evaluate_module
    import fastpo.trainer as trainer

    assert fastpo.train is trainer.train and fastpo.load_config is config.load_config
    for name in ("TrainConfig", "ModelConfig", "EnvConfig", "RolloutSection", "AlgorithmConfig", "OptimConfig",
                 "TrainerSection", "ConfigError"):
        assert getattr(fastpo, name) is getattr(config, name), name
    # `fastpo.evaluate` is the evaluation module, and calling it is `fastpo eval`
    assert fastpo.evaluate is evaluate_module and callable(fastpo.evaluate)
    from fastpo import evaluate
    assert evaluate is evaluate_module and evaluate.run_eval is evaluate_module.run_eval
    assert set(fastpo.__all__) <= set(dir(fastpo))
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        fastpo.trian  # noqa: B018


def test_evaluate_called_runs_fastpo_eval(monkeypatch):
    import fastpo
    import fastpo.evaluate as ev

    seen = {}
    monkeypatch.setattr(ev, "run_eval", lambda cfg, console=None, samples_dir=None: seen.setdefault("cfg", cfg))
    cfg = fastpo.load_config(env="bandit", preset="tiny")
    assert fastpo.evaluate(cfg) is cfg and seen["cfg"] is cfg


def test_bad_config_is_a_config_error():
    import fastpo

    with pytest.raises(fastpo.ConfigError, match="rollout.group_size"):
        fastpo.load_config(env="bandit", overrides=["rollout.group_size=0"])


def test_kernels_import_is_light():
    """`import fastpo.kernels` pulls in torch only: no transformers, no triton, nothing else of fastpo."""
    import subprocess
    import sys

    code = ("import sys, fastpo.kernels; "
            "print(sorted(m for m in ('transformers', 'triton', 'fastpo.trainer', 'fastpo.envs_native') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
