"""Reward functions (`reward.fn`, fastpo.rewards): by hand on a two-trajectory batch, the
one-line errors, the config check before any model loads, and one training iteration."""
import math
import os
import types

import pytest
import torch
from rich.console import Console

from fastpo.cli import main as cli_main
from fastpo.config import load_config
from fastpo.config.fields import ConfigError
from fastpo.envs import EnvError
from fastpo.rewards import RewardFunction, Trajectory

SEEN = []


def polite(t: Trajectory):
    SEEN.append(t)
    return 1.0 if "please" in t.responses[-1] else 0.0


def per_turn(t: Trajectory):
    return [0.5 * (k + 1) for k in range(len(t.responses))]


def raises(t):
    raise RuntimeError("grader offline\nsecond line")


def wrong_length(t):
    return [1.0] * (len(t.responses) + 1)


def not_finite(t):
    return math.nan


def text(t):
    return "good"


def constant(t):
    return 2.0


def _batch():
    """Two trajectories: 2 turns (env rewards 0, 1; a format penalty -0.1 on turn 1) and 1 turn."""
    return types.SimpleNamespace(
        scores=torch.tensor([0.9, 0.0]), num_turns=torch.tensor([2, 1]),
        turn_rewards=torch.tensor([[-0.1, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        format_penalty=torch.tensor([[-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        seeds=torch.tensor([11, 12]), success=torch.tensor([True, False]), stop_reason=["env_done", "max_turns"],
        user_messages=[["task", "obs 1"], ["task"]], response_texts=[["no", "yes please"], ["nope"]])


def test_add_and_replace_by_hand():
    b = _batch()
    SEEN.clear()
    m = RewardFunction("test_rewards:polite", "add", "bandit").apply(b)
    torch.testing.assert_close(b.turn_rewards, torch.tensor([[-0.1, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert b.scores.tolist() == pytest.approx([1.9, 0.0]) and m == {"reward_fn_sum": 1.0, "count": 2.0}
    t = SEEN[0]
    assert (t.env, t.seed, t.responses, t.user_messages, t.success, t.stop_reason) == \
        ("bandit", 11, ["no", "yes please"], ["task", "obs 1"], True, "env_done")
    assert t.env_rewards == pytest.approx([0.0, 1.0]) and t.format_penalty == pytest.approx([-0.1, 0.0])
    b = _batch()
    RewardFunction("test_rewards:per_turn", "replace", "bandit").apply(b)
    # the game's rewards replaced, the format penalty kept; turns past the end untouched
    torch.testing.assert_close(b.turn_rewards, torch.tensor([[0.4, 1.0, 0.0], [0.5, 0.0, 0.0]]))
    assert b.scores.tolist() == pytest.approx([1.4, 0.5])


@pytest.mark.parametrize("fn,match", [
    ("raises", r"reward function 'test_rewards:raises' on env 'bandit', seed 11 raised RuntimeError: grader offline$"),
    ("wrong_length", r"seed 11 returned 3 values for 2 turns"),
    ("not_finite", r"seed 11 returned nan; return a finite float"),
    ("text", r"seed 11 returned 'good'"),
])
def test_a_failing_function_is_one_line_naming_it_and_the_seed(fn, match):
    with pytest.raises(EnvError, match=match) as e:
        RewardFunction(f"test_rewards:{fn}", "add", "bandit").apply(_batch())
    assert "\n" not in str(e.value)


def test_bad_specs_are_config_errors_before_any_model_loads(capsys):
    for spec, why in (("nomodule_xyz:f", "No module named 'nomodule_xyz'"), ("test_rewards:missing", "has no"),
                      ("test_rewards:SEEN", "is a list, not a function"), ("justaname", "the form is")):
        with pytest.raises(ConfigError, match="reward.fn") as e:
            load_config(env="bandit", preset="tiny", overrides=[f"reward.fn={spec}"])
        assert why in str(e.value) and "\n" not in str(e.value)
    assert cli_main(["train", "--env", "bandit", "--preset", "tiny", "reward.fn=nomodule_xyz:f"]) == 2
    err = capsys.readouterr().err
    assert "reward.fn" in err and "Traceback" not in err


def test_replace_mode_trains_on_the_functions_reward(tmp_path):
    from fastpo.trainer import Trainer

    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "reward.fn=test_rewards:constant",
        "reward.mode=replace", "trainer.iterations=1", "trainer.eval_every=0", "trainer.plots=false"])
    rec = Trainer(cfg, console=Console(quiet=True)).run()[0]
    assert rec["train/reward_fn_mean"] == 2.0
    # every score is 2 plus its format penalty (the game's own reward is gone)
    assert rec["train/score_mean"] <= 2.0


def exits(t):
    import sys

    sys.exit(4)


def interrupts(t):
    raise KeyboardInterrupt


def too_large(t):
    return 1e39  # a finite Python float, inf in float32


@pytest.mark.parametrize("fn,said", [
    ("exits", "reward function 'test_rewards:exits' on env 'bandit', seed {seed} called sys.exit(4)"),
    ("interrupts", "reward function 'test_rewards:interrupts' on env 'bandit', seed {seed} raised "
                   "KeyboardInterrupt (not a Ctrl-C: no signal arrived)"),
    ("too_large", "reward function 'test_rewards:too_large' on env 'bandit', seed {seed} returned 1e+39, beyond "
                  "float32's range"),
])
def test_a_function_that_exits_interrupts_or_overflows_stops_the_run_in_one_line(tmp_path, capsys, fn, said):
    """Issue 58 items 1 and 2: sys.exit inside a reward function ended the run silently (exit 4);
    1e39 passed every check and every update was skipped, exit 0."""
    from fastpo.seeds import iteration_seeds

    out = str(tmp_path / "run")
    assert cli_main(["train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--out", out,
                     "--iterations", "1", f"reward.fn=test_rewards:{fn}", "trainer.eval_every=0",
                     "trainer.plots=false", "rollout.max_new_tokens=4"]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    seeds = iteration_seeds(0, 1, 1)
    assert len(err) == 1 and err[0].startswith("fastpo train: error: "), err
    assert any(said.format(seed=s) in err[0] for s in seeds), err[0]


def near_float32_max(t):
    return 3e38  # within float32, but the critic's squared error is not


def test_a_run_whose_every_update_is_skipped_does_not_exit_0(tmp_path, capsys):
    """Issue 58 item 2: a run whose every update was skipped (non-finite loss) printed its
    summary and exited 0 as if it had trained."""
    out = str(tmp_path / "run")
    assert cli_main(["train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--out", out,
                     "reward.fn=test_rewards:near_float32_max", "reward.mode=replace", "trainer.eval_every=0",
                     "trainer.plots=false", "rollout.max_new_tokens=4"]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fastpo train: error:")]
    assert len(err) == 1 and "nothing was trained: every update of iterations 1-2 was skipped" in err[0], err
    assert os.path.isdir(os.path.join(out, "checkpoints"))  # what ran is kept, as after any failure
