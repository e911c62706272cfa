"""The main job learns its answer format: a small CPU run of the CPU preset (the embedded
SmolLM2-135M-Instruct on FrozenLake, answer-only with answer examples, Dr.GRPO) raises the
format-valid rate (1 - format-penalty rate) on fixed eval seeds at temperature 0.5.

Scaled down from `make train` to fit a test: 2 env groups x 4 trajectories, one turn, three
updates at a higher learning rate, 16 eval seeds before and after. The margin was measured
on training seeds 0, 1 and 2 (README, "The main job on 2 CPU cores").
"""
import json
import os

import pytest
from rich.console import Console

from fastpo.config import load_config
from fastpo.trainer import Trainer

pytestmark = pytest.mark.slow

MARGIN = 0.1


def test_cpu_preset_raises_the_format_valid_rate(tmp_path):
    out = str(tmp_path / "run")
    cfg = load_config(env="frozenlake", preset="cpu", overrides=[
        f"trainer.output_dir={out}", "trainer.seed=0", "rollout.env_groups=2", "rollout.group_size=4",
        "rollout.max_turns=1", "optim.mini_batch_size=8", "optim.actor_lr=5e-5", "trainer.iterations=3",
        "trainer.eval_every=3", "trainer.eval_seeds=16", "trainer.plots=false", "trainer.collapse_every=0",
        "trainer.progress=false"])
    records = Trainer(cfg, console=Console(quiet=True)).run()
    evals = [r for r in records if "eval/format_valid" in r]
    assert [r["iteration"] for r in evals] == [0, 3]
    before, after = evals[0]["eval/format_valid"], evals[-1]["eval/format_valid"]
    assert after >= before + MARGIN, (before, after)
    # the per-seed outcomes behind the before/after table are written
    with open(os.path.join(out, "eval", "iter_000003.json")) as f:
        assert len(json.load(f)["format_valid"]) == 16
