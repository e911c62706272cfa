"""SFT benchmark: `fastpo sft`'s step against TRL's `SFTTrainer` on the same expert data,
side by side in one run (a row of `--part peers`).

    python bench/throughput.py --part peers [--quick]
    python bench/part_sft.py [--quick]          # this comparison alone

Needs trl==1.16.0 (the `bench` extra); without it the comparison is skipped with one line.

Equal work: both sides start from the same weights (the embedded model's HF folder, or the
--model's saved to a temporary folder), train on the same Sokoban expert trajectories of
fastpo's `expert_rollout` (the CPU preset's rendering: answer-only prompt with examples,
5 turns; `sizes` trajectories, seeds 0..), the same token ids and the same loss mask
(answer tokens only: TRL's `completion_mask` with completion_only_loss), one optimizer step
per iteration over all of them in one micro-batch (fastpo: optim.micro_token_budget set to
hold them all in one packed row; TRL: per_device_train_batch_size = the trajectory count,
gradient_accumulation_steps=1), the same loss (mean NLL over the answer tokens), AdamW with
the same lr, betas, weight decay and grad clip, fp32. What differs is how: fastpo packs the
trajectories into one padding-free row with per-trajectory attention and computes the
answer tokens' log-probs from the hidden states with its fused kernel (no [tokens x vocab]
logits); TRL pads them to the longest (its padding-free mode needs flash-attention, which
the CPU lacks) and computes the logits of every position.
Timed: one warm-up step per side, then steps alternating TRL, fastpo (a TRL callback runs
fastpo's step after each TRL step). Reported: seconds per step, trained tokens/s (the
trajectories' real tokens, padding not counted, over the step's seconds).
Sizes: 8 trajectories and 2 timed steps per side; --quick: 2 trajectories, 1 timed step. Not
run by `--part all` (skipped with one line).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, PartSkipped, Record  # noqa: E402

PART = "peers"
TRL_VERSION = "1.16.0"
LR = 1e-5


def _fastpo_sft(ctx: BenchContext, n: int, out: str):
    from rich.console import Console

    from fastpo.config import load_config
    from fastpo.sft.trainer import SFTTrainer

    ov = [f"model.name={ctx.model}", f"trainer.seed={ctx.seed}", "trainer.eval_every=0", "trainer.save_every=0",
          "trainer.plots=false", "trainer.progress=false", "trainer.device=cpu", f"trainer.output_dir={out}",
          f"optim.actor_lr={LR}", "optim.micro_token_budget=65536", f"sft.trajectories={n}", f"sft.batch_size={n}"]
    cfg = load_config(env="sokoban", preset="cpu", overrides=ov, sections=("sft",))
    tr = SFTTrainer(cfg, console=Console(quiet=True))
    tr.setup()
    return tr


def _trl_trainer(ctx: BenchContext, tr, folder: str, out: str, steps: int):
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig as TrlConfig
    from trl import SFTTrainer as TrlTrainer

    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = [{"input_ids": x.tolist(), "completion_mask": [int(v) for v in m.tolist()]}
            for x, m in zip(tr.ids, tr.masks)]
    o = tr.cfg.optim
    args = TrlConfig(
        output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False, seed=ctx.seed,
        per_device_train_batch_size=len(rows), gradient_accumulation_steps=1, max_steps=steps, max_length=None,
        completion_only_loss=True, packing=False, padding_free=False, learning_rate=o.actor_lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
        adam_beta2=o.betas[1], max_grad_norm=o.grad_clip, optim="adamw_torch", logging_steps=10**6,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_drop_last=False,
        model_init_kwargs={"dtype": torch.float32})
    return TrlTrainer(model=folder, args=args, processing_class=tok, train_dataset=datasets.Dataset.from_list(rows))


def compare(ctx: BenchContext) -> list[Record]:
    """Run the comparison; raises PartSkipped when trl is missing or of another version."""
    try:
        from importlib.metadata import version

        got = version("trl")
    except Exception:
        raise PartSkipped(f"trl not installed (pip install -e '.[bench]' for trl=={TRL_VERSION})") from None
    if got != TRL_VERSION:
        raise PartSkipped(f"trl {got} installed, the comparison is pinned to {TRL_VERSION}")
    from transformers import TrainerCallback

    n, timed = (2, 1) if ctx.quick else (8, 2)
    warmup = 1
    with tempfile.TemporaryDirectory(prefix="fastpo-bench-sft-") as tmp:
        tr = _fastpo_sft(ctx, n, os.path.join(tmp, "fastpo"))
        tokens = sum(int(x.numel()) for x in tr.ids)
        answer = sum(int(m.sum()) for m in tr.masks)
        from part_peers import _model_folder  # the same starting weights as the GRPO rows

        trl = _trl_trainer(ctx, tr, _model_folder(ctx, tr, tmp), os.path.join(tmp, "trl"), warmup + timed)
        times = {"fastpo": [], "trl": []}
        state = {"t0": 0.0, "it": 0}

        class Alternate(TrainerCallback):
            def on_step_begin(self, args, st, control, **kw):
                state["t0"] = time.perf_counter()

            def on_step_end(self, args, st, control, **kw):
                times["trl"].append(time.perf_counter() - state["t0"])
                state["it"] += 1
                t0 = time.perf_counter()
                m = tr.iteration(state["it"])
                times["fastpo"].append(time.perf_counter() - t0)
                if m["sft/answer_tokens"] != answer or m["sft/trajectories"] != n:
                    raise AssertionError(f"fastpo's step trained {m['sft/answer_tokens']} answer tokens of "
                                         f"{m['sft/trajectories']} trajectories, not {answer} of {n}")

        trl.add_callback(Alternate())
        trl.train()
        tr.release_lock()
    tf, tb = (statistics.median(times[k][warmup:]) for k in ("fastpo", "trl"))
    sf, sb = ((max(times[k][warmup:]) - min(times[k][warmup:])) for k in ("fastpo", "trl"))
    what = (f"Sokoban expert data (CPU preset rendering): {n} trajectories, {tokens} tokens of which {answer} answer "
            f"tokens, one step over all of them, fp32; {timed} timed steps per side after {warmup} warm-up, "
            f"alternating; TRL pads (no flash-attention on the CPU for its padding-free mode)")
    base = f"TRL {TRL_VERSION} SFTTrainer"
    return [Record(PART, "SFT (Sokoban experts): seconds per step", "s", tf, tb, False, sf, sb, base, None, what),
            Record(PART, "SFT (Sokoban experts): trained tokens/s", "tokens/s", tokens / tf, tokens / tb, True,
                   baseline_name=base, notes=what)]


def run(ctx: BenchContext) -> list[Record]:
    """The SFT row of `--part peers`; skipped in a run of every part (`--part all`, the CI's
    --quick run included) to keep that run's time, as the peers part's TRL FrozenLake row."""
    if len(ctx.parts) > 1:
        raise PartSkipped("not in a run of every part (its time): python bench/throughput.py --part peers")
    return compare(ctx)


if __name__ == "__main__":
    for r in run(BenchContext(quick="--quick" in sys.argv, parts=(PART,))):
        print(r)
