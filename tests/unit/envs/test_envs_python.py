"""Plain-Python environments (issue 26): a game defined here, in a test file, run by name
(`--env test_envs_python:Walk`), trained for an iteration and evaluated on the tiny random
model; the batched wrapper's named-move and free-text paths; per-instance random state;
worker processes against in-process; and every bad definition's one-line error (exit 2
from the CLI before any model loads)."""
import json
import os
import random

import numpy as np
import pytest

# Only light imports at the top: worker processes import this module to unpickle its games.
from fastpo.envs import EnvError, env_preset, make_env, resolve_env


def cli_main(argv):
    from fastpo.cli import main

    return main(argv)


class Walk:
    """A 1-D corridor: start at 0, the goal at `length`; moves Left / Right; a random
    "wind" cell (drawn from the global `random`, as TextArena's games do) pushes back."""

    action_names = ("Left", "Right")
    settings = {"max_turns": 3, "max_actions_per_turn": 2, "max_actions_per_traj": 6}

    def __init__(self, length: int = 3):
        self.length = length
        self.instructions = f"Walk right to reach the goal at {length}."

    def reset(self, seed):
        self.pos = 0
        self.wind = random.randint(1, self.length - 1) if self.length > 1 else -1
        return self._obs()

    def _obs(self):
        return "".join("P" if i == self.pos else ("G" if i == self.length else "_") for i in range(self.length + 1))

    def step(self, move):
        self.pos = max(0, self.pos + (1 if move == "Right" else -1))
        if self.pos == self.wind and random.random() < 0.5:
            self.pos -= 1
        win = self.pos == self.length
        return self._obs(), 1.0 if win else 0.0, win, {"success": win}

    def optimal_success(self, seeds, horizon):
        return [1.0 if horizon >= self.length else 0.0 for _ in seeds]


class Echo:
    """Free text: the answer "stop" ends the game with success; a number is valid, other text not."""

    def reset(self, seed):
        self.seed = seed
        return f"Say a number or stop (seed {seed})."

    def step(self, answer):
        if answer.strip() == "stop":
            return "bye", 1.0, True, {"success": True}
        ok = answer.strip().isdigit()
        return f"you said {answer.strip()}", 0.0, False, {"success": False, "valid": ok}


class NoStep:
    def reset(self, seed):
        return ""


class RaisesInStep(Walk):
    def step(self, move):
        raise ZeroDivisionError("the solver divided by zero")


class RaisesInReset(Walk):
    def reset(self, seed):
        if seed == 7:
            raise KeyError("no level 7")
        return super().reset(seed)


class FailsLater(Walk):
    """Raises in reset for one seed (`bad_seed`): the second iteration's env group."""

    def __init__(self, length: int = 2, bad_seed: int = -1):
        super().__init__(length)
        self.bad_seed = bad_seed

    def reset(self, seed):
        if seed == self.bad_seed:
            raise RuntimeError("level file truncated")
        return super().reset(seed)


class InterruptsInStep(Walk):
    """Raises KeyboardInterrupt itself (no Ctrl-C): a failure of the game, not a stop."""

    def step(self, move):
        raise KeyboardInterrupt


class InterruptsLater(FailsLater):
    def reset(self, seed):
        if seed == self.bad_seed:
            raise KeyboardInterrupt
        return super().reset(seed)


class BadReward(Walk):
    def step(self, move):
        return "x", "1.0", False, {"success": False}


class BadObs(Walk):
    def reset(self, seed):
        return 5


class BadInfo(Walk):
    def step(self, move):
        return "x", 0.0, False, {"success": "yes"}


class SurrogateObs(Walk):
    def step(self, move):
        return "cell 3 \ud800 end", 0.0, False, {"success": False}


class SurrogateRules(Walk):
    def __init__(self):
        super().__init__()
        self.instructions = "rules \udc80"


class ExitsInStep(Walk):
    def step(self, move):
        import sys

        sys.exit(3)


def test_named_moves_reset_step_and_metrics():
    env = make_env("test_envs_python:Walk", 3, {"length": 2})
    assert env.reset([0, 1, 2]) == ["P_G"] * 3
    assert env.action_names(0) == ["Left", "Right"] and not env.free_text
    pa = env.parse_actions(["Right || right", "Up || Right", ""], 5)
    assert pa.actions[0, :2].tolist() == [1, 1] and pa.invalid[1] == ("Up",) and not pa.all_valid[2]
    res = env.step(pa.actions)
    assert res.num_executed.tolist()[0] >= 1 and res.valid[1, 0]  # instance 1's "Right" ran
    # the wind cell draws from each instance's own random state: same seed, same outcome
    # and whatever the caller's own random state is
    seeds = list(range(5, 13))
    a, b = make_env("test_envs_python:Walk", 8, {"length": 6}), make_env("test_envs_python:Walk", 8, {"length": 6})
    random.seed(1)
    a.reset(seeds)
    random.seed(2)
    b.reset(seeds[::-1])
    for t in range(6):
        random.seed(10 + t)
        ra = a.step(np.ones((8, 1), dtype=np.int64))
        random.seed(20 + t)
        rb = b.step(np.ones((8, 1), dtype=np.int64))
        assert a.render() == b.render()[::-1] and ra.reward.tolist() == rb.reward.tolist()[::-1]


def test_random_state_of_the_caller_is_left_alone():
    random.seed(123)
    expect = random.random()
    random.seed(123)
    env = make_env("test_envs_python:Walk", 2, {"length": 4})
    env.reset([1, 2])
    env.step(np.array([[1], [1]]))
    assert random.random() == expect


def test_free_text_path_and_format_penalty():
    from fastpo.config import RolloutConfig
    from fastpo.rollout.turns import env_turn

    env = make_env("test_envs_python:Echo", 3)
    env.reset([0, 1, 2])
    assert env.free_text and env.action_names(0) == []
    cfg = RolloutConfig(think=False, max_actions_per_turn=1, format_penalty=-0.1)
    left = np.full(3, 5, dtype=np.int64)
    res = env_turn(env, cfg, ["<answer>12</answer>", "<answer>hello</answer>", "no answer"], left)
    # valid number: no penalty; text the env refuses: penalty; no <answer>: penalty, nothing stepped
    assert res.penalty.tolist() == pytest.approx([0.0, -0.1, -0.1])
    assert res.ok.tolist() == [True, False, False]
    assert left.tolist() == [4, 4, 5]  # one answer = one action of the budget
    assert env.render()[:2] == ["you said 12", "you said hello"] and env.render()[2].startswith("Say")
    res = env_turn(env, cfg, ["<answer>stop</answer>", None, None], left)
    assert res.reward.tolist() == pytest.approx([1.0, 0, 0]) and res.done.tolist() == [True, False, False]
    assert env.success.tolist() == [True, False, False]


def test_settings_are_the_env_preset():
    assert env_preset("test_envs_python:Walk") == {"rollout": Walk.settings}
    assert env_preset("bandit")["rollout"]["max_turns"] == 1 and env_preset("sokoban") == {}


def test_workers_give_the_in_process_results():
    seeds = [3, 4, 5, 6, 7]
    runs = []
    for workers in (0, 2):
        env = make_env("test_envs_python:Walk", 5, {"length": 4}, workers=workers)
        out = [env.reset(seeds)]
        for t in range(4):
            r = env.step(np.array([[1, 1]] * 5))
            out.append((env.render(), r.reward.tolist(), r.done.tolist(), r.success.tolist(), r.effective.tolist()))
        env.close()
        runs.append(out)
    assert runs[0] == runs[1]


def test_ctrl_c_leaves_the_workers_to_the_trainer():
    """Ctrl-C reaches the whole process group: the workers ignore it (the trainer finishes its
    iteration and saves with them), so the next step still works."""
    import multiprocessing
    import signal
    import time

    env = make_env("test_envs_python:Walk", 4, {"length": 4}, workers=2)
    try:
        env.reset([3, 4, 5, 6])
        workers = multiprocessing.active_children()
        assert len(workers) >= 2
        for p in workers:
            os.kill(p.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(p.is_alive() for p in workers)
        r = env.step(np.array([[1, 1]] * 4))
        assert r.num_executed.tolist() == [2, 2, 2, 2]
    finally:
        env.close()


@pytest.mark.parametrize("name,options,match", [
    ("nosuchgame", {}, "unknown environment 'nosuchgame'; choose a built-in"),
    ("no_such_module_xyz:Game", {}, "no module named 'no_such_module_xyz'"),
    ("test_envs_python:Missing", {}, "module 'test_envs_python' has no 'Missing'"),
    ("test_envs_python:NoStep", {}, "does not implement the environment interface (missing step"),
    ("test_envs_python:Walk", {"width": 3}, "takes no option(s) ['width']; its options: ['length']"),
    ("textarena:", {}, "give the game id after 'textarena:'"),
    ("gym:NoSuchEnv-v0", {}, "unknown gymnasium env 'NoSuchEnv-v0'"),
])
def test_bad_definitions_one_line(name, options, match):
    with pytest.raises(EnvError) as e:
        make_env(name, 1, options)
    assert match in str(e.value) and "\n" not in str(e.value)


def test_failing_import_names_the_error(tmp_path, monkeypatch):
    (tmp_path / "broken_game_mod.py").write_text("import math\nraise RuntimeError('bad config table')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvError, match=r"importing 'broken_game_mod' failed: RuntimeError: bad config table"):
        resolve_env("broken_game_mod:Game")


@pytest.mark.parametrize("cls,workers,match", [
    ("RaisesInStep", 0, r"instance with seed 4: step\('Right'\) raised ZeroDivisionError: the solver divided"),
    ("RaisesInReset", 0, r"instance with seed 7: reset\(7\) raised KeyError: 'no level 7'"),
    ("RaisesInReset", 1, r"instance with seed 7: reset\(7\) raised KeyError: 'no level 7'"),  # from a worker
    ("BadReward", 0, r"step\(\) must return .*; its reward is str '1.0'"),
    ("BadReward", 1, r"step\(\) must return .*; its reward is str '1.0'"),
    ("BadObs", 0, r"reset\(\) must return the observation as str, got int 5"),
    ("BadInfo", 0, r"info\['success'\] must be a bool, got str 'yes'"),
    ("SurrogateObs", 0, r"seed 4: step\(\)'s observation is not valid text: '\\ud800' at character 7"),
    ("SurrogateObs", 1, r"seed 4: step\(\)'s observation is not valid text"),
    ("SurrogateRules", 0, r"seed 4: instructions is not valid text: '\\udc80'"),
    ("ExitsInStep", 0, r"seed 4: step\('Right'\) called sys.exit\(3\)"),
    ("ExitsInStep", 1, r"seed 4: step\('Right'\) called sys.exit\(3\)"),
])
def test_errors_inside_the_game_name_env_seed_and_field(cls, workers, match):
    env = make_env(f"test_envs_python:{cls}", 2, workers=workers)
    try:
        with pytest.raises(EnvError, match=match) as e:
            env.reset([4, 7])
            env.step(np.array([[1], [1]]))
        assert f"environment 'test_envs_python:{cls}'" in str(e.value) and "\n" not in str(e.value)
    finally:
        env.close()


@pytest.mark.parametrize("env,extra,match", [
    ("nosuchgame", [], "unknown environment 'nosuchgame'"),
    ("test_envs_python:NoStep", [], "does not implement the environment interface"),
    ("test_envs_python:Walk", ["env.options.width=3"], "takes no option(s) ['width']"),
    ("no_such_module_xyz:Game", [], "no module named 'no_such_module_xyz'"),
    # found by playing the game once at set-up (a reset, a step, the reference lines)
    ("test_envs_python:ResetNone", [], "reset() must return the observation as str, got NoneType"),
    ("test_envs_python:PipeNames", [], "action_names must be a non-empty sequence of non-empty str without '||'"),
    ("test_envs_python:NoNames", [], "action_names must be a non-empty sequence"),
    ("test_envs_python:TwiceNames", [], "action_names holds the same name twice"),
    ("test_envs_python:RulesNotText", [], "instructions must be a str, got int 3"),
    ("test_envs_python:Step3", [], "step() must return (observation: str, reward: float, done: bool, info: dict), got "
                                   "tuple"),
    ("test_envs_python:NanReward", [], "its reward is float nan"),
    ("test_envs_python:IntSuccess", [], "info['success'] must be a bool, got int 1"),
    ("test_envs_python:BadBound", [], "optimal_success(seeds, 6) raised ValueError: no solver for horizon 4"),
    ("textarena:TicTacToe-v0", [], "is not a single-player game"),
    ("gym:CartPole-v1", ["env.options.action_names=[Left,Right]"], "unsupported render mode"),
    ("test_envs_python:NegTurns", [], "its settings['max_turns'] = -1 must be an integer >= 1"),
    ("test_envs_python:AboveOne", [], "random_success must return one probability in [0, 1] per seed"),
    ("test_envs_python:ScalarBound", [], "optimal_success must return one probability in [0, 1] per seed (64 seeds"),
])
def test_cli_refuses_a_bad_env_before_any_model_loads(no_model, tmp_path, capsys, env, extra, match):
    for cmd in ("train", "eval"):
        argv = [cmd, "--env", env, "--model", "random:tiny-llama", *extra]
        argv += ["--out", str(tmp_path / "run")] if cmd == "train" else []
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and len(err.splitlines()) == 1, err


def _records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def test_train_one_iteration_and_eval_by_import_path(tmp_path):
    env, options = "test_envs_python:Walk", ["env.options.length=2"]
    out = str(tmp_path / "run")
    settings = ["--preset", "tiny", "--model", "random:tiny-llama", "trainer.device=cpu", "trainer.plots=false",
                "trainer.iterations=1", "trainer.eval_every=1", "trainer.eval_seeds=1", "rollout.max_new_tokens=4",
                "rollout.max_turns=2", *options]
    assert cli_main(["train", "--env", env, "--out", out, *settings]) == 0
    rec = _records(out)[-1]
    assert rec["iteration"] == 1 and "train/success_rate" in rec and "eval/success_rate" in rec
    with open(os.path.join(out, "config.yaml")) as f:
        assert env in f.read()
    js = str(tmp_path / "eval.json")
    assert cli_main(["eval", "--env", env, "--model", out, "--seeds", "1", "--k", "1", "--json", js,
                     "trainer.device=cpu"]) == 0
    with open(js) as f:
        got = json.load(f)
    assert got["env"] == env and 0.0 <= got["metrics"]["success_rate"] <= 1.0
    # the game's own reference line is used; the one it lacks is not invented
    assert got["metrics"]["optimal_success"] == 1.0 and "random_success" not in got["metrics"]


def test_error_in_the_game_stops_the_run_naming_env_and_seed_keeping_checkpoint(tmp_path, capsys):
    from fastpo.seeds import iteration_seeds

    out = str(tmp_path / "run")
    bad = iteration_seeds(0, 2, 1)[0]
    env = "test_envs_python:FailsLater"
    argv = ["train", "--env", env, "--out", out, "--preset", "tiny", "--model", "random:tiny-llama",
            "trainer.device=cpu", "trainer.plots=false", "trainer.seed=0", "trainer.iterations=2", "trainer.save_every=1",
            "trainer.eval_every=0", "rollout.max_new_tokens=4", "rollout.max_turns=1", f"env.options.bad_seed={bad}"]
    assert cli_main(argv) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fastpo train: error:")]
    assert len(err) == 1 and f"environment '{env}', instance with seed {bad}: reset({bad}) raised RuntimeError: " \
        "level file truncated" in err[0], err
    assert [r["iteration"] for r in _records(out)] == [1]
    assert os.path.isdir(os.path.join(out, "checkpoints", "iter_000001", "model"))
    assert "its last checkpoint and metrics are kept" in err[0]
    # failing in the evaluation before training, on its second seed (the set-up resets the first
    # iteration's games and the first eval seed only): nothing is said to be kept
    argv[argv.index(f"env.options.bad_seed={bad}")] = "env.options.bad_seed=1000001"
    argv[argv.index("trainer.eval_every=0")] = "trainer.eval_before_training=true"
    argv[argv.index(out)] = out + "2"
    assert cli_main(argv) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fastpo train: error:")]
    assert "nothing had been trained or written yet" in err[0] and "kept" not in err[0], err


@pytest.mark.parametrize("which", ["first iteration", "eval"])
def test_a_reset_failing_at_set_up_is_bad_input_exit_2_like_seed_0s(tmp_path, capsys, which):
    """Issue 58 item 10: the game's reset raising on a seed the set-up resets (the first
    iteration's env groups, the first eval seed) is found before any model loads and exits 2,
    as a reset failing on seed 0 in the config check does; it exited 1."""
    from fastpo.seeds import iteration_seeds

    bad = iteration_seeds(0, 1, 1)[0] if which == "first iteration" else 1_000_000  # trainer.eval_seed_offset
    out = str(tmp_path / "run")
    for seed in (bad, 0):
        assert cli_main(["train", "--env", "test_envs_python:FailsLater", "--out", out, "--preset", "tiny",
                         "--model", "random:tiny-llama", f"env.options.bad_seed={seed}", "trainer.seed=0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"instance with seed {seed}: reset({seed}) raised RuntimeError: level file " \
            "truncated" in err[0], err
        assert not os.path.exists(out)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_game_raising_keyboardinterrupt_is_one_line_not_a_stop(tmp_path, capsys, workers):
    """Issue 58 item 9: a game whose step raises KeyboardInterrupt (no Ctrl-C) printed a
    traceback at the set-up check and exited 130; it is the game's failure, in one line: exit 2
    at set-up, 1 when it happens mid-run (in a worker process here)."""
    from fastpo.seeds import iteration_seeds

    base = ["--preset", "tiny", "--model", "random:tiny-llama", f"env.workers={workers}", "trainer.plots=false",
            "rollout.max_new_tokens=4"]
    assert cli_main(["train", "--env", "test_envs_python:InterruptsInStep", "--out", str(tmp_path / "a"), *base]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'test_envs_python:InterruptsInStep', instance with seed 0: step('Left') raised " \
        "KeyboardInterrupt (not a Ctrl-C" in err[0], err
    bad = iteration_seeds(0, 2, 1)[0]  # the second iteration's game: no set-up check resets it
    assert cli_main(["train", "--env", "test_envs_python:InterruptsLater", "--out", str(tmp_path / "b"), *base,
                     f"env.options.bad_seed={bad}", "trainer.iterations=2", "trainer.eval_every=0"]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x or "Traceback" in x]
    assert len(err) == 1 and f"instance with seed {bad}: reset({bad}) raised KeyboardInterrupt" in err[0], err


class Counter(Walk):
    """A reset that depends on how often it ran, not on its seed alone."""

    resets = 0

    def reset(self, seed):
        Counter.resets += 1
        super().reset(seed)
        return f"start {Counter.resets}"


def test_a_reset_that_does_not_depend_on_its_seed_alone_is_warned_of(caplog):
    import logging

    from fastpo.config import load_config

    with caplog.at_level(logging.WARNING, logger="fastpo"):
        load_config(env="test_envs_python:Counter")
        load_config(env="test_envs_python:Walk")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "test_envs_python:Counter': reset(0) after a game gave another first" in said[0]


def test_a_game_class_of_the_script_itself_cannot_go_to_workers():
    from fastpo.envs.batched import PythonBatchedEnv

    Script = type("Script", (Walk,), {"__module__": "__main__"})
    with pytest.raises(EnvError, match=r"with env.workers > 0 the game class must be importable .*'Script'.*__main__"):
        PythonBatchedEnv(Script, 2, workers=1, name="Script")


def test_installed_entry_point_is_found_by_name(tmp_path, monkeypatch):
    """A package that registers a game in the fastpo.envs entry-point group (its dist-info's
    entry_points.txt, as pip writes it) makes `--env NAME` work; a broken one says so."""
    (tmp_path / "toygames.py").write_text(
        "class Coin:\n"
        "    action_names = ('Heads', 'Tails')\n"
        "    def reset(self, seed):\n        self.side = 'Heads' if seed % 2 else 'Tails'\n        return 'Call it.'\n"
        "    def step(self, a):\n        return 'done', float(a == self.side), True, {'success': a == self.side}\n")
    dist = tmp_path / "toygames-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toygames\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[fastpo.envs]\ncoin = toygames:Coin\nbroken = toygames:Nothing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    resolve_env.cache_clear()
    env = make_env("coin", 2)
    env.reset([1, 2])
    assert env.step(np.array([[0], [0]])).success.tolist() == [True, False]
    with pytest.raises(EnvError, match=r"unknown environment 'coins'; choose .*an installed one \(broken, coin\)"):
        make_env("coins", 1)
    with pytest.raises(EnvError, match=r"environment 'broken' \(entry point 'toygames:Nothing'\) failed to load"):
        make_env("broken", 1)
    resolve_env.cache_clear()


def test_example_game_and_its_reference_lines():
    env = make_env("examples.guess_number:GuessNumber", 2, {"high": 16})
    env.reset([0, 1])
    assert env.free_text and "from 1 to 16" in env.instructions()[0]
    # binary search wins within ceil(log2(17)) = 5 guesses; a random guesser 1 - (15/16)^5 of the time
    assert env.optimal_success([0, 1], 5).tolist() == [1.0, 1.0]
    assert env.optimal_success([0], 3).tolist() == [7 / 16]
    assert env.random_success([0], 5)[0] == pytest.approx(1 - (15 / 16) ** 5)
    lo, hi = 1, 16
    for _ in range(5):  # binary search through the env: always wins
        g = (lo + hi) // 2
        res = env.step_text([str(g), str(g)])
        if res.done[0]:
            break
        lo, hi = (g + 1, hi) if "higher" in env.render()[0] else (lo, g - 1)
    assert env.success[0]
    with pytest.raises(EnvError, match=r"takes no option\(s\) \['hi'\]; its options: \['low', 'high'\]"):
        make_env("examples.guess_number:GuessNumber", 1, {"hi": 3})


def test_config_file_takes_the_same_names_and_the_env_settings_apply(tmp_path):
    from fastpo.config import load_config
    from fastpo.config.fields import ConfigError

    p = tmp_path / "cfg.yaml"
    p.write_text("env: {name: 'test_envs_python:Walk', options: {length: 5}, workers: 2}\n")
    cfg = load_config(file=str(p), preset="cpu")
    assert cfg.env.name == "test_envs_python:Walk" and cfg.env.options == {"length": 5} and cfg.env.workers == 2
    # the game's settings are its env preset; the command line still wins
    assert (cfg.rollout.max_turns, cfg.rollout.max_actions_per_turn, cfg.rollout.max_actions_per_traj) == (3, 2, 6)
    assert load_config(file=str(p), preset="cpu", overrides=["rollout.max_turns=4"]).rollout.max_turns == 4
    assert cfg.trainer.output_dir == "runs/test_envs_python_Walk"
    p.write_text("env: 'test_envs_python:NoStep'\n")
    with pytest.raises(ConfigError, match=r"config key 'env.name': environment 'test_envs_python:NoStep': "
                                          r"'NoStep' does not implement"):
        load_config(file=str(p))
    with pytest.raises(ConfigError, match=r"config key 'env.workers' = -1: must be >= 0"):
        load_config(env="test_envs_python:Walk", overrides=["env.workers=-1"])


class BadBound(Walk):
    def random_success(self, seeds, horizon):
        return [2.0 for _ in seeds]

    def optimal_success(self, seeds, horizon):
        raise ValueError("no solver for horizon 4")


class ResetNone(Walk):
    def reset(self, seed):
        return None


class PipeNames(Walk):
    action_names = ("Left || Right", "Up")


class NoNames(Walk):
    action_names = ()


class TwiceNames(Walk):
    action_names = ("Left", "left ")


class RulesNotText(Walk):
    def __init__(self):
        super().__init__()
        self.instructions = 3


class Step3(Walk):
    def step(self, move):
        return "x", 0.0, False


class NanReward(Walk):
    def step(self, move):
        return "x", float("nan"), False, {"success": False}


class IntSuccess(Walk):
    def step(self, move):
        return "x", 0.0, True, {"success": 1}


class NegTurns(Walk):
    settings = {"max_turns": -1}


class AboveOne(Walk):
    def random_success(self, seeds, horizon):
        return [1.5 for _ in seeds]


class ScalarBound(Walk):
    def optimal_success(self, seeds, horizon):
        return 0.5


def test_bad_reference_lines_are_named():
    env = make_env("test_envs_python:BadBound", 1)
    with pytest.raises(EnvError, match=r"random_success must return one probability in \[0, 1\] per seed"):
        env.random_success([0, 1], 4)
    with pytest.raises(EnvError, match=r"optimal_success\(seeds, 4\) raised ValueError: no solver for horizon 4"):
        env.optimal_success([0], 4)


def test_fastpo_eval_of_a_game_failing_on_a_later_eval_seed_is_one_line(capsys):
    """The game's reset raising on an eval seed past the set-up's check: a traceback before; one
    line naming the call and the seed, exit 1 (a failure during the run, docs/training.md)."""
    assert cli_main(["eval", "--env", "test_envs_python:FailsLater", "--model", "random:tiny-llama", "--seeds", "2",
                     "env.options.bad_seed=1000001", "rollout.max_new_tokens=4"]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert err == ["fastpo eval: error: environment 'test_envs_python:FailsLater', instance with seed 1000001: "
                   "reset(1000001) raised RuntimeError: level file truncated"], err
