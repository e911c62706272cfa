"""Helpers shared by the tests that run training: reading a run's metrics and comparing runs."""
import json
import os

# Timing and throughput figures differ between runs by nature; everything else must not.
VOLATILE = ("time/", "perf/", "train/seconds", "train/engine_seconds", "train/tokens_per_s", "eval/seconds",
            "eval/engine_seconds", "eval/tokens_per_s")


class ModelLoadReached(Exception):
    """Raised by the `no_model` fixture's stand-in loader: validation passed."""


def records(out: str) -> list[dict]:
    """The metric records of run folder `out` (its metrics.jsonl)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def stable(rec: dict) -> dict:
    """A record without its VOLATILE figures (nor their EMA copies, nor a mixture's per-game
    ones, eval/<game>/seconds and the like)."""
    def volatile(k: str) -> bool:
        k = k[4:] if k.startswith("ema/") else k
        parts = k.split("/")
        if len(parts) == 3 and parts[0] in ("train", "eval"):
            k = f"{parts[0]}/{parts[2]}"
        return any(k.startswith(p) for p in VOLATILE)

    return {k: v for k, v in rec.items() if not volatile(k)}


class WritesAFile:
    """Unpickling it creates the file `path`: what any pickle can do (run code)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant_in_checkpoint(ckpt: str, target: str, payload) -> str:
    """Add `payload` to the torch file `target` (state.pt, optimizer.pt) of checkpoint `ckpt`
    and rewrite its manifest, as whoever made the folder could: the checkpoint still verifies
    as intact. Returns the file's path."""
    import torch

    from fastpo.run.manifest import checkpoint_iteration, write_manifest

    path = os.path.join(ckpt, target)
    obj = torch.load(path, weights_only=False)  # our own file
    obj["extra"] = payload
    torch.save(obj, path)
    write_manifest(ckpt, checkpoint_iteration(ckpt))
    return path


def response_parity(traj) -> float:
    """A reward function (reward.fn=run_helpers:response_parity) that makes a random model's
    trajectories score differently: the parity of its last response's length in characters."""
    return float(len(traj.responses[-1]) % 2) if traj.responses else 0.0


def train_one_and_two_processes(tmp_path, args: list) -> tuple:
    """`fastpo train ARGS` in one process and with `--nproc 2` (one thread each, this folder on
    PYTHONPATH for reward functions such as `run_helpers:response_parity`); both runs' records."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    outs = []
    for name, extra in (("one", []), ("two", ["--nproc", "2"])):
        out = os.path.join(str(tmp_path), name)
        p = subprocess.run([sys.executable, "-m", "fastpo", "train", "--out", out, *extra, *args], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(records(out))
    return tuple(outs)
