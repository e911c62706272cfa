"""Paper fidelity (issue 10): what a run reports and computes against values worked out by
hand or by plain Python here. The environment-level checks (RAGEN's FrozenLake maps, the
success bounds) live in the test_envs_* files."""
import numpy as np
import pytest
from rich.console import Console

from fastpo.config import load_config
from fastpo.envs_native import make_env
from fastpo.trainer import Trainer


def test_trainer_eval_reports_the_ceiling_and_floor_on_its_seeds_and_horizon(tmp_path):
    # 2 turns x 3 actions = 6, capped by 5 actions per trajectory: the horizon is 5
    cfg = load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "trainer.plots=false",
        "rollout.max_turns=2", "rollout.max_actions_per_turn=3", "rollout.max_actions_per_traj=5",
        "rollout.max_new_tokens=4", "trainer.eval_seeds=6", "trainer.eval_seed_offset=300"])
    tr = Trainer(cfg, console=Console(quiet=True))
    tr.setup()
    res = tr.evaluate(0)
    seeds = list(range(300, 306))
    env = make_env("frozenlake", 1)
    assert res["eval/optimal_success"] == pytest.approx(env.optimal_success(seeds, 5).mean(), abs=1e-12)
    assert res["eval/random_success"] == pytest.approx(env.random_success(seeds, 5).mean(), abs=1e-12)
    assert res["eval/optimal_success"] != pytest.approx(env.optimal_success(seeds, 6).mean())  # not 6 actions
    assert 0 <= res["eval/random_success"] < res["eval/optimal_success"] <= 1
    assert tr.evaluate(1)["eval/optimal_success"] == res["eval/optimal_success"]  # the same each time
