"""End-to-end benchmark: one StarPO training iteration of fastpo vs a reference-style one.

    python bench/throughput.py --part e2e [--quick] [--device cuda --model random:qwen2.5-0.5b]

Both sides are `fastpo.trainer.Trainer` objects built from the same configuration, model,
seeds and sampling settings; the baseline is `bench/reference_iteration.ReferenceTrainer`
(plain-Python environments, history re-rendered / re-tokenized / re-prefilled by
`model.generate` every turn, materialized logits for log-prob, entropy and loss, padded
micro-batches of 4 trajectories). One iteration = rollout, old log-probs (and values),
advantages, update; the weight sync is free on both sides (the generator is the trained
module). fastpo runs its default `algorithm.old_logprob=auto`: on the CPU (fp32, native
engine) the sampler's log-probs and entropies, with the shared critic's values read out in
the sampling pass, so its old-log-prob phase is empty; the reference recomputes them in a
separate pass, as RAGEN / verl do by default. The two sides run iteration 1, 2, ... interleaved (fastpo, reference, fastpo, ...)
so that load from other processes hits both alike. On CUDA the first iteration of each is
a warm-up; on the CPU (minutes per iteration) none is, and 2 are timed with `--part e2e`
(`--repeats N`: N; median and spread reported), 1 in the full run of every part.

After the timed iterations, the machine's own limits are measured in the same process and
set against fastpo's last timed iteration (`bench/limits.py`): the update's FLOP/s (computed
tokens, and every trajectory token) as a fraction of the GEMM FLOP/s at the model's shapes,
the rollout's decode seconds per step against a bare DynamicCache forward and against
reading the weights and live KV cache once at the measured memory bandwidth, and its
prefill FLOP/s against the same GEMM FLOP/s ("limit: ..." records).

Because the two loops sample through different code paths, their trajectories differ; the
notes give generated and trained tokens per iteration for both, and one record reports
trajectory tokens per second of iteration, which normalizes for length.

Sizes: CPU: the `cpu` preset on FrozenLake as it is (config.PRESETS: 4 x 4 trajectories, 5 turns, 16 new
tokens per turn). --quick: the `tiny` preset (1 x 2, 16 tokens) cut to 1 turn. CUDA: the
`paper` preset (8 x 16, 5 turns, StarPO-S filtering, separate critic) on the given model,
bf16 autocast, with max new tokens per turn cut to 64 to fit the GPU check's time budget.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record, fix_malloc_threshold, peak_memory  # noqa: E402

PART = "e2e"
PHASES = ("rollout", "old_logprob", "advantage", "update")
CUDA_NEW_TOKENS = 64


def sizes(ctx: BenchContext) -> tuple[str, list[str]]:
    """(preset, overrides) for this context."""
    common = [f"model.name={ctx.model}", f"trainer.seed={ctx.seed}", "trainer.eval_every=0", "trainer.save_every=0",
              "trainer.plots=false", "trainer.progress=false", f"trainer.device={ctx.device}"]
    if ctx.device.startswith("cuda"):
        return "paper", common + [f"rollout.max_new_tokens={CUDA_NEW_TOKENS}"]
    if ctx.quick:  # a smoke test: one turn keeps the whole --quick run under 2 minutes
        return "tiny", common + ["rollout.max_turns=1"]
    return "cpu", common


def run(ctx: BenchContext) -> list[Record]:
    """Seconds per iteration (total and per phase), trajectory tokens/s and peak memory."""
    import torch
    from rich.console import Console

    from fastpo.config import load_config
    import limits
    from fastpo.trainer import Trainer
    from reference_iteration import ReferenceTrainer

    cuda = ctx.device.startswith("cuda")
    if not cuda:
        fix_malloc_threshold()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # CPU: no warm-up iteration (the model is loaded and the envs compiled before timing; a
    # CPU-preset iteration of both sides takes minutes, and the whole run has 10 of them)
    warmup = 1 if cuda else 0
    # the full CPU run (every part in 10 minutes) times one iteration per side; --part e2e two,
    # or --repeats N when given (the figure the issue asks for is a median of 3)
    if cuda or ctx.quick or len(ctx.parts) > 1:
        timed = 1
    else:
        timed = ctx.repeats if ctx.repeats_given else 2
    preset, ov = sizes(ctx)
    quiet = Console(quiet=True)
    with tempfile.TemporaryDirectory() as d:
        trainers = {}
        for side, cls in (("fastpo", Trainer), ("reference", ReferenceTrainer)):
            cfg = load_config(env="frozenlake", preset=preset,
                              overrides=ov + [f"trainer.output_dir={os.path.join(d, side)}"])
            tr = cls(cfg, console=quiet)
            tr.setup()
            trainers[side] = tr
        spy = limits.UpdateSpy(trainers["fastpo"])
        res = {s: {"total": [], "mem": [], "tokens": [], "generated": [], "trained": [],
                   **{p: [] for p in PHASES}} for s in trainers}
        for it in range(1, 1 + warmup + timed):
            for side, tr in trainers.items():
                box = {}

                def one():
                    sync()
                    t0 = time.perf_counter()
                    box["m"] = tr.iteration(it)
                    sync()
                    box["s"] = time.perf_counter() - t0

                mem, _ = peak_memory(one, ctx.device)
                print(f"e2e: {side} iteration {it}: {box['s']:.1f} s", file=sys.stderr, flush=True)
                if it <= warmup:
                    continue
                m, r = box["m"], res[side]
                r["total"].append(box["s"])
                r["mem"].append(mem)
                for p in PHASES:
                    r[p].append(float(m[f"time/{p}_s"]))
                n_traj = tr.cfg.rollout.env_groups * tr.cfg.rollout.group_size
                r["tokens"].append(m["train/tokens_per_trajectory"] * n_traj)
                r["generated"].append(float(m.get("train/generated_tokens", float("nan"))))
                r["trained"].append(m["train/response_length"] * n_traj)
        cfg = trainers["fastpo"].cfg
        label = trainers["fastpo"].parts.models.info.label
        # the machine's limits, measured now, against the last timed iteration's update and rollout
        limit_recs = limits.limit_records(trainers["fastpo"], spy, res["fastpo"]["update"][-1], ctx.device,
                                          f"{preset} preset, {label}")
        source = trainers["fastpo"].parts.plan.old_logprob_source
        for tr in trainers.values():
            tr.logger.close()
        del trainers

    def med(side, key):
        v = res[side][key]
        return statistics.median(v), (max(v) - min(v))

    rc = cfg.rollout
    what = (f"{preset} preset, frozenlake, {rc.env_groups}x{rc.group_size} trajectories, {rc.max_turns} turns, "
            f"{rc.max_new_tokens} new tokens/turn"
            + (" (cut from 400 to fit the GPU check)" if cuda else "")
            + f", {label}, {ctx.device}{', bf16 autocast' if cuda else ''}; fastpo's old log-probs: {source} "
            f"(algorithm.old_logprob={cfg.algorithm.old_logprob}), the reference's: recomputed; {warmup} warm-up + "
            f"{timed} timed iteration(s) per side, interleaved")
    toks = (f"per iteration: generated tokens {med('fastpo', 'generated')[0]:.0f} vs "
            f"{med('reference', 'generated')[0]:.0f}, trajectory tokens {med('fastpo', 'tokens')[0]:.0f} vs "
            f"{med('reference', 'tokens')[0]:.0f} (fastpo vs reference; sampling differs between the loops)")
    base = "reference-style iteration"
    target = 3.0 if cuda else 2.5
    tf, sf = med("fastpo", "total")
    tb, sb = med("reference", "total")
    recs = [Record(PART, "seconds per training iteration", "s", tf, tb, False, sf, sb, base, target, f"{what}; {toks}")]
    for p in PHASES:
        a, sa = med("fastpo", p)
        b, sb_ = med("reference", p)
        recs.append(Record(PART, f"  phase {p}", "s", a, b, False, sa, sb_, base, None,
                           "weight sync: none on either side (generator = trained module)" if p == "update" else ""))
    kf, kb = med("fastpo", "tokens")[0], med("reference", "tokens")[0]
    recs.append(Record(PART, "trajectory tokens per second of iteration", "tokens/s", kf / tf, kb / tb, True,
                       baseline_name=base, notes=toks))
    # the last timed iteration's: without a warm-up the first one also allocates the
    # optimizer's state (the same on both sides), which would hide the difference
    mf = res["fastpo"]["mem"][-1] / 2**20
    mb = res["reference"]["mem"][-1] / 2**20
    mem_how = "torch.cuda.max_memory_allocated" if cuda else "resident set high-water mark, VmHWM"
    rec = Record(PART, "peak memory per iteration", "MiB", max(mf, 1e-3), mb, False, baseline_name=base, target=1.0,
                 notes=f"above the memory in use before the iteration ({mem_how}), last timed iteration"
                       f"{' (the first: it includes allocating the optimizer state)' if timed == 1 and not warmup else ''}"
                       "; target: lower than the baseline")
    rec.met = rec.ratio is not None and rec.ratio > 1.0
    recs.append(rec)
    return recs + limit_recs


if __name__ == "__main__":
    for r in run(BenchContext(quick="--quick" in sys.argv)):
        print(r)
