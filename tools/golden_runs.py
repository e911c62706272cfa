"""Golden runs: record a few small training runs, and check later code reproduces them bit for bit.

    python tools/golden_runs.py record DIR [--only NAME[,NAME...]] [--keep]
    python tools/golden_runs.py compare DIR [--only NAME[,NAME...]] [--keep]
    python tools/golden_runs.py diff DIR OTHER_DIR [--only ...]
    python tools/golden_runs.py list

Each run is `python -m fastpo train ...` with the interpreter that runs this script, in the
current working directory (so `/their/tree/.venv/bin/python /path/to/tools/golden_runs.py
compare /work/golden/base`, started in their tree, checks their tree's code; the script
refuses when that interpreter imports fastpo from another folder). Every run is on the CPU,
single-threaded (OMP_NUM_THREADS=1: two-thread CPU runs are not bit-reproducible), with the
chunked PyTorch kernels (`trainer.kernel_impl=chunked`).

`record` writes DIR/<name>.json per run: its `metrics.jsonl` records (without the keys in
`ignored`: timings, throughput and peak memory), every `eval/*.json`, every `samples/*.txt`,
and every file each checkpoint's `manifest.json` lists: the SHA-256 of the binary ones
(weights, optimizer state), the text of the text ones, and `state.pt` (RNG states, loop state)
by content without its timings and Python's `random` state (see `digest`). The run folder's own
path is replaced by `<RUN>` in all of them. `compare` repeats the runs in a temporary folder
and reports every difference (exact equality: floats are compared as JSON writes them, i.e. bit
for bit); exit status 0 when all match, 1 when not, 2 for bad usage. `--keep` leaves the run
folders (in DIR/runs/ or the temporary folder).
The metrics in `SUMMATION_ORDER` (sums taken in another order on purpose; each named there
with its reason) are left out unless `--strict`. `diff` compares the digests two `record`s
wrote, without running anything.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

#: Metric keys that are not results: wall-clock timings, throughput, and their EMA copies ...
IGNORED_PREFIXES = ("time/", "perf/", "ema/time/", "ema/perf/")
#: ... and the other figures of this machine's clock and memory, wherever they are logged: the
#: rollout's seconds and tokens per second, each rank's phase seconds and peak memory.
IGNORED_KEYS = ("train/seconds", "train/engine_seconds", "train/tokens_per_s", "eval/seconds",
                "eval/engine_seconds", "eval/tokens_per_s")
IGNORED_RANK_SUFFIXES = ("_s", "/peak_memory_mib")


def ignored(key: str) -> bool:
    """Whether metric `key` is a timing or a memory figure (not compared)."""
    k = key[4:] if key.startswith("ema/") else key
    return (k.startswith(IGNORED_PREFIXES) or k in IGNORED_KEYS
            or (k.startswith("dist/rank") and k.endswith(IGNORED_RANK_SUFFIXES)))

#: Metrics a refactor may change in the last bits because it sums the same values in a
#: different order (say why beside each). Compared only when `--strict` is given.
SUMMATION_ORDER = (
    # issue 23's one code path for one process and N: these batch means are the data-parallel
    # ones (float64 sums over every process's tokens or trajectories, mean = sum / count,
    # std from the sums of squares) where one process took torch's float32 mean and std
    "train/rollout_entropy", "train/logprob_gap_mean", "train/advantage_mean", "train/advantage_std",
    "train/soft_reweight_mean",
)

_COMMON = ["--device", "cpu", "trainer.kernel_impl=chunked", "trainer.plots=false", "trainer.progress=false"]


def command(args: list[str], out: str) -> list[str]:
    """The `fastpo train` (or, when `args` starts with "sft", `fastpo sft`) argv of a run: its
    options, then every dotted override (argparse takes the overrides as one positional list)."""
    sub, args = (args[0], args[1:]) if args and args[0] == "sft" else ("train", args)
    both = args + _COMMON + ["--out", out]
    overrides = [a for a in both if "=" in a and not a.startswith("-")]
    return [sub, *[a for a in both if a not in overrides], *overrides]
_TINY = ["--model", "random:tiny-llama", "--preset", "tiny"]

#: name -> (command-line arguments after `fastpo train` (`fastpo sft` when they start with "sft"),
#: what it covers)
RUNS: dict[str, tuple[list[str], str]] = {
    "bandit_tiny": (["--env", "bandit", *_TINY],
                    "the tiny preset on Bandit: GAE with the shared critic, 2 iterations, eval, checkpoint each"),
    "frozenlake_cpu": (["--env", "frozenlake", "--preset", "cpu", "--iterations", "2", "trainer.eval_every=2",
                        "trainer.eval_seeds=2", "trainer.save_every=2",
                        "trainer.eval_before_training=false"],
                       "FrozenLake at the CPU preset (embedded SmolLM2-135M), 2 iterations, eval after them on 2 "
                       "seeds"),
    "gae_critic_kl_replay_tis": (["--env", "frozenlake", *_TINY, "--iterations", "3", "rollout.env_groups=2",
                                  "algorithm.critic=separate", "algorithm.kl_coef=0.01", "rollout.replay=2",
                                  "rollout.replay_fraction=0.5", "algorithm.is_correction=tis",
                                  "algorithm.old_logprob=recompute", "trainer.eval_every=3"],
                                 "PPO/GAE with a separate critic, a KL term to a reference, replay, TIS"),
    "sokoban_window": (["--env", "sokoban", *_TINY, "--iterations", "2", "rollout.max_turns=3",
                        "rollout.context_window=1", "algorithm.adv_estimator=grpo", "rollout.group_size=2",
                        "rollout.env_groups=2", "trainer.collapse_every=1"],
                       "Sokoban with a context window of 1 turn, GRPO, collapse metrics"),
    "bandit_2proc": (["--env", "bandit", *_TINY, "--nproc", "2", "rollout.env_groups=4",
                      "algorithm.adv_estimator=grpo", "algorithm.filter_mode=top", "algorithm.filter_ratio=0.5",
                      "rollout.sampling_streams=group", "trainer.collapse_every=1"],
                     "2 processes (torchrun, gloo, FSDP2), StarPO-S GRPO"),
    "sft_sokoban_tiny": (["sft", "--env", "sokoban", *_TINY, "--iterations", "3", "sft.trajectories=8",
                          "sft.batch_size=4", "trainer.eval_every=3", "trainer.eval_seeds=4"],
                         "SFT on the Sokoban solver's trajectories, 3 steps, eval before and after, checkpoint"),
}


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONHASHSEED"):
        env.pop(k, None)
    return env


def check_tree() -> str:
    """The folder this interpreter imports fastpo from; exits 2 when it is not under the cwd."""
    p = subprocess.run([sys.executable, "-c", "import fastpo, fastpo.kernels; print(fastpo.__file__)"],
                       capture_output=True, text=True, env=_env(), encoding="utf-8")
    where = os.path.realpath(p.stdout.strip()) if p.returncode == 0 else ""
    here = os.path.realpath(os.getcwd())
    if not where.startswith(here + os.sep):
        sys.exit(f"golden_runs: {sys.executable} imports fastpo from {where or '(nowhere: ' + p.stderr.strip()[-200:] + ')'}"
                 f", not from the current folder {here}; run it with that tree's .venv/bin/python from its root")
    return os.path.dirname(where)


def run_one(name: str, out: str) -> float:
    """Train run `name` into folder `out`; its seconds. Exits 1 when the run fails."""
    args, _ = RUNS[name]
    cmd = [sys.executable, "-m", "fastpo", *command(args, out)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), encoding="utf-8")
    if p.returncode != 0:
        print(f"golden_runs: {name} failed (exit {p.returncode}): {' '.join(cmd)}\n{(p.stdout + p.stderr)[-4000:]}",
              file=sys.stderr)
        sys.exit(1)
    return time.time() - t0


TEXT_SUFFIXES = (".json", ".yaml", ".txt", ".jinja")


def _text(path: str, run: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read().replace(os.path.realpath(run), "<RUN>").replace(run, "<RUN>")


def _canonical(x):
    """A JSON-able, exact form of a loaded `state.pt` (tensors and arrays as their bytes' SHA-256,
    timing metrics dropped)."""
    import hashlib

    import numpy as np
    import torch

    if isinstance(x, dict):
        return {str(k): _canonical(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))
                if not (isinstance(k, str) and ignored(k))}
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        return f"tensor {x.dtype} {list(x.shape)} {hashlib.sha256(x.view(torch.uint8).numpy().tobytes()).hexdigest()}"
    if isinstance(x, np.ndarray):
        return f"array {x.dtype} {list(x.shape)} {hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()}"
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return repr(x)


def digest(run: str) -> dict:
    """What a golden run must reproduce, from run folder `run` (see the module docstring)."""
    records = []
    for line in _text(os.path.join(run, "metrics.jsonl"), run).splitlines():
        rec = json.loads(line)
        records.append({k: v for k, v in rec.items() if not ignored(k)})
    evals = {os.path.basename(p): json.loads(_text(p, run)) for p in sorted(glob.glob(os.path.join(run, "eval", "*.json")))}
    samples = {os.path.basename(p): _text(p, run) for p in sorted(glob.glob(os.path.join(run, "samples", "*")))}
    checkpoints = {}
    for m in sorted(glob.glob(os.path.join(run, "checkpoints", "*", "manifest.json"))):
        with open(m, encoding="utf-8") as f:
            files = json.load(f)["files"]
        name, folder = os.path.basename(os.path.dirname(m)), os.path.dirname(m)
        # text files name the run folder (config.yaml's output_dir, fastpo_model.json's run):
        # compared as text with that path replaced; state.pt holds the last evaluation's
        # timings and Python's `random` state (never seeded by fastpo, used by no training
        # step: the interpreter's start-up entropy): compared by content without them
        checkpoints[name] = {}
        for rel, v in sorted(files.items()):
            if rel == "state.pt":
                import torch

                state = torch.load(os.path.join(folder, rel), weights_only=False, map_location="cpu")
                state.get("rng", {}).pop("python", None)
                checkpoints[name][rel] = _canonical(state)
            elif rel.endswith(TEXT_SUFFIXES):
                checkpoints[name][rel] = _text(os.path.join(folder, rel), run)
            else:
                checkpoints[name][rel] = v["sha256"]
    return {"metrics": records, "eval": evals, "samples": samples, "checkpoints": checkpoints}


def _summation_order(key) -> bool:
    return isinstance(key, str) and key.removeprefix("ema/").startswith(SUMMATION_ORDER)


def _without_summation_order(x):
    """`x` (a loaded state.pt's canonical form) without the SUMMATION_ORDER metrics it stores
    (the reuse/replay schedule keeps its batch's rollout metrics)."""
    if isinstance(x, dict):
        return {k: _without_summation_order(v) for k, v in x.items() if not _summation_order(k)}
    if isinstance(x, list):
        return [_without_summation_order(v) for v in x]
    return x


def differences(want: dict, got: dict, strict: bool = False, limit: int = 20) -> list[str]:
    """Human-readable differences between two digests (at most `limit`)."""
    out: list[str] = []
    if not strict:
        want, got = ({**d, "checkpoints": _without_summation_order(d["checkpoints"])} for d in (want, got))
    if len(want["metrics"]) != len(got["metrics"]):
        out.append(f"metrics.jsonl: {len(want['metrics'])} records recorded, {len(got['metrics'])} now")
    for i, (a, b) in enumerate(zip(want["metrics"], got["metrics"])):
        for k in sorted(set(a) | set(b)):
            if ignored(k) or (not strict and _summation_order(k)):
                continue
            if a.get(k, "<missing>") != b.get(k, "<missing>"):
                out.append(f"metrics.jsonl record {i} {k}: {a.get(k, '<missing>')!r} -> {b.get(k, '<missing>')!r}")
    for part in ("eval", "samples", "checkpoints"):
        for f in sorted(set(want[part]) | set(got[part])):
            if f not in got[part] or f not in want[part]:
                out.append(f"{part}/{f}: {'missing now' if f not in got[part] else 'new'}")
            elif want[part][f] != got[part][f]:
                a, b = want[part][f], got[part][f]
                if isinstance(a, dict) and isinstance(b, dict):
                    keys = [k for k in sorted(set(a) | set(b), key=str) if a.get(k) != b.get(k)]
                    out.append(f"{part}/{f}: differs in {', '.join(map(str, keys[:8]))}")
                else:
                    out.append(f"{part}/{f}: differs")
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def diff_dirs(one: str, other: Optional[str], names: list[str], strict: bool, ap) -> int:
    """`diff`: the differences between the digests of `one` and `other`; exit status as `compare`."""
    if not other:
        ap.error("diff needs two folders")
    failed = []
    for name in names:
        paths = [os.path.join(d, f"{name}.json") for d in (one, other)]
        if not all(os.path.exists(p) for p in paths):
            print(f"{name}: not in both folders")
            failed.append(name)
            continue
        want, got = (json.load(open(p, encoding="utf-8")) for p in paths)
        diffs = differences(want, got, strict=strict)
        print(f"{name}: {'identical' if not diffs else 'DIFFERS'}")
        for d in diffs:
            print(f"    {d}")
        if diffs:
            failed.append(name)
    print("all identical" if not failed else f"DIFFERENT: {', '.join(failed)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="golden_runs.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["record", "compare", "diff", "list"])
    ap.add_argument("dir", nargs="?", help="the folder of recorded digests")
    ap.add_argument("other", nargs="?", help="diff: the second folder of recorded digests")
    ap.add_argument("--only", default=None, help="comma-separated run names (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument("--strict", action="store_true", help="also compare the SUMMATION_ORDER metrics")
    a = ap.parse_args(argv)
    if a.command == "list":
        for name, (args, what) in RUNS.items():
            print(f"{name}: {what}\n    fastpo {' '.join(command(args, 'OUT'))}")
        return 0
    if not a.dir:
        ap.error(f"{a.command} needs DIR")
    names = list(RUNS) if a.only is None else [n.strip() for n in a.only.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNS]
    if bad or not names:
        ap.error(f"--only {a.only!r}: unknown run {', '.join(bad) or '(none named)'}; choose from {', '.join(RUNS)}")
    if a.command == "diff":
        return diff_dirs(a.dir, a.other, names, a.strict, ap)
    tree = check_tree()
    print(f"golden_runs {a.command}: fastpo from {tree}, python {sys.executable}", flush=True)
    if a.command == "record":
        os.makedirs(a.dir, exist_ok=True)
        work = os.path.join(os.path.abspath(a.dir), "runs") if a.keep else tempfile.mkdtemp(prefix="golden-")
    else:
        missing = [n for n in names if not os.path.exists(os.path.join(a.dir, f"{n}.json"))]
        if missing:
            ap.error(f"{a.dir} holds no recorded {', '.join(missing)} (run `record` first)")
        work = tempfile.mkdtemp(prefix="golden-")
    failed = []
    try:
        for name in names:
            run = os.path.join(work, name)
            shutil.rmtree(run, ignore_errors=True)
            secs = run_one(name, run)
            got = digest(run)
            path = os.path.join(a.dir, f"{name}.json")
            if a.command == "record":
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(got, f, indent=1, sort_keys=True)
                print(f"{name}: recorded ({len(got['metrics'])} records, {len(got['eval'])} evals, "
                      f"{len(got['checkpoints'])} checkpoints; {secs:.0f} s)", flush=True)
            else:
                with open(path, encoding="utf-8") as f:
                    diffs = differences(json.load(f), got, strict=a.strict)
                print(f"{name}: {'identical' if not diffs else 'DIFFERS'} ({secs:.0f} s)", flush=True)
                for d in diffs:
                    print(f"    {d}")
                if diffs:
                    failed.append(name)
            if not a.keep:
                shutil.rmtree(run, ignore_errors=True)
    finally:
        if not a.keep and work.startswith(tempfile.gettempdir()):
            shutil.rmtree(work, ignore_errors=True)
    if a.command == "compare":
        print("all identical" if not failed else f"DIFFERENT: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
