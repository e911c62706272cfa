"""DAgger data for FrozenLake: the states a trained model visits, labelled with the optimal move.

Rolls out a fastpo checkpoint (its env options and rollout settings) on training seeds at a
sampling temperature, keeps each trajectory's observations (the states the model's own moves
led to) and labels every answer with the optimal policy's move for that state and the actions
left (`FrozenLakeEnv.optimal_policy`, the table the expert plays), then writes the
conversations as JSONL chat messages (`fastpo sft sft.data=FILE`): with `--history expert`
each trajectory with its answers replaced by the labels, with `--history own` one
conversation per labelled turn whose earlier answers are the model's own, as context
("weight": 0), which is what the model sees when it plays. With `--expert N` the
expert's own trajectories on the first N of those seeds are appended (one aggregated data set,
as in DAgger, Ross et al. 2011, arXiv 1011.0686).

The state of each turn is read back from its user message (the coordinate observation says
"You (P) are at (r, c)" and "You have N actions left"): the run must use
env.options.observation=coords or cells+coords.

    python tools/dagger_frozenlake.py --model RUN --seeds 384 --temperature 0.5 --expert 128 --out data.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_AT = re.compile(r"You \(P\) are at \((\d+), (\d+)\)")
_LEFT = re.compile(r"You have (\d+) actions? left")


def turn_state(user_message: str) -> tuple[int, int, int]:
    """(row, column, actions left) of the turn whose user message is `user_message`.
    Raises ValueError when the message does not carry them (not a coordinate observation)."""
    at, left = _AT.search(user_message), _LEFT.search(user_message)
    if at is None or left is None:
        raise ValueError(f"no position or actions-left line in the user message {user_message[-200:]!r}")
    return int(at.group(1)), int(at.group(2)), int(left.group(1))


def relabelled_messages(system: str, users: list, moves: list) -> list:
    """The chat of one trajectory (TRL's conversational format): the system message, then per
    turn k its user message `users[k]` and the answer `<answer>{moves[k]}</answer>`."""
    msgs = [{"role": "system", "content": system}]
    for user, move in zip(users, moves):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": f"<answer>{move}</answer>"}]
    return msgs


def relabel(batch, policy: np.ndarray, names: list, cols: int, horizon: int, system: str,
            history: str = "expert", per_trajectory: int = 0, rng=None) -> tuple[list, int, int]:
    """DAgger's labels for a TrajectoryBatch of one trajectory per env instance (instance b of
    the env `policy` came from played trajectory b): each answered turn's label is
    policy[b, min(actions left, horizon), row * cols + column], the state read from its user
    message.

    history "expert": one conversation per trajectory, every answer replaced by its label.
    history "own": one conversation per labelled turn k, the trajectory's turns up to k with
    the model's own earlier answers as context ("weight": 0) and the label as the one target,
    so that the model learns to act from the histories it makes itself; `per_trajectory` > 0
    keeps that many turns of each trajectory (drawn with `rng`, a numpy Generator).
    Returns ({"messages": ...} rows, answered turns whose answer was the label, answered turns).
    """
    rows, agree, total = [], 0, 0
    for b in range(len(batch)):
        answers = [t.strip() for t in batch.response_texts[b]]
        users = batch.user_messages[b][:len(answers)]
        moves = []
        for k, user in enumerate(users):
            r, c, left = turn_state(user)
            moves.append(names[int(policy[b, min(left, horizon), r * cols + c])])
            agree += int(answers[k] == f"<answer>{moves[-1]}</answer>")
            total += 1
        if history == "expert":
            rows.append({"messages": relabelled_messages(system, users, moves)})
            continue
        turns = range(len(users))
        if 0 < per_trajectory < len(users):
            turns = sorted(rng.choice(len(users), per_trajectory, replace=False).tolist())
        for k in turns:
            msgs = [{"role": "system", "content": system}]
            for j in range(k):
                msgs += [{"role": "user", "content": users[j]},
                         {"role": "assistant", "content": answers[j], "weight": 0}]
            msgs += [{"role": "user", "content": users[k]},
                     {"role": "assistant", "content": f"<answer>{moves[k]}</answer>"}]
            rows.append({"messages": msgs})
    return rows, agree, total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a fastpo run folder or checkpoint (FrozenLake, coords)")
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

    from fastpo.evaluate import eval_config
    from fastpo.envs import make_env
    from fastpo.models import load_model_checked
    from fastpo import rollout as ro
    from fastpo.config.fields import ConfigError
    from fastpo.sft import expert_rollout

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
    obs = cfg.env.options.get("observation")
    if obs not in ("coords", "cells+coords"):
        print(f"dagger_frozenlake: the model was trained with observation={obs!r}; needs coords or cells+coords",
              file=sys.stderr)
        return 2
    model, tok, info = load_model_checked(cfg.model.name, device="cpu")
    rollout = ro.MultiTurnRollout.from_config(cfg, ro.NativeEngine(model, tok), tok)
    seeds = list(range(a.seed_offset, a.seed_offset + a.seeds))
    horizon = cfg.rollout.max_actions_per_traj
    env = make_env("frozenlake", len(seeds), cfg.env.options)
    env.reset(np.asarray(seeds, dtype=np.int64))
    policy = env.optimal_policy(horizon)  # [B, horizon + 1, cells]
    names = env.action_names(0)
    cols = env.size[1]

    t0 = time.perf_counter()
    rng = np.random.default_rng(a.sampling_seed)
    system = rollout.chat.system_prompt
    rows, agreed, turns, wins = [], 0, 0, 0
    for i in range(0, len(seeds), a.chunk):  # the KV cache of a chunk is what bounds memory
        part = seeds[i:i + a.chunk]
        with torch.no_grad():
            batch = rollout.generate(part, 1, temperature=a.temperature, seed=a.sampling_seed + i)
        got, agree, n = relabel(batch, policy[i:i + len(part)], names, cols, horizon, system, a.history,
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
        rows += relabel(eb, policy[:a.expert], names, cols, horizon, system)[0]  # its own answers, as labelled
        print(f"appended {len(eb)} expert trajectories (success {float(eb.success.float().mean()):.3f})")
    with open(a.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} conversations to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
