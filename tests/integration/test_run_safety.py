"""Nothing a user trained is lost: a half-written metrics line, SIGTERM, two processes on one
run folder, damaged checkpoints, a full disk, and inputs that would train on nothing.

Each test is a case that failed before its fix (issue 18). Small real runs on
random:tiny-llama; the CLI is called as a user would, and the signal and lock cases run
`fastpo` in real subprocesses.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import fastpo.run.checkpoint as ck
import fastpo.model_loading
import fastpo.trainer
from fastpo.run.checkpoint import prune_checkpoints
from fastpo.run.manifest import latest_checkpoint, verify_checkpoint
from fastpo.run.folder import RunFolderBusy, RunLock
from fastpo.cli import main
from fastpo.config import load_config
from fastpo.config.fields import ConfigError
from run_helpers import WritesAFile, plant_in_checkpoint, records as _records, stable as _stable

TINY = ["--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama"]
QUIET = ["trainer.plots=false", "trainer.eval_every=0", "rollout.think=false", "rollout.max_new_tokens=8"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _iterations(out):
    return [r["iteration"] for r in _records(out)]


def _fastpo(*args, log=None):
    """`fastpo ARGS` in a new process (output to the file `log`)."""
    return subprocess.Popen([sys.executable, "-m", "fastpo", *args], env=ENV, stdin=subprocess.DEVNULL,
                            stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                            text=True)


def _wait_until(cond, timeout, what, proc=None):
    end = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (status {proc.returncode}) before {what}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _error_lines(err):
    """The error lines of a `fastpo` command's stderr (without the progress bars of transformers)."""
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.strip().splitlines() if line.startswith("fastpo ")]


def _line_count(path):
    try:
        with open(path) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# 1. A half-written last line in metrics.jsonl
# ---------------------------------------------------------------------------------------------

def test_a_half_written_metrics_line_is_dropped_on_resume_with_one_line(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--iterations", "1", "--out", out, *QUIET]) == 0
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"iteration": 4, "train/sc')  # the disk filled during an append
    capsys.readouterr()
    assert main(["train", "--resume", out, "--iterations", "2"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "half-written" in line]
    assert len(said) == 1 and "metrics.jsonl" in said[0], said
    assert _iterations(out) == [1, 2]


# ---------------------------------------------------------------------------------------------
# 2-3. SIGTERM and two processes on one folder (real processes)
# ---------------------------------------------------------------------------------------------

def test_sigterm_saves_the_trained_iterations_and_a_second_process_is_refused(tmp_path):
    """A long run that saves only at its end gets SIGTERM after two iterations: it exits 143 with
    everything it trained saved. While it runs, a resume and an --overwrite of its folder are
    refused with one line naming its pid (and touch nothing)."""
    out = str(tmp_path / "run")
    with open(tmp_path / "run.log", "w") as log:
        run = _fastpo("train", *TINY, "--iterations", "500", "--out", out, *QUIET, "trainer.save_every=1000", log=log)
        try:
            metrics = os.path.join(out, "metrics.jsonl")
            _wait_until(lambda: _line_count(metrics) >= 2, 240, "two iterations", run)
            second = [_fastpo("train", "--resume", out),
                      _fastpo("train", *TINY, "--out", out, "--overwrite", *QUIET)]
            for p in second:
                _, err = p.communicate(timeout=240)
                assert p.returncode == 2, (p.args, p.returncode, err[-2000:])
                lines = _error_lines(err)
                assert len(lines) == 1 and f"pid {run.pid}" in lines[0] and "in use" in lines[0], err
            assert run.poll() is None and os.path.exists(metrics)  # the run is untouched
            run.send_signal(signal.SIGTERM)
            assert run.wait(timeout=120) == 143
        finally:
            if run.poll() is None:
                run.kill()
    trained = _iterations(out)
    assert len(trained) >= 2 and trained == list(range(1, len(trained) + 1))
    # what was trained is in the checkpoint (the rollout under way was dropped)
    assert latest_checkpoint(out).endswith(f"iter_{trained[-1]:06d}")
    assert main(["train", "--resume", out, "--iterations", str(trained[-1] + 1)]) == 0
    assert _iterations(out) == list(range(1, trained[-1] + 2))


def test_the_run_folder_lock_dies_with_its_process(tmp_path):
    out = str(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom fastpo.run.folder import RunLock\n"
         "RunLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(300)\n", out],
        env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid}"):
            RunLock(out).acquire()
        holder.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel lets go of the lock
        holder.wait(timeout=60)
        with RunLock(out):
            pass
    finally:
        if holder.poll() is None:
            holder.kill()


# ---------------------------------------------------------------------------------------------
# 4. Damaged checkpoints
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A finished two-iteration run keeping both checkpoints."""
    out = str(tmp_path_factory.mktemp("damage") / "run")
    assert main(["train", *TINY, "--iterations", "2", "--out", out, *QUIET, "trainer.keep_checkpoints=2"]) == 0
    return out


def _truncate(path):
    with open(path, "rb+") as f:
        f.truncate(os.path.getsize(path) // 2)


def _bad_json(path):
    with open(path, "w") as f:
        f.write('{"model_type": "llama", ')


DAMAGE = {
    "truncated model.safetensors": lambda c: _truncate(os.path.join(c, "model", "model.safetensors")),
    "truncated optimizer.pt": lambda c: _truncate(os.path.join(c, "optimizer.pt")),
    "truncated state.pt": lambda c: _truncate(os.path.join(c, "state.pt")),
    "missing optimizer.pt": lambda c: os.remove(os.path.join(c, "optimizer.pt")),
    "missing value head": lambda c: os.remove(os.path.join(c, "critic", "value_head.safetensors")),
    "missing model/": lambda c: shutil.rmtree(os.path.join(c, "model")),
    "bad model/config.json": lambda c: _bad_json(os.path.join(c, "model", "config.json")),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_falls_back_to_the_newest_intact_checkpoint_with_one_line(two_checkpoints, tmp_path, damage, capsys):
    out = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, out)
    DAMAGE[damage](os.path.join(out, "checkpoints", "iter_000002"))
    capsys.readouterr()
    assert main(["train", "--resume", out, "--iterations", "3"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert len(said) == 1 and "iter_000002" in said[0] and "iter_000001" in said[0], said
    assert _iterations(out) == [1, 2, 3]  # iteration 2 trained again
    assert latest_checkpoint(out).endswith("iter_000003") and verify_checkpoint(latest_checkpoint(out)) is None


@pytest.mark.parametrize("damage", [d for d in DAMAGE if "model" in d])
def test_fastpo_eval_of_a_damaged_checkpoint_is_one_line(two_checkpoints, tmp_path, damage, capsys):
    out = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, out)
    folder = os.path.join(out, "checkpoints", "iter_000002")
    DAMAGE[damage](folder)
    capsys.readouterr()
    assert main(["eval", "--model", folder, "--seeds", "1"]) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "damaged" in err[0] and "iter_000001" in err[0], err


@pytest.mark.parametrize("command", ["eval", "train", "sft"])
def test_a_truncated_model_folder_without_its_manifest_is_one_line(two_checkpoints, tmp_path, command, capsys):
    """A checkpoint's model/ copied elsewhere (no manifest to check it against), then truncated."""
    model = str(tmp_path / "model")
    shutil.copytree(os.path.join(two_checkpoints, "checkpoints", "iter_000002", "model"), model)
    _truncate(os.path.join(model, "model.safetensors"))
    capsys.readouterr()
    args = {"eval": ["eval", "--model", model, "--seeds", "1"],
            "train": ["train", *TINY, "--model", model, "--out", str(tmp_path / "r"), *QUIET],
            "sft": ["sft", "--env", "sokoban", "--preset", "cpu,tiny", "--model", model, "--out", str(tmp_path / "s")]}
    assert main(args[command]) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and model in err[0] and "cannot be loaded" in err[0], err


def test_pruning_never_deletes_the_last_intact_checkpoint(two_checkpoints, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(os.path.join(two_checkpoints, "checkpoints"), root)
    shutil.copytree(root / "iter_000002", root / "iter_000003")
    for name in ("iter_000002", "iter_000003"):
        _truncate(root / name / "optimizer.pt")
    # the checkpoint just written is damaged (a disk that lost data): the older intact one stays
    prune_checkpoints(str(root), keep=1, protect="iter_000003")
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == ["iter_000001", "iter_000003"]


def test_pruning_counts_only_intact_checkpoints(two_checkpoints, tmp_path):
    """keep_checkpoints=2, the newest checkpoint damaged, a resume that saves only at its end:
    the intact iter_000002 it resumed from and the new one are kept (two usable checkpoints);
    the damaged one and the oldest go."""
    out = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, out)
    root = os.path.join(out, "checkpoints")
    shutil.copytree(os.path.join(root, "iter_000002"), os.path.join(root, "iter_000003"))
    _truncate(os.path.join(root, "iter_000003", "optimizer.pt"))
    assert main(["train", "--resume", out, "--iterations", "4", "trainer.save_every=4"]) == 0
    assert _iterations(out) == [1, 2, 3, 4]
    assert sorted(n for n in os.listdir(root) if n.startswith("iter_")) == ["iter_000002", "iter_000004"]
    assert all(verify_checkpoint(os.path.join(root, n)) is None for n in ("iter_000002", "iter_000004"))


@pytest.mark.parametrize("target", ["state.pt", "optimizer.pt"])
def test_a_checkpoint_holding_a_pickle_that_runs_code_is_refused(two_checkpoints, tmp_path, capsys, target):
    """`--resume` of a run folder whose checkpoint file holds a pickle that would run code exits 2
    with one line naming the file and --trust-checkpoint, and the code never runs; `fastpo
    eval` of that run reads its model only (safetensors, JSON, YAML) and runs nothing either."""
    out = str(tmp_path / "run")
    shutil.copytree(two_checkpoints, out)
    marker = tmp_path / "the-pickle-ran"
    path = plant_in_checkpoint(os.path.join(out, "checkpoints", "iter_000002"), target, WritesAFile(str(marker)))
    capsys.readouterr()
    assert main(["train", "--resume", out, "--iterations", "3"]) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and path in err[0] and "--trust-checkpoint" in err[0], err
    assert not marker.exists()
    assert _iterations(out) == [1, 2]  # nothing trained, nothing written
    assert main(["eval", "--model", out, "--seeds", "1"]) == 0
    assert not marker.exists()


def _as_written_by_an_older_fastpo(ckpt):
    """Rewrite checkpoint `ckpt`'s state.pt as fastpo wrote it before its loop state was plain
    data (NumPy's RNG state as `np.random.get_state()` gives it: a tuple holding an ndarray,
    which needs pickle), the same RNG states, and its manifest."""
    path = os.path.join(ckpt, "state.pt")
    state = torch.load(path, weights_only=False)
    now = ck.rng_state()
    try:
        ck.set_rng_state(state["rng"])
        state["rng"]["numpy"] = np.random.get_state()
    finally:
        ck.set_rng_state(now)
    torch.save(state, path)
    ck.write_manifest(ckpt, ck.checkpoint_iteration(ckpt))
    return path


def test_a_checkpoint_of_an_older_fastpo_resumes_only_when_trusted(two_checkpoints, tmp_path, capsys):
    """An older checkpoint (state.pt holding pickled objects) is refused in one line naming the
    file and the flag; with --trust-checkpoint it resumes with one warning line, exactly as
    the same checkpoint in today's format does, and what it saves needs no trust."""
    new, old = str(tmp_path / "new"), str(tmp_path / "old")
    shutil.copytree(two_checkpoints, new)
    shutil.copytree(two_checkpoints, old)
    path = _as_written_by_an_older_fastpo(os.path.join(old, "checkpoints", "iter_000002"))
    capsys.readouterr()
    assert main(["train", "--resume", old, "--iterations", "3"]) == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and path in err[0] and "--trust-checkpoint" in err[0], err
    assert main(["train", "--resume", old, "--iterations", "3", "--trust-checkpoint"]) == 0
    said = capsys.readouterr().out.replace("\n", " ")
    assert said.count("--trust-checkpoint") == 1 and path in said, said
    assert main(["train", "--resume", new, "--iterations", "3"]) == 0
    a, b = _stable(_records(new)[2]), _stable(_records(old)[2])
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == (pytest.approx(a[k], rel=1e-6, abs=1e-9) if isinstance(a[k], float) else a[k]), k
    assert main(["train", "--resume", old, "--iterations", "4"]) == 0  # its own checkpoint: no trust needed
    assert _iterations(old) == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------
# 5. A full disk
# ---------------------------------------------------------------------------------------------

def _disk_full_at(monkeypatch, target):
    """Writes of the file ending in `target` inside a temporary checkpoint folder write half of
    their bytes, then fail with ENOSPC; whatever writes it (torch.save, safetensors through
    transformers' save_pretrained, or Python's open)."""
    def hit(path):
        p = str(path)
        return p.endswith(target) and f"{os.sep}.tmp-iter_" in p

    def fail(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    real_save = torch.save

    def save(obj, path, *a, **k):
        if hit(path):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            fail(path)
        return real_save(obj, path, *a, **k)

    import transformers.modeling_utils as mu

    real_st = mu.safe_save_file

    def st_save(tensors, path, *a, **k):
        if hit(path):
            fail(path)
        return real_st(tensors, path, *a, **k)

    real_open = open

    def py_open(path, mode="r", *a, **k):
        if "w" in mode and hit(re.sub(r"\.tmp\d+$", "", str(path))):  # (atomic writes go through a .tmp<pid>)
            fail(path)
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(mu, "safe_save_file", st_save)
    monkeypatch.setattr(ck, "open", py_open, raising=False)


@pytest.mark.parametrize("target", ["optimizer.pt", "model.safetensors", "config.yaml"])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, capsys,
                                                                                target):
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--iterations", "1", "--out", out, *QUIET]) == 0
    capsys.readouterr()
    with monkeypatch.context() as m:
        _disk_full_at(m, target)
        assert main(["train", "--resume", out, "--iterations", "2"]) == 1
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1, err
    assert "iter_000002 not saved" in err[0] and target in err[0] and "disk full" in err[0], err[0]
    assert "takes about" in err[0] and "free" in err[0] and "iter_000001" in err[0], err[0]
    root = os.path.join(out, "checkpoints")
    assert sorted(os.listdir(root)) == ["iter_000001", "latest"]  # nothing of the failed save is left
    assert verify_checkpoint(os.path.join(root, "iter_000001")) is None


def test_leftovers_of_interrupted_saves_are_removed_on_the_next_start(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--iterations", "1", "--out", out, *QUIET]) == 0
    root = os.path.join(out, "checkpoints")
    os.makedirs(os.path.join(root, ".tmp-iter_000002-4242", "model"))
    for name in ("latest.tmp4242", os.path.join(".tmp-iter_000002-4242", "optimizer.pt")):
        with open(os.path.join(root, name), "w") as f:
            f.write("x")
    with open(os.path.join(out, "metrics.jsonl.tmp4242"), "w") as f:
        f.write("{")
    assert main(["train", "--resume", out, "--iterations", "2"]) == 0
    assert sorted(os.listdir(root)) == ["iter_000001", "iter_000002", "latest"]
    assert not os.path.exists(os.path.join(out, "metrics.jsonl.tmp4242"))
    assert "removed .tmp-iter_000002-4242" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# 6. Inputs that train on nothing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [["rollout.max_context=64"],
                                       ["env.options={size: 32}", "rollout.max_context=600"]])
def test_a_prompt_that_cannot_fit_the_context_is_refused_before_the_model_loads(tmp_path, no_model, capsys,
                                                                                 overrides):
    out = tmp_path / "run"
    rc = main(["train", "--env", "frozenlake", "--preset", "tiny", "--model", "random:tiny-llama", "--out", str(out),
               *overrides])
    err = _error_lines(capsys.readouterr().err)
    assert rc == 2 and len(err) == 1 and "rollout.max_context" in err[0] and "at least" in err[0], (rc, err)
    assert not out.exists()


def test_a_rollout_with_no_room_for_a_response_is_an_error_not_an_empty_iteration(tmp_path, monkeypatch, capsys):
    """Where the check before the model loads cannot know (here: switched off), the first
    rollout that gives no trajectory a turn stops the run with one line."""
    monkeypatch.setattr(fastpo.trainer.Trainer, "check_prompts_fit",
                        lambda self: fastpo.model_loading.load_tokenizer(self.cfg.model.name))
    out = str(tmp_path / "run")
    rc = main(["train", "--env", "frozenlake", "--preset", "tiny", "--model", "random:tiny-llama", "--out", out,
               "rollout.max_context=64", *QUIET[:2]])
    err = _error_lines(capsys.readouterr().err)
    assert rc == 2 and len(err) == 1 and "no trajectory had room" in err[0], (rc, err)
    assert not os.path.exists(os.path.join(out, "metrics.jsonl")) or _records(out) == []


@pytest.mark.parametrize("name", ["frozenlake", "sokoban", "bandit"])
def test_env_given_as_a_name_in_a_yaml_file(tmp_path, name):
    path = tmp_path / "c.yaml"
    path.write_text(f"env: {name}\npreset: tiny\n")
    cfg = load_config(file=str(path))
    assert cfg.env.name == name
    if name == "bandit":
        assert cfg.rollout.max_turns == 1  # the env's preset applies as with --env bandit


def test_env_that_is_neither_a_name_nor_a_mapping_is_one_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("env: [frozenlake]\n")
    with pytest.raises(ConfigError, match="'env' must be an env name or a mapping"):
        load_config(file=str(path))
    assert main(["train", "--config", str(path)]) == 2
    assert len(_error_lines(capsys.readouterr().err)) == 1


def test_lock_on_a_folder_that_cannot_be_made_is_one_line(tmp_path):
    # `fastpo train --out /proc/x` (root passes the CLI's access check there) used to end in a
    # FileNotFoundError traceback from os.makedirs inside the trainer
    from fastpo.config.fields import ConfigError

    (tmp_path / "afile").write_text("")
    for out in [str(tmp_path / "afile" / "sub")] + (["/proc/fastpo-no-such"] if os.path.isdir("/proc/self") else []):
        with pytest.raises(ConfigError, match="output folder") as e:
            RunLock(out).acquire()
        assert out in str(e.value) and "\n" not in str(e.value)
