"""How fast the model learns the expert's move from one state: a cheap learning curve (issue 33).

    python experiments/imitation_curve.py [--env sokoban] [--lr 5e-5] [--steps 120] [--batch 16]
                                    [--levels 384] [--every 30] [--observation grid] [--json FILE]
                                    [KEY=VALUE ...]

Every expert turn of `--levels` expert trajectories (one move per answer, closed loop, 10
turns: what `fastpo sft --env sokoban` trains on) becomes one example: the turn's user text
(turn number, state, actions left, the closing question) and "<answer>", whose next token is
the expert's move. The instructions every example shares are a prefix computed once per step
without gradient (its keys and values reused for the batch), so an example costs its ~90
tokens; the loss is the cross-entropy of the move token alone. Every `--every` steps it prints
(and keeps in `--json`) the share of held-out expert turns (the first 64 eval seeds' expert
trajectories, states the training never saw) and of 256 training turns whose most likely next
token is the expert's move, and the mean NLL of that move (nats; ln 4 = 1.39 is a uniform
guess among four moves). KEY=VALUE: config overrides after the tool's own (e.g.
rollout.max_actions_per_turn=5 for the closing question of five moves per answer). Held-out
accuracy close to the training accuracy and still rising means the run is short of examples or
steps, not overfitting.

Not the SFT run itself: no history of earlier turns, the move token only, batches of turns
not of trajectories. It answers "does this setting learn the mapping, and how fast" in
minutes; `fastpo sft` measures the game.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import time

TURN = re.compile(r"(Turn \d+:\nState:\n.*?)<\|im_end\|>\n<\|im_start\|>assistant\n<answer>(\w+)</answer>", re.S)


def examples(tok, batch) -> tuple[str, list]:
    """(the shared instructions text, [(suffix token ids, move token id)]) of an expert batch."""
    prefix, out = None, []
    for ids in batch.input_ids:
        text = tok.decode(ids)
        prefix = prefix or text[:text.index("Turn 1:")]
        for m in TURN.finditer(text):
            suffix = m.group(1) + "<|im_end|>\n<|im_start|>assistant\n<answer>"
            out.append((tok(suffix, add_special_tokens=False).input_ids,
                        tok(m.group(2), add_special_tokens=False).input_ids[0]))
    return prefix, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="sokoban")
    ap.add_argument("--model", default=None, help="model.name (default: the embedded model)")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=16, help="turns per optimizer step")
    ap.add_argument("--levels", type=int, default=384, help="expert trajectories (seeds 0..levels-1)")
    ap.add_argument("--held-out", type=int, default=64, help="eval seeds whose expert turns are scored")
    ap.add_argument("--every", type=int, default=30)
    ap.add_argument("--observation", default="grid")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "levels", "held_out", "every"):
        if getattr(args, name) < 1:
            print(f"imitation_curve: --{name.replace('_', '-')} {getattr(args, name)}: must be >= 1", file=sys.stderr)
            return 2

    import torch
    import torch.nn.functional as F

    from fastpo.config.loading import load_config
    from fastpo.config.schema import eval_seeds
    from transformers import DynamicCache

    from fastpo.model_loading import load_model_and_tokenizer
    from fastpo.rollout.kv_cache import cache_kwarg
    from fastpo.sft.experts import expert_rollout

    torch.manual_seed(args.seed)
    # the context only cuts expert trajectories here (no generation): room for the longest format
    ov = ["rollout.max_turns=10", "rollout.max_actions_per_traj=10", "rollout.max_actions_per_turn=1",
          "rollout.max_context=4096", f"env.options.observation={args.observation}"]
    ov += ([f"model.name={args.model}"] if args.model else []) + args.overrides
    cfg = load_config(env=args.env, preset="cpu", overrides=ov)
    model, tok, _ = load_model_and_tokenizer(cfg.model.name)
    cache_kw = cache_kwarg(model)  # 'cache' on newer transformers, 'past_key_values' before
    rc = cfg.rollout.rollout_config()
    t0 = time.perf_counter()
    prefix, train = examples(tok, expert_rollout(tok, cfg.env.name, cfg.env.options, rc, list(range(args.levels)), 1))
    _, held = examples(tok, expert_rollout(tok, cfg.env.name, cfg.env.options, rc,
                                           eval_seeds(cfg)[:args.held_out], 1))
    pids = torch.tensor([tok(prefix, add_special_tokens=False).input_ids])
    rng = random.Random(args.seed)
    probe = rng.sample(train, min(256, len(train)))
    print(f"{args.env}: shared prefix {pids.shape[1]} tokens; {len(train)} training turns, {len(held)} held-out; "
          f"{sum(len(s) for s, _ in train) / len(train):.1f} tokens per turn", flush=True)

    def move_logits(batch, grad: bool):
        """[B, V] logits at each example's last token (the move's position)."""
        B, L = len(batch), max(len(s) for s, _ in batch)
        ids = torch.full((B, L), tok.pad_token_id)
        for i, (s, _) in enumerate(batch):
            ids[i, :len(s)] = torch.tensor(s)  # right padding: causal attention never reads it
        cache = DynamicCache()  # filled in place: no version-dependent output attribute to read
        with torch.no_grad():
            model(input_ids=pids, use_cache=True, **{cache_kw: cache})
        cache.batch_repeat_interleave(B)
        pos = torch.arange(pids.shape[1], pids.shape[1] + L)[None].expand(B, L)
        with torch.set_grad_enabled(grad):
            h = model.model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kw: cache}).last_hidden_state
            return model.lm_head(h[torch.arange(B), torch.tensor([len(s) - 1 for s, _ in batch])])

    def score(exs) -> tuple[float, float]:
        model.eval()
        hits, nll = 0, 0.0
        for i in range(0, len(exs), 32):
            lg, y = move_logits(exs[i:i + 32], False), torch.tensor([t for _, t in exs[i:i + 32]])
            hits += int((lg.argmax(-1) == y).sum())
            nll += float(F.cross_entropy(lg, y, reduction="sum"))
        return hits / len(exs), nll / len(exs)

    rows = []

    def report(step: int) -> None:
        (ha, hn), (ta, tn) = score(held), score(probe)
        rows.append({"step": step, "turns_seen": step * args.batch, "held_out_accuracy": ha, "held_out_nll": hn,
                     "train_accuracy": ta, "train_nll": tn, "seconds": time.perf_counter() - t0})
        print(json.dumps(rows[-1]), flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    order: list = []
    report(0)
    for step in range(1, args.steps + 1):
        if len(order) < args.batch:
            order += rng.sample(range(len(train)), len(train))  # epochs of shuffled turns
        batch = [train[order.pop()] for _ in range(args.batch)]
        model.train()
        loss = F.cross_entropy(move_logits(batch, True), torch.tensor([t for _, t in batch]))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.every == 0 or step == args.steps:
            report(step)
    if args.json:
        out = {"args": vars(args), "rows": rows, "training_turns": len(train), "held_out_turns": len(held),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores, threads {torch.get_num_threads()}",
               "load_average": os.getloadavg()}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
