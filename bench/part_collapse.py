"""Collapse-metrics benchmark: the cross log-prob matrix packed with shared prompts vs pair by pair.

    python bench/throughput.py --part collapse [--quick] [--device cuda --model random:qwen2.5-0.5b]

The matrix l_j(z_i) = log p(z_i | x_j) over the N first-turn prompts and the R first-turn
responses of a real rollout batch (fastpo/trainer/collapse.py), computed three ways in the same run,
with the same model and the same pairs:

- fastpo: `cross_logprobs` (what the trainer logs `collapse/*` with): per prompt, one packed
  row holding the prompt once and every response after it (segment attention), log-probs
  from the fused kernel, no [tokens x vocab] logits;
- pair by pair, packed: the same function with `share_prompt=False`: every (prompt,
  response) pair carries its own copy of the prompt (same packing, same kernel);
- pair by pair, plain: `cross_logprobs_naive`, one forward per pair with full logits (the
  reference; RAGEN's scorer runs each prompt's [x_j | z_i] rows through its log-prob pass).

Sizes: the CPU preset's (FrozenLake, 2 env groups x 4 trajectories, 48 new tokens, token
budget 2048; targets: >= 3x fewer tokens and >= 2x less time than pair by pair); --quick
2 x 2, 8 tokens; CUDA: the paper's 8 x 16, 128 tokens, budget 8192. Reported:
tokens run through the model, seconds (median of the repeats after a warm-up) and the
largest difference between fastpo's matrix and the plain reference's (notes).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record, measure  # noqa: E402

PART = "collapse"


def sizes(ctx: BenchContext) -> dict:
    if ctx.quick:
        return dict(groups=2, group_size=2, new_tokens=8, budget=2048)
    if ctx.device.startswith("cuda"):
        return dict(groups=8, group_size=16, new_tokens=128, budget=8192)
    return dict(groups=2, group_size=4, new_tokens=48, budget=2048)  # the CPU preset


def run(ctx: BenchContext) -> list:
    import torch

    from fastpo.trainer.collapse import cross_logprobs, cross_logprobs_naive, first_turn_pairs
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.packing import use_segment_attention
    from fastpo.rollout import MultiTurnRollout, NativeEngine, RolloutConfig

    model, tok, info = load_model_and_tokenizer(ctx.model, device=ctx.device)
    use_segment_attention(model)  # as the trainer does
    sz = sizes(ctx)
    cfg = RolloutConfig(max_turns=1, max_new_tokens=sz["new_tokens"], temperature=1.0)
    ro = MultiTurnRollout(NativeEngine(model, tok), tok, "frozenlake", {}, cfg)
    seeds = [ctx.seed + 17 * g for g in range(sz["groups"])]
    batch = ro.generate(seeds, sz["group_size"], seed=ctx.seed)
    pairs = first_turn_pairs(batch, tok, think=True)
    sync = torch.cuda.synchronize if ctx.device.startswith("cuda") else None
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if ctx.device.startswith("cuda")
                else (lambda: torch.autocast("cpu", enabled=False)))
    out = {}

    def shared():
        out["shared"] = cross_logprobs(model, pairs.prompts, pairs.responses, temperature=1.0,
                                       token_budget=sz["budget"], autocast=autocast)

    def pairwise():
        out["pairs"] = cross_logprobs(model, pairs.prompts, pairs.responses, temperature=1.0, share_prompt=False,
                                      token_budget=sz["budget"], autocast=autocast)

    def naive():
        out["naive"] = cross_logprobs_naive(model, pairs.prompts, pairs.responses, temperature=1.0)

    reps = ctx.repeats
    t_shared, s_shared = measure(shared, reps, sync=sync)
    t_pairs, s_pairs = measure(pairwise, reps, sync=sync)
    # the plain reference is the slowest by far on a GPU at the paper's scale (N x R forwards): once there
    t_naive, s_naive = measure(naive, 1 if ctx.device.startswith("cuda") else reps, sync=sync)
    diff = float((out["shared"].sums - out["naive"].sums).abs().max())
    N, R = len(pairs.prompts), len(pairs.responses)
    where = (f"{N} prompts (mean {sum(len(x) for x in pairs.prompts) / N:.0f} tokens) x {R} responses "
             f"(mean {float(out['shared'].lengths.double().mean()):.1f} tokens); max |fastpo - plain reference| "
             f"{diff:.2e} nats")
    name = f"cross log-prob matrix, {N} prompts x {R} first-turn responses (frozenlake)"
    return [
        Record(PART, f"{name}: tokens computed", "tokens", out["shared"].tokens, out["pairs"].tokens, False,
               baseline_name="each pair scored separately (packed, same kernel)", target=3.0, notes=where),
        Record(PART, f"{name}: wall time", "s", t_shared, t_pairs, False, s_shared, s_pairs,
               baseline_name="each pair scored separately (packed, same kernel)", target=2.0, notes=where),
        Record(PART, f"{name}: wall time", "s", t_shared, t_naive, False, s_shared, s_naive,
               baseline_name="each pair scored separately (one forward per pair, full logits)", notes=where),
    ]
