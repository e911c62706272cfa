"""Memory of the main job: `fastpo train --env frozenlake` at the CPU preset, phase by phase.

    python bench/throughput.py --part memory [--quick] [--iterations N]

One `fastpo.trainer.Trainer` run in this process, as `make train` runs it (the `cpu` preset,
the embedded model, evaluation before and after training, the checkpoint and the plots),
cut to `--iterations` iterations (default 2: the second one runs with the optimizer state
already held, as every later one of the 8 does). Each phase of the run is wrapped: set-up,
evaluation, rollout, old log-probs, update (its optimizer step apart), checkpoint, plots. On
entering and leaving a phase the resident set's high-water mark (VmHWM, Linux) is read and
reset (`/proc/self/clear_refs`), so that each phase gets the exact peak reached inside it
(nested phases: the optimizer step inside the update), and the resident set at its end.

The yardstick is the job's model state: parameters + gradients + AdamW's two moments (4 x
the trained parameters' bytes, plus the frozen ones once) + the largest KV buffer the engine
held (`peak_kv_bytes`). The issue's target: the run's peak resident set at most 1.5x that.
`--quick` runs the `tiny` preset on `random:tiny-llama` (a smoke test; no target).

The trainer sets glibc's heap up itself (`fastpo.memory.fix_mmap_threshold` in `Trainer.run`), as a
`fastpo train` process does; run as `python bench/part_memory.py [--iterations N]
[overrides]` to measure outside `throughput.py`, which sets it up the same way at start.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, PartSkipped, Record, _status_kib as _kib  # noqa: E402

PART = "memory"
#: The methods wrapped as phases: phase (the name the JSON gives it) -> (the object holding the method, from the trainer: "" itself, else a dotted path into
#: it once it is set up, the method's name)
PHASE_METHODS = {"setup": ("", "setup"), "evaluate": ("", "evaluate"), "rollout": ("parts.sampler", "roll_out"),
                 "old_logprob": ("parts.logprobs", "old_logprobs"), "update": ("parts.updater", "update"),
                 "optimizer_step": ("parts.updater", "optimizer_step"), "checkpoint": ("", "save")}
TARGET = 1.5  # peak RSS at most 1.5 x (parameters + gradients + optimizer state + largest KV buffer)


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := VmRSS


class PhasePeaks:
    """Per-phase resident-set peaks (bytes), exact through VmHWM: every boundary credits the
    peak since the last boundary to the phase on top of the stack, then resets the mark.
    `peaks[name]`: the highest peak seen in phase `name` (over all its calls); `after[name]`:
    the resident set when it last ended; "other" holds what ran outside every phase."""

    def __init__(self) -> None:
        self.stack: list[str] = ["other"]
        self.peaks: dict[str, int] = {}
        self.after: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        _reset_hwm()

    def _credit(self) -> None:
        name = self.stack[-1]
        self.peaks[name] = max(self.peaks.get(name, 0), _kib("VmHWM") * 1024)
        _reset_hwm()

    @contextlib.contextmanager
    def phase(self, name: str):
        self._credit()
        self.stack.append(name)
        try:
            yield
        finally:
            self._credit()
            self.stack.pop()
            self.after[name] = _kib("VmRSS") * 1024
            self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, obj, attr: str, name: str) -> None:
        """Replace obj.attr (a callable) by itself inside `phase(name)`."""
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def wrapped(*a, **k):
            with self.phase(name):
                return fn(*a, **k)

        setattr(obj, attr, wrapped)

    def peak(self) -> int:
        self._credit()
        return max(self.peaks.values())


def model_state_bytes(trainer) -> dict:
    """Bytes of the trainer's model state: parameters (every distinct tensor of the policy, the
    reference model, a critic), gradients and AdamW's two moments (trained parameters only)."""
    seen, params, trained = set(), 0, 0
    m = trainer.parts.models
    mods = [m.policy, m.reference, m.critic_body, m.value_head]
    for m in mods:
        if m is None:
            continue
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel() * p.element_size()
            params += n
            if p.requires_grad:
                trained += n
    return {"parameters": params, "gradients": trained, "optimizer_state": 2 * trained}


def run(ctx: BenchContext, iterations: int | None = None, overrides: tuple = ()) -> list[Record]:
    """The main job's peak resident set against its model state + largest KV buffer, and the
    peak of each phase (notes; all figures in the JSON via the records)."""
    if not os.path.exists("/proc/self/clear_refs"):
        raise PartSkipped("needs Linux's /proc/self/clear_refs (VmHWM reset) to measure phase peaks")
    if ctx.device != "cpu":
        raise PartSkipped("the main job's resident set is a CPU figure (on CUDA see the e2e part's peak memory)")
    from rich.console import Console

    import fastpo.trainer.loop as loop
    from fastpo.config import load_config
    from fastpo.trainer import Trainer

    n_it = iterations or (1 if ctx.quick else 2)
    preset = "tiny" if ctx.quick else "cpu"
    model = "random:tiny-llama" if ctx.quick else ctx.model
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "run")
        cfg = load_config(env="frozenlake", preset=preset,
                          overrides=[f"model.name={model}", f"trainer.iterations={n_it}", "trainer.progress=false",
                                     f"trainer.seed={ctx.seed}", f"trainer.output_dir={out}", "trainer.device=cpu",
                                     *overrides])
        pp = PhasePeaks()
        tr = Trainer(cfg, console=Console(quiet=True))
        for name, (where, attr) in PHASE_METHODS.items():
            if not where:
                pp.wrap(tr, attr, name)
        setup = tr.setup

        def set_up_then_wrap_parts():
            setup()
            for name, (where, attr) in PHASE_METHODS.items():
                if where:
                    pp.wrap(functools.reduce(getattr, where.split("."), tr), attr, name)

        tr.setup = set_up_then_wrap_parts
        plot = loop.plot_curves

        def plots(*a, **k):
            with pp.phase("plots"):
                return plot(*a, **k)

        loop.plot_curves = plots
        t0 = time.perf_counter()
        try:
            tr.run()
        finally:
            loop.plot_curves = plot
        seconds = time.perf_counter() - t0
        peak = pp.peak()
        state = model_state_bytes(tr)
        kv = int(tr.parts.sampler.engine.stats.get("peak_kv_bytes", 0))
        label = tr.parts.models.info.label
    budget = sum(state.values()) + kv
    gib = 2.0 ** 30
    phases = "; ".join(f"{k} {v / gib:.2f} GiB (RSS after {pp.after.get(k, 0) / gib:.2f}, {pp.calls.get(k, 0)} call(s))"
                       for k, v in sorted(pp.peaks.items(), key=lambda kv_: -kv_[1]))
    what = (f"fastpo train --env frozenlake, {preset} preset, {label}, {n_it} iteration(s) with eval before and "
            f"after, checkpoint and plots ({seconds:.0f} s); model state: parameters {state['parameters'] / gib:.2f} + "
            f"gradients {state['gradients'] / gib:.2f} + AdamW moments {state['optimizer_state'] / gib:.2f} GiB, "
            f"largest KV buffer {kv / gib:.2f} GiB")
    rec = Record(PART, "main job peak resident set vs 1.5 x (model state + largest KV buffer)", "GiB",
                 peak / gib, TARGET * budget / gib, False, baseline_name="1.5 x (model state + KV)",
                 target=None if ctx.quick else 1.0, notes=f"{what}; phase peaks (VmHWM): {phases}")
    recs = [rec]
    for name, v in sorted(pp.peaks.items(), key=lambda kv_: -kv_[1]):
        recs.append(Record(PART, f"  phase {name} peak", "GiB", v / gib, None, False,
                           notes=f"resident set after it: {pp.after.get(name, 0) / gib:.3f} GiB; "
                                 f"calls: {pp.calls.get(name, 0)}"))
    return recs


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides (e.g. a scaled run)")
    args = ap.parse_args()
    for r in run(BenchContext(quick=args.quick), iterations=args.iterations, overrides=tuple(args.overrides)):
        print(f"{r.name}: {r.fastpo:.3f} {r.unit}" + ("" if r.baseline is None else f" (vs {r.baseline:.3f})"))
        if r.notes and not r.name.startswith("  "):
            print("   ", r.notes)
