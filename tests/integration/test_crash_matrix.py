"""Crash matrix: a run killed at a named moment of an iteration or of a checkpoint save
(kill -9, or SIGTERM) and then resumed ends with exactly the metrics, checkpoint and weights
of an uninterrupted run, and with no temporaries left behind.

Every case is a real process: the test process forks (so the child starts warm, with the
model code already imported), the child runs `fastpo train --resume` from a run folder that
holds iteration 1, and a patched function sends the child a real SIGKILL or SIGTERM at the
moment named. The parent then resumes with `fastpo train --resume` as a user would.
Tiny model (random:tiny-llama), Bandit, two iterations; evaluation and pruning happen in the
iteration that is interrupted.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import traceback

import pytest
import torch
from rich.console import Console

import fastpo.run.checkpoint as ck
import fastpo.report.metrics
import fastpo.rollout
import fastpo.trainer
from fastpo.run.manifest import MANIFEST, latest_checkpoint
from fastpo.cli import main
from fastpo.config import load_config
from fastpo.trainer import Trainer
from run_helpers import records as _records, stable as _stable

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

# on the CPU everywhere: a process that forked after CUDA started must not use CUDA
SETTINGS = ["model.name=random:tiny-llama", "trainer.device=cpu", "trainer.iterations=2", "trainer.plots=false",
            "trainer.save_every=1", "trainer.keep_checkpoints=1", "trainer.eval_every=2", "rollout.think=false",
            "rollout.max_new_tokens=8"]


def _weights_hash(out):
    """SHA-256 of the newest checkpoint's model weights, as its manifest records it."""
    with open(os.path.join(latest_checkpoint(out), MANIFEST)) as f:
        return json.load(f)["files"]["model/model.safetensors"]["sha256"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the uninterrupted two-iteration run, a copy of the same run stopped after iteration 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the forked children compute with one thread; so does the reference
    try:
        root = tmp_path_factory.mktemp("crash")
        full, base = str(root / "full"), str(root / "base")
        assert main(["train", "--env", "bandit", "--preset", "tiny", "--out", full, *SETTINGS]) == 0
        # the same run stopped after iteration 1 as a Ctrl-C there would (checkpoint, then exit)
        cfg = load_config(env="bandit", preset="tiny", overrides=[f"trainer.output_dir={base}", *SETTINGS])
        Trainer(cfg, console=Console(quiet=True), stop_after=1).run()
        yield full, base
    finally:
        torch.set_num_threads(threads)


def _child(body) -> int:
    """Run `body()` in a forked process; returns its wait status."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            torch.set_num_threads(1)
            torch.cuda.is_available = lambda: False  # (no CUDA RNG state either)
            code = body()
        except BaseException:
            traceback.print_exc()
            code = 99
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 98)
    return os.waitpid(pid, 0)[1]


def _kill_self(sig=signal.SIGKILL):
    os.kill(os.getpid(), sig)


def _after(obj, name, action, when=lambda *a, **k: True):
    """Patch obj.name to call the real one, then `action()` (when `when(*args)` holds)."""
    real = getattr(obj, name)

    def patched(*a, **k):
        out = real(*a, **k)
        if when(*a, **k):
            action()
        return out

    setattr(obj, name, patched)


def _before(obj, name, action, when=lambda *a, **k: True):
    """Patch obj.name to call `action()` first (when `when(*args)` holds), then the real one."""
    real = getattr(obj, name)

    def patched(*a, **k):
        if when(*a, **k):
            action()
        return real(*a, **k)

    setattr(obj, name, patched)


def _torn_metrics_line():
    """Leave the metrics file as a crash half-way through its last append would."""
    def action():
        with open(os.path.join(os.environ["FASTPO_TEST_RUN"], "metrics.jsonl"), "rb+") as f:
            data = f.read()
            last = data.rstrip(b"\n").rfind(b"\n") + 1
            f.truncate(last + (len(data) - last) // 2)
        _kill_self()
    return action


def _half_file(path_end):
    """torch.save that writes half of the file `*path_end`, then the process dies."""
    real = torch.save

    def save(obj, path, *a, **k):
        real(obj, path, *a, **k)
        if str(path).endswith(path_end):
            size = os.path.getsize(path)
            with open(path, "rb+") as f:
                f.truncate(size // 2)
            _kill_self()

    return save


def _pointer_half_written(path, text):
    with open(f"{path}.tmp{os.getpid()}", "w") as f:
        f.write(text[:3])
    _kill_self()


def _trash_half_deleted(root, name):
    trash = os.path.join(root, f".trash-{name}-{os.getpid()}")
    os.replace(os.path.join(root, name), trash)
    os.remove(os.path.join(trash, "optimizer.pt"))
    _kill_self()


def _is_latest(path, *a, **k):
    return str(path).endswith(os.path.join("checkpoints", "latest"))


# moment -> how the child is set to die there
KILL_AT = {
    "iteration: rollout": lambda: _before(fastpo.rollout.MultiTurnRollout, "generate", _kill_self),
    "iteration: advantages (old log-probs done)": lambda: _before(fastpo.trainer.batch_advantages.Advantages,
                                                                  "compute", _kill_self),
    "iteration: update, after one optimizer step": lambda: _after(torch.optim.AdamW, "step", _kill_self),
    "iteration: eval, after its samples are written": lambda: _after(fastpo.trainer.sampler, "write_samples", _kill_self),
    "iteration: half-way through the metrics append": lambda: _after(fastpo.report.metrics.MetricsLogger, "log",
                                                                     _torn_metrics_line()),
    "iteration: right after the metrics append": lambda: _after(fastpo.report.metrics.MetricsLogger, "log", _kill_self),
    "save: model/ written": lambda: _after(ck, "save_hf_model", _kill_self),
    "save: half of optimizer.pt": lambda: setattr(torch, "save", _half_file("optimizer.pt")),
    "save: every file written, before the manifest": lambda: _before(ck, "write_manifest", _kill_self),
    "save: manifest written, before the rename": lambda: _after(ck, "write_manifest", _kill_self),
    "save: renamed, before `latest`": lambda: _before(ck, "atomic_write_text", _kill_self, when=_is_latest),
    "save: `latest` half-written": lambda: setattr(ck, "atomic_write_text", lambda p, t, _real=ck.atomic_write_text: (
        _pointer_half_written(p, t) if _is_latest(p) else _real(p, t))),
    "save: pruning, half-way through deleting iter_000001": lambda: setattr(ck, "_remove_folder", _trash_half_deleted),
    "right after the save": lambda: _after(fastpo.trainer.Trainer, "save", _kill_self),
}


def _interrupted(runs, tmp_path, arm):
    """A copy of the run after iteration 1, resumed in a child that `arm()` sets to die; returns
    (the folder, the child's wait status)."""
    full, base = runs
    out = str(tmp_path / "run")
    shutil.copytree(base, out)

    def body():
        os.environ["FASTPO_TEST_RUN"] = out
        arm()
        return main(["train", "--resume", out, "--iterations", "2"])

    return out, _child(body)


def _assert_same_as_uninterrupted(full, out):
    got, want = _records(out), _records(full)
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want]
    for a, b in zip(got, want):
        assert _stable(a) == _stable(b), sorted(set(_stable(a).items()) ^ set(_stable(b).items()))[:6]
    assert latest_checkpoint(out).endswith("iter_000002")
    assert _weights_hash(out) == _weights_hash(full)
    left = [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith((".tmp-", ".trash-", "latest.tmp"))]
    left += [n for n in os.listdir(out) if ".tmp" in n]
    assert left == [], left


@pytest.mark.parametrize("moment", list(KILL_AT))
def test_kill_9_then_resume_matches_the_uninterrupted_run(runs, tmp_path, moment):
    out, status = _interrupted(runs, tmp_path, KILL_AT[moment])
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (moment, status)
    assert main(["train", "--resume", out, "--iterations", "2"]) == 0
    _assert_same_as_uninterrupted(runs[0], out)


def _term_self():
    _kill_self(signal.SIGTERM)


def _once(action):
    done = []

    def run_once():
        if not done:
            done.append(1)
            action()
    return run_once


# moment -> (how the child is set to receive SIGTERM there, what the child must have saved)
TERM_AT = {
    "rollout (dropped at once)": (lambda: _before(fastpo.rollout.MultiTurnRollout, "generate", _term_self), 1),
    "update (finished, then saved; the eval waits for the resume)": (
        lambda: _after(torch.optim.AdamW, "step", _term_self), 2),
    "eval (dropped; it runs on resume)": (lambda: _before(fastpo.trainer.Trainer, "evaluate", _term_self), 2),
    "update, and again during the save (aborted without saving)": (
        lambda: (_after(torch.optim.AdamW, "step", _once(_term_self)), _before(ck, "write_manifest", _term_self)), 1),
}


@pytest.mark.parametrize("moment", list(TERM_AT))
def test_sigterm_saves_exits_143_and_resume_matches(runs, tmp_path, moment):
    arm, saved = TERM_AT[moment]
    out, status = _interrupted(runs, tmp_path, arm)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 143, (moment, status)
    assert latest_checkpoint(out).endswith(f"iter_{saved:06d}")
    assert main(["train", "--resume", out, "--iterations", "2"]) == 0
    _assert_same_as_uninterrupted(runs[0], out)
