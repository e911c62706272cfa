"""DAgger data for FrozenLake as a file: the states a trained model visits, labelled with the optimal move.

A thin wrapper of fastpo.sft.labels (what `fastpo dagger` runs each round, docs/sft.md): rolls out a
fastpo checkpoint (its env options and rollout settings) on training seeds at a sampling
temperature, labels each answered turn with the optimal policy's move for the state it was
given in (`fastpo.sft.labels.label_trajectories`: each trajectory replayed on a fresh copy of the
game), then writes the conversations as JSONL chat messages (`fastpo sft sft.data=FILE`): with
`--history expert` each trajectory with its answers replaced by the labels, with `--history
own` one conversation per labelled turn whose earlier answers are the model's own, as context
("weight": 0), which is what the model sees when it plays (`labelled_conversations`). With
`--expert N` the expert's own trajectories on the first N of those seeds are appended (one
aggregated data set, as in DAgger, Ross et al. 2011, arXiv 1011.0686).

    python experiments/dagger_frozenlake.py --model RUN --seeds 384 --temperature 0.5 --expert 128 --out data.jsonl
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a fastpo run folder or checkpoint (FrozenLake)")
    p.add_argument("--seeds", type=int, default=384, help="training seeds 0..N-1 to roll out on")
    p.add_argument("--seed-offset", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.5,
                   help="sampling temperature of the rollout (default: the paper's eval temperature)")
    p.add_argument("--expert", type=int, default=0, help="append the expert's trajectories on the first N seeds")
    p.add_argument("--sampling-seed", type=int, default=1)
    p.add_argument("--history", choices=("expert", "own"), default="expert",
                   help="the answers earlier turns show: the labels, or the model's own (one conversation per turn)")
    p.add_argument("--per-trajectory", type=int, default=0,
                   help="with --history own: turns kept per trajectory (0: all)")
    p.add_argument("--chunk", type=int, default=128, help="trajectories rolled out at once (memory: ~21 GiB for 384)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    import torch

    from fastpo.evaluation.settings import eval_config
    from fastpo.model_loading import ModelLoadError, load_model_checked
    from fastpo import rollout as ro
    from fastpo.config.fields import ConfigError
    from fastpo.sft.experts import expert_rollout
    from fastpo.sft.labels import expert_conversations, jsonl, label_trajectories, labelled_conversations

    for flag, v, low in (("--seeds", a.seeds, 1), ("--expert", a.expert, 0), ("--chunk", a.chunk, 1),
                         ("--per-trajectory", a.per_trajectory, 0)):
        if v < low:
            print(f"dagger_frozenlake: {flag} {v}: must be >= {low}", file=sys.stderr)
            return 2
    try:
        cfg, _ = eval_config(env="frozenlake", overrides=[f"model.name={a.model}"])
    except (ConfigError, FileNotFoundError) as e:
        print(f"dagger_frozenlake: {e}", file=sys.stderr)
        return 2
    try:
        model, tok, info = load_model_checked(cfg.model.name, device="cpu")
    except ModelLoadError as e:
        print(f"dagger_frozenlake: {e}", file=sys.stderr)
        return 2
    rollout = ro.MultiTurnRollout.from_config(cfg, ro.NativeEngine(model, tok), tok)
    seeds = list(range(a.seed_offset, a.seed_offset + a.seeds))

    t0 = time.perf_counter()
    rng = np.random.default_rng(a.sampling_seed)
    system = rollout.chat.system_prompt
    rows, agreed, turns, wins = [], 0, 0, 0
    for i in range(0, len(seeds), a.chunk):  # the KV cache of a chunk is what bounds memory
        part = seeds[i:i + a.chunk]
        with torch.no_grad():
            batch = rollout.generate(part, 1, temperature=a.temperature, seed=a.sampling_seed + i)
        got, agree, n = labelled_conversations(batch, label_trajectories(batch, rollout), system, a.history,
                                               a.per_trajectory, rng)
        rows += got
        agreed, turns, wins = agreed + agree, turns + n, wins + int(batch.success.sum())
        print(f"rolled out seeds {part[0]}..{part[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"{info.label} on {len(seeds)} seeds at temperature {a.temperature}: success {wins / len(seeds):.3f}, "
          f"{turns / len(seeds):.2f} turns; {turns} turns labelled ({len(rows)} conversations), the model's "
          f"answer was the optimal move in "
          f"{agreed / max(turns, 1):.3f} of them", flush=True)

    if a.expert:
        eb = expert_rollout(tok, "frozenlake", cfg.env.options, cfg.rollout.rollout_config(), seeds[:a.expert], 1)
        rows += expert_conversations(eb, system)  # its answers are its labels
        print(f"appended {len(eb)} expert trajectories (success {float(eb.success.float().mean()):.3f})")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(jsonl(rows))
    print(f"wrote {len(rows)} conversations to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
