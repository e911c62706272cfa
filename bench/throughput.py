#!/usr/bin/env python
"""fastpo's side-by-side benchmarks: one run, one table, one JSON.

    python bench/throughput.py [--part envs|kernels|rollout|train|e2e|peers|all|collapse|window|pyenv|memory|losses|judge] [--quick]
                               [--device cpu|cuda] [--model NAME] [--json PATH]

Each part lives in bench/part_<name>.py and exposes `run(ctx) -> list[Record]`; a part that
cannot measure anything here (a missing optional dependency) raises `PartSkipped` with a
one-line reason, which the JSON keeps under "skipped".
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, PartSkipped, Record, fix_malloc_threshold  # noqa: E402

PARTS = ["envs", "kernels", "rollout", "train", "e2e", "peers"]
# measured on their own (--part NAME), not in "all"
EXTRA_PARTS = ["collapse", "window", "pyenv", "memory", "losses", "judge"]


def machine_header(ctx: BenchContext) -> dict:
    """CPU, GPU and library versions, and the model the run used."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "device": ctx.device,
        "model": ctx.model,
        "model_weights": "random" if ctx.model.startswith("random:") else "pretrained",
    }
    for mod in ("torch", "triton", "transformers", "numba", "numpy"):
        try:
            info[mod] = importlib.import_module(mod).__version__
        except Exception:  # a missing optional library is reported, not fatal
            info[mod] = None
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("trl", "liger-kernel"):  # the peers part's (the bench extra); not imported here
        try:
            info[dist.replace("-", "_")] = version(dist)
        except PackageNotFoundError:
            info[dist.replace("-", "_")] = None
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        info["gpu"] = None
    return info


def print_table(header: dict, records: list[Record]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]fastpo benchmarks[/] {header['date']} | {header['cpu']} x{header['cores']} | "
        f"GPU {header['gpu']} | torch {header['torch']} triton {header['triton']} "
        f"transformers {header['transformers']} | model {header['model']} ({header['model_weights']} weights)"
    )
    table = Table()
    for col in ("part", "comparison", "fastpo", "baseline", "ratio", "target", "unit"):
        table.add_column(col)
    for r in records:
        def fmt(v, s):
            return "-" if v is None else (f"{v:.4g} ± {s:.2g}" if s else f"{v:.4g}")
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        target = "-" if r.target is None else f">= {r.target:g}x " + ("[green]met[/]" if r.met else "[red]missed[/]")
        table.add_row(r.part, r.name + (f" vs {r.baseline_name}" if r.baseline_name else ""),
                      fmt(r.fastpo, r.fastpo_spread), fmt(r.baseline, r.baseline_spread), ratio, target, r.unit)
    console.print(table)


def _sft_row(ctx: BenchContext, records: list, errors: dict) -> None:
    """The peers part's SFT row (bench/part_sft.py: fastpo sft against TRL's SFTTrainer),
    after the part's own rows unless the part was skipped as a whole; skipped or failed on
    its own line ("peers: SFT") without touching them."""
    try:
        records.extend(importlib.import_module("part_sft").run(ctx))
    except PartSkipped as e:
        ctx.skipped["peers: SFT"] = str(e)
        print(f"part peers: SFT skipped: {e}", file=sys.stderr, flush=True)
    except Exception as e:
        traceback.print_exc()
        errors["peers: SFT"] = f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", choices=PARTS + ["all"] + EXTRA_PARTS)
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI smoke tests (< 2 minutes)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=None, help="timed repetitions per figure (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the header and records here")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: torch.cuda.is_available() is False on this machine")
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 3)
    if repeats < 1:
        ap.error(f"--repeats must be >= 1, got {repeats}")
    parts = PARTS if args.part == "all" else [args.part]
    if args.device == "cpu":
        fix_malloc_threshold()  # before anything large is allocated
    ctx = BenchContext(quick=args.quick, device=args.device, model=args.model, repeats=repeats,
                       repeats_given=args.repeats is not None, seed=args.seed,
                       parts=tuple(parts))
    header = machine_header(ctx)
    records: list[Record] = []
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name in parts:
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(f"part_{name}")
        except ModuleNotFoundError as e:
            if e.name == f"part_{name}":
                errors[name] = "not implemented yet"
                continue
            raise
        try:
            records.extend(mod.run(ctx))
        except PartSkipped as e:
            ctx.skipped[name] = str(e)
            print(f"part {name}: skipped: {e}", file=sys.stderr, flush=True)
        except Exception as e:  # one broken part must not hide the others' figures
            traceback.print_exc()
            errors[name] = f"{type(e).__name__}: {e}"
        if name == "peers" and name not in ctx.skipped:  # its SFT row (bench/part_sft.py)
            _sft_row(ctx, records, errors)
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"part {name}: {seconds[name]:.0f} s", file=sys.stderr, flush=True)
        if args.json:  # after every part: a run stopped by a time limit keeps what it measured
            write_json(args.json, header, vars(args), records, errors, seconds, ctx.skipped)
    print_table(header, records)
    for name, err in errors.items():
        print(f"part {name}: {err}", file=sys.stderr)
    for name, why in ctx.skipped.items():
        print(f"skipped {name}: {why}", file=sys.stderr)
    return 1 if errors and not records else 0


def write_json(path: str, header: dict, args: dict, records: list[Record], errors: dict, seconds: dict,
               skipped: dict | None = None) -> None:
    """Write the run so far to `path` atomically (a reader never sees half a file; fastpo's
    `atomic_write_text`)."""
    from fastpo.run.folder import atomic_write_text

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps({"machine": header, "args": args, "records": [r.to_dict() for r in records],
                                        "errors": errors, "part_seconds": seconds,
                                        "skipped": dict(skipped or {})}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
