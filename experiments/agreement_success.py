"""How often must an imitator agree with FrozenLake's expert to clear the random policy? (issue 33)

    python experiments/agreement_success.py [--seeds 128] [--horizon 10] [--no-slip]
                                      [--agreement 0.25,0.5,0.587,0.75,1] [--json FILE]

The imitator's policy with k actions left in cell s: the expert's move (the closed-loop
optimal table, `FrozenLakeEnv.optimal_policy`) with probability p, each of the other three
with probability (1 - p) / 3. Its success probability on each eval seed's map within
`--horizon` actions is exact: finite-horizon policy evaluation (`FrozenLakeEnv.policy_success`)
with the env's own transition probabilities (slip: the intended direction with
`success_prob`, each perpendicular one with (1 - success_prob) / 2), V_k(s) = sum_a
pi(a | s, k) sum_s' P(s' | s, a) (1 if s' is the goal, V_{k-1}(s') if frozen, 0 in a hole).
p = 1 is `optimal_success`, p = 1/4 is `random_success`.

Agreement here is the per-move probability on every state the imitator reaches, with errors
spread evenly: an upper reading of what a measured first-move accuracy (teacher-forced, on the
expert's own states) buys. A model whose errors repeat (the same wrong move in the same cell)
does worse than this line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def imitator_success(env, horizon: int, agreement: float) -> np.ndarray:
    """float64 [B]: each current instance's probability of reaching the goal within `horizon`
    actions for the imitator above (agreement p in [0, 1]). env: a reset FrozenLakeEnv."""
    table = env.optimal_policy(horizon).astype(np.int64)  # [B, horizon + 1, R * C]
    pi = np.full(table.shape + (4,), (1 - agreement) / 3)
    np.put_along_axis(pi, table[..., None], agreement, axis=-1)
    return env.policy_success(pi)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=128, help="the first N eval seeds of `fastpo train --env frozenlake`")
    ap.add_argument("--horizon", type=int, default=10, help="actions per episode (10 turns of one move)")
    ap.add_argument("--no-slip", action="store_true", help="is_slippery=False")
    ap.add_argument("--agreement", default="0.25,0.4,0.5,0.587,0.7,0.8,0.9,1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        ps = [float(x) for x in args.agreement.split(",")]
    except ValueError:
        print(f"agreement_success: --agreement {args.agreement!r}: must be numbers separated by commas",
              file=sys.stderr)
        return 2
    bad = [p for p in ps if not 0 <= p <= 1]
    if bad or args.seeds < 1 or args.horizon < 1:
        what = (f"--agreement {bad[0]!r}: must be in [0, 1]" if bad else
                f"--seeds {args.seeds}: must be >= 1" if args.seeds < 1 else f"--horizon {args.horizon}: must be >= 1")
        print(f"agreement_success: {what}", file=sys.stderr)
        return 2

    from fastpo.envs_native.frozenlake import FrozenLakeEnv
    from fastpo.config.loading import load_config
    from fastpo.config.schema import eval_seeds

    cfg = load_config(env="frozenlake", preset="cpu", overrides=[f"trainer.eval_seeds={args.seeds}"])
    seeds = eval_seeds(cfg)
    options = {k: v for k, v in cfg.env.options.items() if k != "observation"}
    env = FrozenLakeEnv(len(seeds), **{**options, "is_slippery": not args.no_slip})
    env.reset(seeds)
    res = {"seeds": len(seeds), "horizon": args.horizon, "is_slippery": env.is_slippery,
           "random": float(env.random_success(seeds, args.horizon).mean()),
           "optimal": float(env.optimal_success(seeds, args.horizon).mean()),
           "rows": [{"agreement": p, "success": float(imitator_success(env, args.horizon, p).mean())} for p in ps]}
    print(f"FrozenLake ({'slippery' if env.is_slippery else 'no slip'}), {len(seeds)} eval seeds, "
          f"{args.horizon} actions: random {res['random']:.3f}, optimal {res['optimal']:.3f}")
    for row in res["rows"]:
        print(f"  agreement {row['agreement']:.3f}: success {row['success']:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
