"""Where the trainer's update goes: seconds per update on one fixed batch, and the operators' shares.

    python bench/profile_update.py [--batch FILE] [--repeats 3] [--profile] [--mmap-threshold BYTES] [key=value ...]

Builds `fastpo train --env frozenlake` at the CPU preset (the embedded model, gradient
checkpointing, 2048-token micro-batches; `key=value` overrides as on the command line), rolls
out iteration 1 and keeps its training batch (`--batch FILE`: saved there, or loaded from
there when the file exists, so that two versions of the code time the same trajectories),
then runs the update on that batch once untimed (it allocates AdamW's state) and `--repeats`
times timed, and prints the seconds per update (median, min, max), the tokens it computed
(after prefix sharing), the attended (query, key) pairs per layer, and the update's FLOP/s
against the GEMM FLOP/s measured in the same process (`bench/limits.py`). Each update steps
the weights, so the repeats train on; the batch and hence the computed shapes stay the
same. With `--profile`, one more update under `torch.profiler` and its operators by self CPU
time (shares, not seconds: the profiler adds its own overhead). `--mmap-threshold` sets glibc's
mmap threshold instead of fastpo's (`fastpo.memory`; 262144 was its earlier setting). The
process's page faults and peak resident set are printed too. Threads: `OMP_NUM_THREADS`.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default=None, help="training batch to load (or save, when absent)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also print the operators of one update")
    ap.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    ap.add_argument("--mmap-threshold", type=int, default=None, help="glibc's mmap threshold in bytes")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    for o in args.overrides:
        if "=" not in o:
            ap.error(f"overrides are key=value, got {o!r}")

    from rich.console import Console

    import limits
    from fastpo.config import load_config
    from fastpo.memory import fix_mmap_threshold
    from fastpo.trainer import Trainer

    # glibc's heap as `Trainer.run` sets it up (fastpo.memory), or at the threshold given
    fix_mmap_threshold(*([] if args.mmap_threshold is None else [args.mmap_threshold]))
    with tempfile.TemporaryDirectory() as d:
        ov = ["trainer.iterations=1", "trainer.eval_every=0", "trainer.save_every=0", "trainer.plots=false",
              "trainer.progress=false", *args.overrides, f"trainer.output_dir={d}"]
        cfg = load_config(env="frozenlake", preset="cpu", overrides=ov)
        tr = Trainer(cfg, console=Console(quiet=True))
        tr.setup()
        update = tr.update
        if args.batch and os.path.exists(args.batch):
            batch = torch.load(args.batch, weights_only=False)
        else:
            box = {}
            tr.update = lambda it, b: (box.setdefault("batch", b), ({}, 0))[1]
            tr.iteration(1)
            tr.update = update
            batch = box["batch"]
            if args.batch:
                torch.save(batch, args.batch)
        spy = limits.UpdateSpy(tr)
        tr.update(1, batch)  # AdamW's state allocated here, untimed
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tr.update(1, batch)
            times.append(time.perf_counter() - t0)
        shapes = limits.model_shapes(tr.model)
        body, head = limits.forward_flops(shapes, spy.computed, spy.pairs, spy.scored)
        flops = 3.0 * (body + head)  # model FLOPs: forward + backward, as bench/limits.py counts them
        gemm, _ = limits.gemm_flops(shapes, spy.max_tokens, "cpu")
        med = statistics.median(times)
        res = {"update_s": med, "min_s": min(times), "max_s": max(times), "repeats": times,
               "computed_tokens": spy.computed, "trajectory_tokens": spy.trajectory, "pairs": spy.pairs,
               "micro_batches": spy.micro, "update_gflops": flops / med / 1e9, "gemm_gflops": gemm / 1e9,
               "fraction_of_gemm": flops / med / gemm, "threads": torch.get_num_threads(),
               "load": os.getloadavg()[0], "mmap_threshold": args.mmap_threshold,
               "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
               "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
        print(f"{torch.get_num_threads()} threads: {med:.2f} s per update (median of {len(times)}: "
              + ", ".join(f"{t:.2f}" for t in times) + f"); {spy.computed} computed tokens "
              f"({spy.trajectory} trajectory tokens) in {spy.micro} micro-batches, {spy.pairs} attended pairs per "
              f"layer; {res['update_gflops']:.1f} GFLOP/s = {res['fraction_of_gemm']:.0%} of the GEMM's "
              f"{res['gemm_gflops']:.1f} (model FLOPs, recompute not counted); load {res['load']:.2f}; process: "
              f"{res['minor_faults']} page faults, peak resident set {res['max_rss_kib'] / 2**20:.2f} GiB")
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(res) + "\n")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as p:
                tr.update(1, batch)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        tr.logger.close()


if __name__ == "__main__":
    main()
