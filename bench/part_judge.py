"""The LLM judge's cost (issue 36): its share of a StarPO iteration.

    python bench/throughput.py --part judge [--quick] [--repeats N]

`fastpo train --env frozenlake` on this machine's default preset (the CPU preset here) with
the judge on: a yes/no rubric over the whole transcript, judged by the policy's starting
weights (`reward.judge_model` unset), `reward.mode=add`. Each iteration's `time/judge_s`
(the judge's prompts prefilled and its replies decoded, batched, in `reward.judge_batch_size`
chunks) against the rest of the same iteration (`time/iteration_s` minus it: rollout,
old log-probs, advantages, update). N iterations (default 1: minutes each on the CPU) give
medians. --quick: the tiny preset (1 group x 2, 2 turns) on the random tiny model.
Reported beside it in the notes: the judge's share of the iteration and its unparsed rate.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record  # noqa: E402

PART = "judge"
RUBRIC = ("Here is a transcript of a FrozenLake game: the player (P) must reach the goal (G) without "
          "falling into a hole (O). Did the player reach the goal? Answer yes or no.\n\n{transcript}")


def run(ctx: BenchContext) -> list[Record]:
    """Side-by-side records for `python bench/throughput.py --part judge`."""
    from rich.console import Console

    from fastpo.config import load_config
    from fastpo.trainer import Trainer

    iterations = ctx.repeats if ctx.repeats_given else 1
    with tempfile.TemporaryDirectory() as tmp:
        rubric = os.path.join(tmp, "rubric.txt")
        with open(rubric, "w", encoding="utf-8") as f:
            f.write(RUBRIC)
        overrides = [f"trainer.output_dir={os.path.join(tmp, 'run')}", f"reward.judge_rubric_file={rubric}",
                     f"trainer.iterations={iterations}", "trainer.eval_every=0", "trainer.eval_before_training=false",
                     "trainer.plots=false", "trainer.collapse_every=0", "trainer.save_every=0",
                     "trainer.progress=false", f"trainer.device={ctx.device}", f"trainer.seed={ctx.seed}"]
        cfg = load_config(env="frozenlake", preset="tiny" if ctx.quick else None, overrides=overrides,
                          values={"model.name": "random:tiny-llama" if ctx.quick else ctx.model})
        records = Trainer(cfg, console=Console(quiet=True)).run()
    judge_s = statistics.median(r["time/judge_s"] for r in records)
    iter_s = statistics.median(r["time/iteration_s"] for r in records)
    unparsed = statistics.mean(r["train/judge_unparsed_rate"] for r in records)
    r = cfg.rollout
    shape = (f"FrozenLake, {'tiny' if ctx.quick else 'default'} preset: {r.env_groups} x {r.group_size} trajectories, "
             f"up to {r.max_turns} turns; judge = the starting weights, {cfg.reward.judge_max_new_tokens} new tokens")
    notes = (f"median of {len(records)} iteration(s); the judge is {judge_s / iter_s:.1%} of the iteration; "
             f"unparsed replies {unparsed:.2f}; judge batches of {cfg.reward.judge_batch_size}")
    return [Record(PART, f"judge time vs the rest of the iteration ({shape})", "s", judge_s, iter_s - judge_s,
                   False, baseline_name="the iteration without the judge", notes=notes)]


if __name__ == "__main__":
    for rec in run(BenchContext(quick="--quick" in sys.argv, parts=(PART,))):
        print(rec)
