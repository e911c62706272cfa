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
        "heavy = ('torch', 'transformers', 'numba', 'fastpo.trainer', 'fastpo.evaluation', 'fastpo.config')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "fastpo.TrainConfig\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "import fastpo.kernels\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    assert _run(code).splitlines() == ["[]", "['fastpo.config']", "['fastpo.config', 'torch']"]


def test_public_names_are_the_implementations():
    import inspect

    import fastpo
    import fastpo.config as config
    import fastpo.evaluation.policy as evaluation
    import fastpo.trainer as trainer

    assert fastpo.train is trainer.train and fastpo.load_config is config.load_config
    for name in ("TrainConfig", "ModelConfig", "EnvConfig", "RolloutSection", "AlgorithmConfig", "OptimConfig",
                 "TrainerSection", "ConfigError"):
        assert getattr(fastpo, name) is getattr(config, name), name
    # `fastpo.evaluate` is `fastpo eval` as a function; it was a module whose class was swapped to
    # make it callable (issue 57)
    assert fastpo.evaluate is evaluation.run_eval and inspect.isfunction(fastpo.evaluate)
    from fastpo import evaluate
    assert evaluate is evaluation.run_eval
    with pytest.raises(ModuleNotFoundError):
        import fastpo.evaluate  # noqa: F401
    assert set(fastpo.__all__) <= set(dir(fastpo))
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        fastpo.trian  # noqa: B018


def test_evaluate_runs_fastpo_eval(tmp_path):
    """`fastpo.evaluate(cfg)` evaluates cfg.model.name as `fastpo eval` does (here a random model
    on 2 Bandit seeds, the samples file written where asked)."""
    import fastpo

    cfg = fastpo.load_config(env="bandit", preset="tiny", overrides=[
        "model.name=random:tiny-llama", "trainer.eval_seeds=2", "trainer.eval_group_size=2",
        "rollout.max_new_tokens=8"])
    res = fastpo.evaluate(cfg, samples_dir=str(tmp_path))
    assert res["model"].startswith("random:tiny-llama") and res["model_random_weights"]
    assert res["eval/num_seeds"] == 2 and 0.0 <= res["eval/success_rate"] <= 1.0
    assert res["eval/optimal_success"] == 1.0 and "eval/pass@2" in res
    assert (tmp_path / "iter_000000.txt").read_text().startswith("model: random:tiny-llama (random weights)\neval of")


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
