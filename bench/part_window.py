"""Bounded context window benchmark: a long Sokoban episode with the last K turns kept vs all.

    python bench/throughput.py --part window [--quick] [--device cuda --model random:qwen2.5-0.5b]

One env group of a 20-turn Sokoban episode (8x8 room, 2 actions per turn, an action budget
that never ends it first) rolled out three ways in the same run, same model, same seeds:

- fastpo: `rollout.context_window = K` (K = 2): before each turn the engine evicts the
  oldest turn's KV entries, positions kept; nothing is re-prefilled (fastpo/rollout/window.py);
- full: every turn stays in the KV cache (the default);
- re-prefill: the same window rebuilt every turn with fresh positions, RAGEN's rendering of
  `limited_multi_turn` (`MultiTurnRollout.refill_window`; the sampler side only).

Reported: the largest KV buffer the engine held (bytes, `peak_kv_bytes`), rollout wall time
(median of the repeats, 1 unless --repeats, the three interleaved round by round,
after a one-turn warm-up) and, in the notes, the
turns run, tokens generated and prefilled. The three rollouts sample different responses
(their contexts differ), so the notes give the per-token figures too.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record, measure  # noqa: E402

PART = "window"


def sizes(ctx: BenchContext) -> dict:
    if ctx.quick:
        return dict(turns=6, new_tokens=8, group_size=2, K=2, room=6)
    if ctx.device.startswith("cuda"):
        return dict(turns=20, new_tokens=128, group_size=16, K=2, room=8)
    return dict(turns=20, new_tokens=48, group_size=2, K=2, room=8)


def run(ctx: BenchContext) -> list:
    import torch

    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout import MultiTurnRollout, NativeEngine, RolloutConfig

    model, tok, info = load_model_and_tokenizer(ctx.model, device=ctx.device)
    sz = sizes(ctx)
    env_cfg = {"size": sz["room"]}
    sync = torch.cuda.synchronize if ctx.device.startswith("cuda") else None
    reps = ctx.repeats if ctx.repeats_given else 1
    out = {}

    def rollout(name, window, refill=False):
        cfg = RolloutConfig(max_turns=sz["turns"], max_new_tokens=sz["new_tokens"], max_actions_per_turn=2,
                            max_actions_per_traj=2 * sz["turns"], max_context=8192, context_window=window)
        ro = MultiTurnRollout(NativeEngine(model, tok), tok, "sokoban", env_cfg, cfg)
        ro.refill_window = refill

        def go():
            ctx_ = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device.startswith("cuda") else \
                torch.autocast("cpu", enabled=False)
            with torch.no_grad(), ctx_:
                out[name] = ro.generate([ctx.seed + 7], sz["group_size"], seed=ctx.seed)
        return go

    K = sz["K"]
    # warm-up (first forwards, the env's compiled code), cheap: one short turn
    warm = RolloutConfig(max_turns=1, max_new_tokens=4, context_window=K)
    MultiTurnRollout(NativeEngine(model, tok), tok, "sokoban", env_cfg, warm).generate([ctx.seed + 7], 1, seed=0)
    runs = {"full": rollout("full", "full"), "evict": rollout("evict", K), "refill": rollout("refill", K, True)}
    # rounds interleave the three (a shared machine's load drifts over minutes)
    laps = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            laps[name].append(measure(fn, 1, warmup=0, sync=sync)[0])
    times = {n: (statistics.median(v), max(v) - min(v)) for n, v in laps.items()}

    def note(name):
        b = out[name]
        m = b.metrics
        longest = max(int(x.numel()) for x in b.input_ids)
        return (f"{name}: {m['num_turns']:.1f} turns, {m['generated_tokens']:.0f} generated / "
                f"{m['prefilled_tokens']:.0f} prefilled tokens, longest trajectory {longest} tokens, "
                f"{1e3 * times[name][0] / max(1.0, m['generated_tokens']):.1f} ms per generated token, "
                f"peak KV {m['peak_kv_bytes'] / 2**20:.1f} MiB")

    notes = f"{info.label}; {'; '.join(note(n) for n in runs)}"
    where = f"{sz['turns']}-turn Sokoban {sz['room']}x{sz['room']}, 1 group x {sz['group_size']}, " \
            f"{sz['new_tokens']} new tokens/turn, K={K}"
    kv = {n: out[n].metrics["peak_kv_bytes"] for n in runs}
    pre = {n: out[n].metrics["prefilled_tokens"] for n in runs}
    return [
        Record(PART, f"{where}: peak KV buffer", "bytes", kv["evict"], kv["full"], False,
               baseline_name="full context", notes=notes),
        Record(PART, f"{where}: rollout wall time", "s", times["evict"][0], times["full"][0], False,
               times["evict"][1], times["full"][1], baseline_name="full context", notes=notes),
        Record(PART, f"{where}: rollout wall time", "s", times["evict"][0], times["refill"][0], False,
               times["evict"][1], times["refill"][1], baseline_name="re-prefilling the window each turn",
               notes=notes),
        Record(PART, f"{where}: prefilled tokens", "tokens", pre["evict"], pre["refill"], False,
               baseline_name="re-prefilling the window each turn", notes=notes),
        Record(PART, f"{where}: peak KV buffer", "bytes", kv["evict"], kv["refill"], False,
               baseline_name="re-prefilling the window each turn", notes=notes),
    ]
