"""A run's folder over its life: a failed start, Ctrl-C, and resuming a finished or changed run.

Small real runs (random:tiny-llama, the tiny preset, Bandit); the CLI is called as a user would.
"""
import glob
import json
import os

import pytest
import yaml
from rich.console import Console

import fastpo.report.metrics
import fastpo.model_loading
import fastpo.rollout.sglang_engine as sg
import fastpo.trainer
from fastpo.run.manifest import latest_checkpoint
from fastpo.cli import main
from fastpo.config import load_config
from fastpo.trainer import Trainer

TINY = ["--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama"]
QUIET = ["trainer.plots=false", "trainer.eval_every=0"]


def _lr(path):
    if os.path.isdir(path):
        path = os.path.join(path, "config.yaml")
    with open(path) as f:
        return yaml.safe_load(f)["optim"]["actor_lr"]


def _ctrl_c_after(monkeypatch, when):
    """Make Trainer.iteration press Ctrl-C (what the SIGINT handler does) after iteration `when`."""
    real = fastpo.trainer.Trainer.iteration

    def iteration(self, it):
        m = real(self, it)
        if it == when:
            self.stop.request_stop(None, None)
        return m

    monkeypatch.setattr(fastpo.trainer.Trainer, "iteration", iteration)


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
        self.stop.request_stop(None, None)  # what the SIGINT handler does
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
    load = fastpo.model_loading.load_model_and_tokenizer
    fastpo.model_loading.load_model_and_tokenizer = None  # the CLI says so without loading the model
    try:
        assert main(["train", "--resume", out, "optim.actor_lr=3e-4"]) == 0
    finally:
        fastpo.model_loading.load_model_and_tokenizer = load
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


# Found by trying to break the above (each failed before its fix).
def test_second_resume_does_not_overwrite_the_settings_iterations_ran_with(tmp_path, monkeypatch):
    """A resume that changed a setting and crashed before saving, then another resume: the
    kept config still holds what iteration 1 really ran with (taken from its checkpoint)."""
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--iterations", "1", "--out", out, *QUIET, "optim.actor_lr=1e-5"]) == 0
    with monkeypatch.context() as m:
        def crash(self, it):
            raise RuntimeError("simulated crash in iteration 2")
        m.setattr(fastpo.trainer.Trainer, "iteration", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            main(["train", "--resume", out, "--iterations", "2", "optim.actor_lr=3e-4"])
    assert latest_checkpoint(out).endswith("iter_000001")  # nothing after iteration 1 was trained
    assert main(["train", "--resume", out, "--iterations", "2", "optim.actor_lr=1e-3"]) == 0
    kept = os.path.join(out, "config.until_iter_000001.yaml")
    assert _lr(kept) == 1e-5, f"{kept} now claims iteration 1 ran with lr {_lr(kept)}"


def test_resume_with_the_same_folder_spelled_differently_changes_nothing(tmp_path, monkeypatch):
    """`--resume runs/x/` (a trailing slash from tab completion) is the same run: no kept config."""
    out = str(tmp_path / "run")
    with monkeypatch.context() as m:
        _ctrl_c_after(m, 1)
        assert main(["train", *TINY, "--iterations", "2", "--out", out, *QUIET]) == 130
    assert main(["train", "--resume", out + "/"]) == 0
    assert glob.glob(os.path.join(out, "config.until_iter_*.yaml")) == []


def test_extending_a_run_with_iterations_only_keeps_no_until_iter_file(tmp_path):
    """--iterations is how a run is extended; nothing depends on the total, so no kept config."""
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--iterations", "1", "--out", out, *QUIET]) == 0
    assert main(["train", "--resume", out, "--iterations", "2"]) == 0
    assert glob.glob(os.path.join(out, "config.until_iter_*.yaml")) == []


def test_ctrl_c_during_the_last_iteration_of_a_complete_run_is_not_exit_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the final iteration: the run finished and saved, so exit 0 and no 'resume with'."""
    out = str(tmp_path / "run")
    _ctrl_c_after(monkeypatch, 2)
    rc = main(["train", *TINY, "--iterations", "2", "--out", out, *QUIET])
    assert latest_checkpoint(out).endswith("iter_000002")  # finished
    said = capsys.readouterr().out
    assert rc == 0 and "resume with" not in said, (rc, said[-300:])


def test_ctrl_c_during_the_initial_eval_does_not_train_a_whole_iteration(tmp_path, monkeypatch):
    """Ctrl-C during the eval before training (eval_before_training) trains no iteration."""
    out = str(tmp_path / "run")
    real = fastpo.trainer.Trainer.evaluate

    def evaluate(self, it):
        res = real(self, it)
        if it == 0:
            self.stop.request_stop(None, None)
        return res

    monkeypatch.setattr(fastpo.trainer.Trainer, "evaluate", evaluate)
    main(["train", *TINY, "--iterations", "3", "--out", out, "trainer.plots=false",
          "trainer.eval_before_training=true", "trainer.eval_every=0"])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        iters = [json.loads(line)["iteration"] for line in f if line.strip()]
    assert 1 not in iters, f"trained iterations {iters} after Ctrl-C during the initial eval"


class _Double:
    """The parts of sglang.Engine the trainer touches; records calls."""

    def __init__(self):
        self.calls = []

    def release_memory_occupation(self):
        self.calls.append("release")

    def resume_memory_occupation(self):
        self.calls.append("resume")

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        self.calls.append("update")

    def shutdown(self):
        self.calls.append("shutdown")


def _sg_cfg(out, *ov):
    return load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={out}", "model.name=random:tiny-llama", "rollout.engine=sglang",
        "rollout.max_turns=1", "trainer.plots=false", "trainer.eval_every=0", *ov])


def test_sglang_engine_is_shut_down_when_setup_fails_after_starting_it(tmp_path, monkeypatch):
    """A setup that fails after the engine started (here the metrics logger) shuts SGLang down."""
    dbl = _Double()
    monkeypatch.setattr(sg, "sglang_available", lambda: True)
    monkeypatch.setattr(sg.SGLangEngine, "from_model",
                        classmethod(lambda cls, model, tok, folder, **kw: cls(engine=dbl, tokenizer=tok)))

    def broken_logger(*a, **k):
        raise OSError("wandb/tensorboard/disk failure")

    monkeypatch.setattr(fastpo.trainer.setup, "MetricsLogger", broken_logger)
    tr = Trainer(_sg_cfg(tmp_path / "run"), console=Console(quiet=True))
    with pytest.raises(OSError):
        tr.run()
    assert "shutdown" in dbl.calls, dbl.calls


def test_failed_sglang_start_leaves_no_folder_with_a_weights_copy(tmp_path, monkeypatch):
    """The weights copy SGLang starts from lives in a temporary folder, so a failed engine start
    (e.g. out of memory at sglang_mem_fraction) leaves no run folder with GBs in it."""
    monkeypatch.setattr(sg, "sglang_available", lambda: True)

    def failing_init(self, model_path=None, tokenizer=None, engine=None, **kw):
        raise RuntimeError("sglang.Engine: not enough memory for mem_fraction_static")

    monkeypatch.setattr(sg.SGLangEngine, "__init__", failing_init)
    out = tmp_path / "run"
    tr = Trainer(_sg_cfg(out), console=Console(quiet=True))
    with pytest.raises(RuntimeError):
        tr.setup()
    assert not out.exists(), os.listdir(out)


@pytest.mark.skipif(sg.sglang_available(), reason="sglang and CUDA are here")
def test_cli_refuses_rollout_engine_sglang_without_cuda_with_exit_2(tmp_path, capsys):
    """Without CUDA/sglang, rollout.engine=sglang exits 2 with one line naming the key."""
    rc = main(["train", *TINY, "--out", str(tmp_path / "run"), "rollout.engine=sglang"])
    assert rc == 2
    assert "rollout.engine" in capsys.readouterr().err


def test_closing_line_names_only_what_the_folder_holds(tmp_path, capsys):
    # with trainer.plots=false and no evaluation it used to list plots/ and samples/ anyway
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--out", out, "trainer.iterations=1", "rollout.think=false",
                 "rollout.max_new_tokens=8", *QUIET]) == 0
    line = [x for x in capsys.readouterr().out.replace("\n", " ").split("outputs in ")[1:]][-1]
    listed = [w.strip(",/") for w in line.split(":", 1)[1].split()]
    assert listed and all(os.path.exists(os.path.join(out, w)) for w in listed), (listed, os.listdir(out))
    assert "metrics.jsonl" in listed and "checkpoints" in listed and "plots" not in listed


def test_echo_trap_warning_is_printed_once_while_it_lasts(tmp_path, capsys, monkeypatch):
    # it used to print the same red paragraph at every iteration once it fired
    monkeypatch.setattr(fastpo.report.metrics.EchoTrapDetector, "update", lambda self, rec: "Echo Trap warning: test")
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--out", out, "trainer.iterations=3", "rollout.think=false",
                 "rollout.max_new_tokens=8", *QUIET]) == 0
    text = capsys.readouterr().out
    assert text.count("Echo Trap warning: test") == 1, text
    with open(os.path.join(out, "metrics.jsonl")) as f:
        flags = [json.loads(line)["echo_trap_warning"] for line in f if line.strip()]
    assert flags[-3:] == [1, 1, 1]


def test_a_failed_evaluation_keeps_its_iteration_s_record(tmp_path, monkeypatch, capsys):
    """The evaluation of iteration 2 raises: the run ends with the error, iteration 2's record
    (marked eval/failed) is in metrics.jsonl before its emergency checkpoint, and the resume
    continues with iteration 3: the file reads 1, 2, 3, nothing lost."""
    out = str(tmp_path / "run")
    real = fastpo.trainer.Trainer.evaluate

    def evaluate(self, it):
        if it == 2:
            raise RuntimeError("the game's reset failed on an eval seed")
        return real(self, it)

    monkeypatch.setattr(fastpo.trainer.Trainer, "evaluate", evaluate)
    with pytest.raises(RuntimeError, match="reset failed"):
        main(["train", *TINY, "--out", out, "trainer.plots=false", "trainer.eval_every=1", "trainer.iterations=2"])
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["iteration"] for r in recs] == [1, 2]
    assert recs[1]["eval/failed"] == 1 and "eval/success_rate" not in recs[1] and "eval/success_rate" in recs[0]
    assert latest_checkpoint(out).endswith("iter_000002")
    monkeypatch.setattr(fastpo.trainer.Trainer, "evaluate", real)
    assert main(["train", "--resume", out, "--iterations", "3"]) == 0
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["iteration"] for r in recs] == [1, 2, 3] and "eval/success_rate" in recs[2]
