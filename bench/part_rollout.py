"""Rollout benchmark: fastpo's native engine vs a reference-style multi-turn loop.

    python bench/throughput.py --part rollout [--quick] [--device cuda --model random:qwen2.5-0.5b]

Both loops use the same model, environments, seeds, prompts, game logic and sampling
settings (temperature 1, no top-k/top-p, stop at "</answer>" or the end-of-turn token):

- fastpo: `MultiTurnRollout` + `NativeEngine` (token-in-token-out; each group's prompt
  prefilled once; KV caches kept across turns, only new tokens prefilled; finished rows
  leave the decode batch).
- baseline: `ReferenceRollout` (bench/reference_rollout.py) (RAGEN-style: each turn the whole
  history is re-rendered with the chat template, re-tokenized, left-padded and re-prefilled
  by `model.generate`).

Per environment (FrozenLake 4x4, Sokoban 6x6 with one box) three records: wall time per
rollout batch (target 1.5x), prefilled tokens per batch (target 2x) and generated tokens/s
(no target; the two loops sample different tokens, so their response lengths differ a
little; wall time and tokens/s are both shown for that reason).

Sizes: CPU 2 groups x 4 trajectories, 5 turns, 48 new tokens per turn; when e2e runs too
(the full run, 10 minutes), Sokoban only at 1 x 4 and 3 turns (e2e covers FrozenLake);
--quick FrozenLake only, 1 x 2, 2 turns, 8 tokens; CUDA (the paper's scale) 8 x 16, 5 turns,
128 tokens. Both loops get an untimed one-turn warm-up; one timed batch each unless
--repeats N is given (then N interleaved batches each, median and spread reported).
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record, measure  # noqa: E402

PART = "rollout"
ENVS = (("frozenlake", {"size": 4}), ("sokoban", {}))


def sizes(ctx: BenchContext) -> dict:
    """Groups, group size, turns and tokens for this context."""
    if ctx.quick:
        return dict(groups=1, group_size=2, turns=2, new_tokens=8)
    if ctx.device.startswith("cuda"):
        return dict(groups=8, group_size=16, turns=5, new_tokens=128)
    if "e2e" in ctx.parts:  # the full CPU run: one group, 3 turns (the CPU preset's), within 10 minutes
        return dict(groups=1, group_size=4, turns=3, new_tokens=48)
    return dict(groups=2, group_size=4, turns=5, new_tokens=48)


def run(ctx: BenchContext) -> list:
    import torch

    from fastpo.envs_native import make_native_env
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout import MultiTurnRollout, NativeEngine, RolloutConfig
    from reference_rollout import ReferenceRollout

    model, tok, info = load_model_and_tokenizer(ctx.model, device=ctx.device)
    sz = sizes(ctx)
    cfg = RolloutConfig(max_turns=sz["turns"], max_new_tokens=sz["new_tokens"], max_context=3600, temperature=1.0)
    seeds = [ctx.seed + 17 * g for g in range(sz["groups"])]
    sync = torch.cuda.synchronize if ctx.device.startswith("cuda") else None
    # A batch is minutes on the CPU and the GPU check has a shared time budget: one timed
    # batch per loop unless --repeats asks for more (then interleaved, median reported).
    repeats = ctx.repeats if ctx.repeats_given else 1
    warm_cfg = RolloutConfig(max_turns=1, max_new_tokens=4, max_context=3600)
    records = []
    envs = ENVS[:1] if ctx.quick else ENVS  # --quick: a smoke test of both loops
    if "e2e" in ctx.parts and not ctx.quick and not ctx.device.startswith("cuda"):
        # e2e measures FrozenLake's rollout (CPU preset, against the same reference loop):
        # the full CPU run keeps its 10 minutes by leaving it out here
        envs = tuple(e for e in ENVS if e[0] != "frozenlake")
    for env_name, env_cfg in envs:
        try:
            make_native_env(env_name, 1, **env_cfg).reset([0])  # Numba compile / cache load outside the timing
        except (ImportError, ValueError) as e:
            print(f"part rollout: skipping {env_name}: {e}", file=sys.stderr)
            continue
        engine = NativeEngine(model, tok)
        ours = MultiTurnRollout(engine, tok, env_name, env_cfg, cfg)
        ref = ReferenceRollout(model, tok, env_name, env_cfg, cfg)
        res = {}
        # Untimed warm-up of both loops: one-time setup (the stop-string tables of both, CUDA
        # kernels and allocators) stays out of the timing.
        warm_groups = 2 if sync is not None else 1
        MultiTurnRollout(engine, tok, env_name, env_cfg, warm_cfg).generate(seeds[:1], warm_groups)
        ReferenceRollout(model, tok, env_name, env_cfg, warm_cfg).generate(seeds[:1], warm_groups)
        times = {"ours": [], "ref": []}
        tokens = {"ours": 0.0, "ref": 0.0}  # over every timed batch: tokens/s = their sum / total time
        for _ in range(repeats):
            for side, loop in (("ours", ours), ("ref", ref)):
                t, _s = measure(lambda: res.__setitem__(side, loop.generate(seeds, sz["group_size"], seed=ctx.seed)),
                                repeats=1, warmup=0, sync=sync)
                times[side].append(t)
                tokens[side] += res[side].metrics["generated_tokens"]
                print(f"part rollout: {env_name} {'native' if side == 'ours' else 'reference'} {t:.1f} s",
                      file=sys.stderr, flush=True)
        t_ours, s_ours = statistics.median(times["ours"]), max(times["ours"]) - min(times["ours"])
        t_ref, s_ref = statistics.median(times["ref"]), max(times["ref"]) - min(times["ref"])
        mo, mr = res["ours"].metrics, res["ref"].metrics
        what = (f"{env_name}, {sz['groups']}x{sz['group_size']} trajectories, {sz['turns']} turns, "
                f"{sz['new_tokens']} new tokens/turn, {info.label}, {ctx.device}")
        detail = (f"generated tokens {mo['generated_tokens']:.0f} vs {mr['generated_tokens']:.0f}; "
                  f"turns/traj {mo['num_turns']:.2f} vs {mr['num_turns']:.2f}")
        records.append(Record(PART, f"{env_name}: wall time per rollout batch", "s", t_ours, t_ref, False,
                              s_ours, s_ref, "reference-style loop (re-render + model.generate)", 1.5,
                              f"{what}; {detail}"))
        records.append(Record(PART, f"{env_name}: prefilled tokens per batch", "tokens", mo["prefilled_tokens"],
                              mr["prefilled_tokens"], False, 0.0, 0.0, "reference-style loop", 2.0, what))
        records.append(Record(PART, f"{env_name}: generated tokens/s", "tokens/s",
                              tokens["ours"] / sum(times["ours"]), tokens["ref"] / sum(times["ref"]), True, 0.0, 0.0,
                              "reference-style loop", None, f"{what}; {detail}"))
    return records
