"""The LLM judge against a game's own verdict: a sanity table (issue 36).

    python tools/judge_agreement.py [--env sokoban] [--expert 32] [--policy 32] [--judge MODEL]
                                    [--json FILE]

Trajectories whose outcome is known: `--expert` of the game's solver (mostly solved) and
`--policy` of the model itself sampling (mostly not), on disjoint seeds, one move per turn over
10 turns, answer-only prompt. Each is judged (yes/no, greedy, `fastpo.judge.Judge`) with three
rubrics: the transcript only, the transcript with the state after the last move (`{final}`),
and the same with the question repeated after the trajectory. Printed per rubric: how many
were judged, the judge's yes rate, its unparsed rate, and against the game's success:
accuracy, the rate of yes on solved trajectories, of no on unsolved ones, and Cohen's kappa
(agreement beyond chance; 0 = chance, 1 = perfect). An unparsed reply counts as the fallback
"no" (what training would do with `judge_fallback=0`).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

RUBRICS = {
    "transcript": ("Below is a transcript of a {game} game. {goal} Was the puzzle solved at the end? "
                   "Answer with one word: yes or no.\n\n{{transcript}}"),
    "transcript + final state": ("Below is a transcript of a {game} game, then the state after the last move. "
                                 "{goal} Was the puzzle solved at the end? Answer with one word: yes or no.\n\n"
                                 "{{transcript}}\n\nState after the last move:\n{{final}}"),
    # the question again after the trajectory, where a small model's recency looks (the prompts then
    # share only the text up to {transcript})
    "transcript + final state, question last": (
        "Below is a transcript of a {game} game, then the state after the last move. {goal}\n\n{{transcript}}\n\n"
        "State after the last move:\n{{final}}\n\nQuestion: was the puzzle solved at the end? Answer with one word, "
        "yes or no."),
}
GOALS = {"sokoban": "The player (P) must push every box (X) onto a target (O); a box on a target is shown as √.",
         "frozenlake": "The player (P) must reach the goal (G) without falling into a hole (O)."}


def agreement(judged: list, truth: list, parsed: list) -> dict:
    """Figures of yes/no verdicts `judged` (bool) against `truth` (bool); `parsed`: whether
    each reply held a verdict."""
    n = len(truth)
    tp = sum(j and t for j, t in zip(judged, truth))
    tn = sum((not j) and (not t) for j, t in zip(judged, truth))
    pos = sum(truth)
    acc = (tp + tn) / n
    p_yes = sum(judged) / n
    chance = p_yes * pos / n + (1 - p_yes) * (1 - pos / n)
    return {"n": n, "solved": pos, "yes_rate": p_yes, "unparsed_rate": 1 - sum(parsed) / n, "accuracy": acc,
            "yes_on_solved": tp / pos if pos else None, "no_on_unsolved": tn / (n - pos) if n - pos else None,
            "kappa": (acc - chance) / (1 - chance) if chance < 1 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="sokoban", choices=sorted(GOALS))
    ap.add_argument("--expert", type=int, default=32, help="solver trajectories (seeds 0..)")
    ap.add_argument("--policy", type=int, default=32, help="the model's own trajectories (seeds 1000..)")
    ap.add_argument("--model", default=None, help="the policy (default: the embedded model)")
    ap.add_argument("--judge", default=None, help="the judge model (default: the policy's weights)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from fastpo.config import RolloutConfig, TrainConfig
    from fastpo.judge import Judge
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rewards import trajectory_of
    from fastpo.rollout import MultiTurnRollout, NativeEngine
    from fastpo.rollout.trajectory_batch import TrajectoryBatch
    from fastpo.sft.experts import expert_rollout

    torch.manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, encoding="utf-8",
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()  # the code that runs
    name = args.model or TrainConfig().model.name
    model, tok, info = load_model_and_tokenizer(name)
    cfg = RolloutConfig(max_turns=10, max_actions_per_turn=1, max_actions_per_traj=10, max_new_tokens=16,
                        max_context=4096, think=False, prompt_examples=True, temperature=0.7)
    t0 = time.perf_counter()
    parts = []
    if args.expert:
        parts.append(expert_rollout(tok, args.env, {}, cfg, list(range(args.expert)), actions_per_turn=1))
    if args.policy:
        ro = MultiTurnRollout(NativeEngine(model, tok), tok, args.env, {}, cfg)
        with torch.no_grad():
            parts.append(ro.generate(list(range(1000, 1000 + args.policy)), 1, seed=0))
    batch = TrajectoryBatch.concat(parts)
    rollout_s = time.perf_counter() - t0
    trajs = [trajectory_of(batch, i, args.env) for i in range(len(batch))]
    truth = [t.success for t in trajs]
    judge_model, judge_tok = (model, tok) if args.judge is None else load_model_and_tokenizer(args.judge)[:2]
    rows = []
    for label, template in RUBRICS.items():
        rubric = template.format(game=args.env.capitalize(), goal=GOALS[args.env])
        v = Judge(judge_model, judge_tok, rubric, max_new_tokens=8, batch_size=16).grade(trajs)
        row = {"rubric": label, **agreement([s >= 0.5 for s in v.scores], truth, v.parsed),
               "judge_seconds": v.seconds, "too_long": v.too_long,
               "replies": [r[:80] for r in v.replies[:3]] + [r[:80] for r in v.replies[args.expert:args.expert + 3]]}
        rows.append(row)
    out = {"env": args.env, "policy": info.label, "judge": args.judge or info.label, "expert": args.expert,
           "policy_trajectories": args.policy, "rollout_seconds": rollout_s, "rows": rows,
           "commit": commit,
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, threads {torch.get_num_threads()}",
           "load_average": os.getloadavg()}

    def f(x):
        return "-" if x is None else f"{x:.2f}"

    print(f"{args.env}: {len(trajs)} trajectories ({sum(truth)} solved), judge {out['judge']}")
    print("| rubric | judged | yes rate | unparsed | accuracy | yes on solved | no on unsolved | kappa |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rubric']} | {r['n'] - r['too_long']} | {f(r['yes_rate'])} | {f(r['unparsed_rate'])} | "
              f"{f(r['accuracy'])} | {f(r['yes_on_solved'])} | {f(r['no_on_unsolved'])} | {f(r['kappa'])} |")
        print(f"  first replies: {r['replies']}", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
