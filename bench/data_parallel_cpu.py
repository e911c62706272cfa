#!/usr/bin/env python
"""One process vs N data-parallel processes (torchrun, gloo) on this machine's CPU cores.

    python bench/data_parallel_cpu.py [--nproc 2] [--rounds 2] [--iterations 4] [--json PATH] [-- overrides...]
    python bench/data_parallel_cpu.py --sharding ...   # N processes: replicate vs FSDP2

Runs the same `fastpo train` three times per round, in turn: one process with N threads
(OMP_NUM_THREADS=N), one process with one thread, and N processes with one thread each
(`fastpo train --nproc N`). Reports each run's median seconds per iteration (iteration 1,
which warms up, left out) and phase times, and the ratios one-process / N-process (> 1: N
processes are faster). Threads contend with whatever else runs on the machine, so read
the figures with the load average the JSON records. The default config is a small
StarPO-S DrGRPO run on the Bandit with the random tiny Llama (random weights; the
figures are about the plumbing's overhead and the split of the work, not about learning).
On CUDA the same command would compare GPUs; that has not been measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ["--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--device", "cpu",
           "algorithm.adv_estimator=drgrpo", "algorithm.filter_mode=top", "algorithm.filter_ratio=0.5",
           "rollout.env_groups=8", "rollout.group_size=4", "rollout.max_new_tokens=32", "optim.mini_batch_size=16",
           "trainer.eval_every=0", "trainer.save_every=0", "trainer.collapse_every=0", "trainer.plots=false"]
PHASES = ("time/iteration_s", "time/rollout_s", "time/old_logprob_s", "time/update_s")


def run(nproc: int, threads: int, iterations: int, overrides: list[str], out: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "fastpo", "train", *DEFAULT, *overrides, "--iterations", str(iterations),
           "--out", out, "--overwrite"]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, encoding="utf-8")
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f][1:]  # iteration 1 warms up
    res = {"nproc": nproc, "threads_per_process": threads, "wall_s": wall}
    for k in PHASES:
        res[k] = statistics.median(r[k] for r in recs)
    res["train/score_mean"] = [r["train/score_mean"] for r in recs]
    for k in recs[-1]:  # each rank's share of the parameters and optimizer state (N processes)
        if k.endswith(("/parameter_mib", "/optimizer_state_mib")):
            res[k] = recs[-1][k]
    return res


def compare_sharding(a) -> None:
    """--sharding: N processes with trainer.data_parallel=replicate, then fsdp, per round."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for mode in ("replicate", "fsdp"):
                res = run(a.nproc, 1, a.iterations, [*a.overrides, f"trainer.data_parallel={mode}"],
                          os.path.join(tmp, mode))
                res.update(round=r, data_parallel=mode)
                rows.append(res)
                print(f"round {r}: {a.nproc} processes, {mode}: {res['time/iteration_s']:.2f} s/iteration (update "
                      f"{res['time/update_s']:.2f}); rank 0 holds {res['dist/rank0/parameter_mib']:.1f} MiB of "
                      f"parameters, {res['dist/rank0/optimizer_state_mib']:.1f} MiB of optimizer state", flush=True)
    med = {m: {k: statistics.median(x[k] for x in rows if x["data_parallel"] == m) for k in PHASES}
           for m in ("replicate", "fsdp")}
    summary = {"nproc": a.nproc, "median": med, "ratio_replicate_over_fsdp": {
        k: med["replicate"][k] / med["fsdp"][k] for k in PHASES}, "config": DEFAULT + a.overrides, "rows": rows,
        "load_average_after": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"median s/iteration: replicate {med['replicate']['time/iteration_s']:.2f}, fsdp "
          f"{med['fsdp']['time/iteration_s']:.2f} (update {med['replicate']['time/update_s']:.2f} vs "
          f"{med['fsdp']['time/update_s']:.2f})")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sharding", action="store_true",
                    help="compare N processes with trainer.data_parallel=replicate and fsdp instead")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.sharding:
        return compare_sharding(a)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for n, threads in ((1, a.nproc), (1, 1), (a.nproc, 1)):
                res = run(n, threads, a.iterations, a.overrides, os.path.join(tmp, f"run{n}"))
                res["round"] = r
                rows.append(res)
                print(f"round {r}: {n} process(es) x {threads} thread(s): {res['time/iteration_s']:.2f} s/iteration "
                      f"(rollout {res['time/rollout_s']:.2f}, old log-probs {res['time/old_logprob_s']:.2f}, "
                      f"update {res['time/update_s']:.2f}); wall {res['wall_s']:.1f} s", flush=True)
    def med(n, threads):
        return statistics.median(x["time/iteration_s"] for x in rows if (x["nproc"], x["threads_per_process"]) ==
                                 (n, threads))

    one_n, one_1, many = med(1, a.nproc), med(1, 1), med(a.nproc, 1)
    summary = {"nproc": a.nproc, "one_process_n_threads_s_per_iteration": one_n,
               "one_process_one_thread_s_per_iteration": one_1, "n_process_s_per_iteration": many,
               "ratio_vs_n_threads": one_n / many, "ratio_vs_one_thread": one_1 / many,
               "config": DEFAULT + a.overrides, "rows": rows, "load_average_after": os.getloadavg(),
               "cpus": os.cpu_count()}
    print(f"median s/iteration: 1 process x {a.nproc} threads {one_n:.2f}, 1 process x 1 thread {one_1:.2f}, "
          f"{a.nproc} processes x 1 thread {many:.2f}: ratios {one_n / many:.2f} and {one_1 / many:.2f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
