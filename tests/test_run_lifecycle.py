"""A run's folder over its life: a failed start, Ctrl-C, and resuming a finished or changed run.

Small real runs (random:tiny-llama, the tiny preset, Bandit); the CLI is called as a user would.
"""
import os

import yaml

import fastpo.trainer
from fastpo.checkpoint import latest_checkpoint
from fastpo.cli import main

TINY = ["--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama"]
QUIET = ["trainer.plots=false", "trainer.eval_every=0"]


def _lr(run):
    with open(os.path.join(run, "config.yaml")) as f:
        return yaml.safe_load(f)["optim"]["actor_lr"]


def test_failed_start_leaves_no_empty_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--env", "bandit", "--preset", "cpu", "--model", "/nonexistent/model/folder",
                 "--out", str(out)]) == 2
    assert "cannot be loaded" in capsys.readouterr().err
    assert not out.exists()


def test_ctrl_c_saves_then_exits_130(tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    real = fastpo.trainer.Trainer.iteration

    def iteration_then_ctrl_c(self, it):
        m = real(self, it)
        self._request_stop(None, None)  # what the SIGINT handler does
        return m

    monkeypatch.setattr(fastpo.trainer.Trainer, "iteration", iteration_then_ctrl_c)
    assert main(["train", *TINY, "--iterations", "3", "--out", out, *QUIET]) == 130
    assert latest_checkpoint(out).endswith("iter_000001")


def test_resume_of_a_finished_run_trains_nothing_and_keeps_its_config(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--iterations", "1", "--out", out, *QUIET, "optim.actor_lr=1e-5"]) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = f.read()
    capsys.readouterr()
    assert main(["train", "--resume", out, "optim.actor_lr=3e-4"]) == 0
    said = capsys.readouterr().out
    assert "nothing to train" in said and "--iterations" in said
    assert _lr(out) == 1e-5  # the settings it ran with
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert f.read() == metrics
    # resumed with more iterations and a changed setting: the old settings are kept beside it
    assert main(["train", "--resume", out, "--iterations", "2", "optim.actor_lr=3e-4"]) == 0
    assert _lr(out) == 3e-4
    with open(os.path.join(out, "config.until_iter_000001.yaml")) as f:
        assert yaml.safe_load(f)["optim"]["actor_lr"] == 1e-5
    assert latest_checkpoint(out).endswith("iter_000002")
