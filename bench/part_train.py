"""Trainer benchmarks: packed vs padded micro-batches, and seconds per training iteration.

1. Packed vs padded (same model, same trajectories, same fused policy loss, forward + backward
   of one mini-batch with gradient accumulation): fastpo packs trajectories into token-budget
   micro-batches as its trainer does (one row, attention per trajectory through fastpo's
   segment attention, each env group's prompt computed once per micro-batch); the baseline
   pads micro-batches of a fixed count of trajectories (the paper's micro-batch 4) to their
   longest member, as the reference implementation does. The trajectories come in env groups
   of 4 sharing a prompt (loss mask 0) followed by 1-5 turns of varying length.
   Reported: tokens/s counting the trajectories' tokens (no padding, a shared prompt counted
   once per trajectory, as the baseline computes it), and peak memory.
2. Seconds per iteration of `fastpo train` at the CPU preset (FrozenLake, embedded model),
   split by phase (no baseline: reported as is). With --device cuda and a random:qwen2.5-0.5b
   model at the paper's scale, the same split. On the CPU, beside it, the machine's limits
   measured after the iteration in the same process (`bench/limits.py`, as the e2e part does:
   update and prefill FLOP/s against the GEMM FLOP/s, decode seconds per step against a bare
   forward and the weights + KV read time).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record, measure, peak_memory  # noqa: E402


def _lengths(n: int, rng: np.random.Generator, prompt: int, per_turn: int, max_turns: int) -> list[int]:
    turns = rng.integers(1, max_turns + 1, size=n)
    return [int(prompt + sum(rng.integers(per_turn // 3, per_turn + 1) for _ in range(t))) for t in turns]


def _packed_vs_padded(ctx: BenchContext) -> list[Record]:
    from fastpo.kernels import causal_lm_policy_loss, decoder_body, linear_policy_loss, lm_head_weight
    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.packing import (pack_micro_batch, packing_attention, pad_micro_batch, plan_micro_batches,
                                shared_prefixes, use_segment_attention)

    dev = torch.device(ctx.device)
    model, tok, info = load_model_and_tokenizer(ctx.model, device=ctx.device)
    model.train()
    use_segment_attention(model)  # as the trainer does; padded batches (2D masks) still run plain sdpa
    attention = packing_attention(model)
    rng = np.random.default_rng(ctx.seed)
    if ctx.device == "cuda":
        n, prompt, per_turn, turns, budget, micro = 32, 300, 500, 5, 16384, 4
    elif ctx.quick:
        n, prompt, per_turn, turns, budget, micro = 4, 32, 24, 2, 512, 4
    else:  # FrozenLake-like at the CPU preset; one env group in the full 10-minute run
        n, prompt, per_turn, turns, budget, micro = 4 if "e2e" in ctx.parts else 8, 250, 130, 3, 2048, 4
    lengths = _lengths(n, rng, prompt, per_turn, turns)
    vocab = model.get_input_embeddings().weight.shape[0]
    group = 4  # trajectories per env group: they share the prompt's tokens
    ids = []
    for i, L in enumerate(lengths):
        x = torch.randint(0, min(vocab, 49152), (L,), generator=torch.Generator().manual_seed(i))
        x[:prompt] = torch.randint(0, min(vocab, 49152), (prompt,), generator=torch.Generator().manual_seed(10**6 + i // group))
        ids.append(x)
    masks = []
    for L in lengths:
        m = torch.zeros(L, dtype=torch.bool)
        m[prompt:] = True  # responses and observations interleave; train on everything after the prompt
        masks.append(m)
    real_tokens = sum(lengths)
    n_tok = sum(int(m[1:].sum()) for m in masks)
    prefix, groups = shared_prefixes(ids, masks) if attention == "segments" else (None, None)
    weight = lm_head_weight(model)
    body = decoder_body(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if ctx.device == "cuda" else torch.autocast("cpu", enabled=False)

    computed: list[int] = []

    def packed():
        model.zero_grad(set_to_none=True)
        computed.clear()
        for mb in plan_micro_batches(lengths, budget, prefix, groups):
            pb = pack_micro_batch(ids, mb, device=dev, attention=attention, prefix_lengths=prefix, prefix_groups=groups,
                                  mask_dtype=torch.bfloat16 if ctx.device == "cuda" else torch.float32)
            sc = pb.scored(masks)
            computed.append(pb.num_tokens)
            with autocast:
                h = body(**pb.model_inputs(), use_cache=False).last_hidden_state[0]
                z = torch.zeros(sc.count, device=dev)
                out = linear_policy_loss(h[sc.rows], weight, sc.targets, z - 1.0, z + 0.5,
                                         torch.ones_like(z, dtype=torch.bool),
                                         clip_low=0.2, clip_high=0.28, entropy_coef=0.001, denominator=float(n_tok))
            out.loss.backward()

    def padded():
        model.zero_grad(set_to_none=True)
        for s in range(0, n, micro):
            sel = list(range(s, min(n, s + micro)))
            x, att = pad_micro_batch(ids, sel, pad_id=0, device=dev)
            lm = torch.zeros_like(x, dtype=torch.bool)
            for j, i in enumerate(sel):
                lm[j, : lengths[i]] = masks[i].to(dev)
            with autocast:
                out = causal_lm_policy_loss(model, x, torch.full(x.shape, -1.0, device=dev),
                                            torch.full(x.shape, 0.5, device=dev), lm, attention_mask=att,
                                            clip_low=0.2, clip_high=0.28, entropy_coef=0.001,
                                            denominator=float(n_tok))
            out.loss.backward()

    if ctx.device == "cuda":
        sync = torch.cuda.synchronize
        tp, sp = measure(packed, repeats=ctx.repeats, warmup=1, sync=sync)
        tb, sb = measure(padded, repeats=ctx.repeats, warmup=1, sync=sync)
        mp, _ = peak_memory(packed, ctx.device)  # after the warm-ups: no one-time workspaces counted
        mb_, _ = peak_memory(padded, ctx.device)
    else:  # the (exact) memory passes double as the warm-ups: a pass is tens of seconds here
        mp, _ = peak_memory(packed, ctx.device)
        mb_, _ = peak_memory(padded, ctx.device)
        tp, sp = measure(packed, repeats=min(ctx.repeats, 2), warmup=0)
        tb, sb = measure(padded, repeats=min(ctx.repeats, 2), warmup=0)
    padded_tokens = sum(max(lengths[i] for i in range(s, min(n, s + micro))) * len(range(s, min(n, s + micro)))
                        for s in range(0, n, micro))
    note = (f"{info.label}; {n} trajectories in env groups of {group}, {real_tokens} trajectory tokens; padded "
            f"computes {padded_tokens} (micro-batch {micro}); packed computes {sum(computed)} (budget {budget} "
            f"tokens, {attention} attention{', shared prompts' if prefix else ''})")
    return [
        Record("train", "policy fwd+bwd, packed micro-batches", "tokens/s", real_tokens / tp, real_tokens / tb, True,
               fastpo_spread=real_tokens * sp / tp**2, baseline_spread=real_tokens * sb / tb**2,
               baseline_name="padded micro-batches", notes=note),
        Record("train", "policy fwd+bwd peak memory, packed", "MiB", mp / 2**20, mb_ / 2**20, False,
               baseline_name="padded micro-batches", notes=note),
    ]


def _iteration(ctx: BenchContext) -> list[Record]:
    from rich.console import Console

    import limits
    from fastpo.config import load_config
    from fastpo.trainer import Trainer

    if ctx.device == "cuda":
        preset, env = "paper", "frozenlake"
        ov = [f"model.name={ctx.model}", "trainer.iterations=2", "trainer.eval_every=0", "trainer.save_every=0",
              "trainer.plots=false", "trainer.progress=false"]
    elif ctx.quick:
        preset, env = "tiny", "frozenlake"
        ov = [f"model.name={ctx.model}", "trainer.iterations=1", "trainer.eval_every=0", "trainer.save_every=0",
              "trainer.plots=false", "trainer.progress=false"]
    else:
        preset, env = "cpu", "frozenlake"
        ov = [f"model.name={ctx.model}", "trainer.iterations=1", "trainer.eval_every=0", "trainer.save_every=0",
              "trainer.plots=false", "trainer.progress=false"]
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(env=env, preset=preset, overrides=ov + [f"trainer.output_dir={d}", f"trainer.device={ctx.device}"])
        tr = Trainer(cfg, console=Console(quiet=True))
        tr.setup()
        spy = limits.UpdateSpy(tr)
        recs, lim = [], []
        last = None
        for it in range(1, cfg.trainer.iterations + 1):
            last = tr.iteration(it)
        tr.logger.close()
        if ctx.device == "cpu":  # on CUDA the e2e part measures them (the GPU check's time budget)
            lim = limits.limit_records(tr, spy, float(last["time/update_s"]), ctx.device, f"{preset} preset, {tr.parts.models.info.label}")
            lim = [dataclasses.replace(r, part="train") for r in lim]
    total = sum(v for k, v in last.items() if k.startswith("time/") and k.endswith("_s"))
    label = f"{preset} preset, {env}, {cfg.rollout.env_groups}x{cfg.rollout.group_size} trajectories, " \
            f"{cfg.rollout.max_turns} turns, {cfg.rollout.max_new_tokens} new tokens/turn, {tr.parts.models.info.label}"
    recs.append(Record("train", f"seconds per iteration ({preset} preset)", "s", total, None, False, notes=label))
    for k in ("time/rollout_s", "time/old_logprob_s", "time/advantage_s", "time/update_s"):
        recs.append(Record("train", f"  phase {k[5:-2]}", "s", float(last[k]), None, False, notes=label))
    for k in ("perf/rollout_tokens_per_s", "perf/train_tokens_per_s"):
        recs.append(Record("train", f"  {k[5:]}", "tokens/s", float(last[k]), None, True, notes=label))
    return recs + lim


def run(ctx: BenchContext) -> list[Record]:
    """Packed vs padded micro-batches, then seconds per iteration split by phase (left to the
    e2e part, which reports fastpo's iteration by phase at the same preset, when it runs too)."""
    return _packed_vs_padded(ctx) + ([] if "e2e" in ctx.parts else _iteration(ctx))


if __name__ == "__main__":
    ctx = BenchContext(quick="--quick" in sys.argv, device="cuda" if "--cuda" in sys.argv else "cpu")
    for r in run(ctx):
        print(r)
