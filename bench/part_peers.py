"""Peers benchmark: fastpo against what a user would pick instead, side by side in one run.

    python bench/throughput.py --part peers [--quick] [--device cuda --model random:qwen2.5-0.5b]

Needs the `bench` extra (`pip install -e ".[bench]"`, `make bench`): trl==1.16.0,
liger-kernel==0.8.5 and cut-cross-entropy==25.1.1. A missing one is skipped with a one-line
reason (the whole part when all are missing).

1. TRL's `GRPOTrainer`, Bandit (single turn), at equal work. Both sides start from the same
   weights (fastpo's cached HF folder of the embedded model; any other model is saved to a
   temporary folder first), train on the same prompts (fastpo's rendered Bandit prompts of
   the iteration's env seeds, in order: TRL's dataset is not shuffled), draw the same number
   of completions per prompt at the same temperature and top-p, get the env's reward
   (fastpo's Bandit parses TRL's completions), and make one optimizer step per iteration
   over the whole batch (one PPO epoch, one mini-batch, AdamW with the same lr, betas,
   weight decay, grad clip): GRPO with token-mean loss aggregation (TRL's "dapo", which
   normalizes by the mini-batch's tokens), clip 0.2 / 0.28 (clip-higher), entropy
   coefficient 0.001, no KL, no dual clip. Every completion is exactly `max new tokens`
   long on both sides (end-of-turn tokens and stop strings off: TRL's `min_new_tokens`,
   fastpo's stop ids cleared), so the token counts are equal by construction, and
   `check_equal_work` fails the part loudly where they are not. TRL's defaults that would
   change the work are set to fastpo's: fp32 (bf16=False) and no gradient checkpointing.
   Timed: one warm-up iteration per side, then iterations alternating TRL, fastpo (a TRL
   callback runs fastpo's iteration after each TRL step); reported: seconds per iteration,
   generated tokens/s (rollout phase), trained tokens/s (trajectory tokens over the rest of
   the iteration), peak memory (VmHWM above the start of the iteration).
2. TRL, FrozenLake (multi-turn). TRL's own multi-turn path, `environment_factory`, plays
   through the chat template's tool calls: the environment's methods become tools the model
   must call in the template's tool-call syntax, its reply enters as a tool message, and a
   rollout ends at the first turn without a tool call. SmolLM2's template has no tool
   support, and StarPO's protocol (an `<answer>Left || Up</answer>` parsed by the game, the
   next observation as a user message, a format penalty for a malformed answer) is not a
   tool call, so TRL cannot do this work with it. The closest equal-work setting is TRL's
   `rollout_func`: the trainer, loss and update are TRL's, the multi-turn loop is user code
   (written here as a TRL user would: `model.generate` over the whole history every turn,
   fastpo's prompts and between-turn tokens, `env_mask` = 0 on observation tokens). Both
   sides play a 4x4 map without holes whose goal is farther than the action budget, so
   every trajectory takes every turn, and generate exactly `max new tokens` per turn: the
   trajectory, turn, generated-token and update counts are equal by construction and
   checked exactly; the observation tokens follow each side's own samples (the text of a
   state and of a reward differs by a token or two), so the trajectory-token counts are
   checked to within 5%.
3. Liger-Kernel's `LigerFusedLinearGRPOLoss` (eager and torch.compile'd) against fastpo's
   fused `linear_policy_loss` at the kernel part's shape (CPU: N=2048 tokens in 4 sequences,
   H=576, V=49152, fp32; --quick N=512; CUDA: N=4096 and 16384 in sequences of 512, H=896,
   V=151936, bf16), the same loss on both sides (Liger's "bnpo" = token mean over the batch,
   clip 0.2 / 0.28, no KL, per-sequence advantages; fastpo with entropy_coef=0 and no dual
   clip). First the loss and both gradients are compared (max differences in the notes; a
   difference above 1e-3 relative fails the comparison), then fwd+bwd time (runs alternating
   between the methods) and peak memory beyond inputs and gradients.
4. Apple's Cut Cross-Entropy (`linear_cross_entropy`, arXiv 2411.09009) in the same run and on
   the same inputs as 3.: per-token log-probs = -linear_cross_entropy(hidden, W, targets,
   reduction="none"), the same PPO/GRPO loss on them by autograd (`policy_loss_terms`,
   token-mean, entropy off), forward and backward; on the CPU `impl="torch_compile"` (the
   full [N, V] logits under torch.compile: fast, not memory-saving), on CUDA `impl="cce"`
   (its Triton kernels) with `filter_eps=None` (its default skips small gradient entries,
   which would fail the gradient check). Same numerics check, then time and peak memory.
5. The bare matmuls the fused loss cannot avoid (3 on the CPU's chunked path: logits,
   d hidden, d W, 6 N H V FLOPs; 4 on CUDA with the backward's recompute, 8 N H V), timed
   in the same alternation: every method's time as a multiple of them (target for fastpo:
   at most 1.15x) and its FLOP/s (the bare matmuls' FLOP count over its time) as a fraction
   of the machine's measured matmul FLOP/s (a square fp32 / bf16 matmul of 2048 / 8192).

Sizes: `--part peers` on the CPU: Bandit 2 env groups x 4 completions x 32 new tokens;
FrozenLake 1 x 4, 2 turns x 24 new tokens. The full run (10 minutes for every part): Bandit
1 x 4 x 32 only. --quick: Bandit 1 x 2 x 8 tokens only, Liger at N=512.
The full run times 1 iteration per side after the warm-up, `--part peers` 2 (median and
spread). On CUDA only the Liger comparison runs (TRL is compared on the CPU).
"""
from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, PartSkipped, Record, measure, peak_memory  # noqa: E402

PART = "peers"
TRL_VERSION = "1.16.0"
LIGER_VERSION = "0.8.5"
CCE_VERSION = "25.1.1"
CLIP_LOW, CLIP_HIGH, ENTROPY_COEF = 0.2, 0.28, 0.001
# a 4x4 FrozenLake map with no holes whose goal (6 moves away) the action budget cannot reach
NO_END_MAP = ["SFFF", "FFFF", "FFFF", "FFFG"]


# ----------------------------------------------------------------------------------- equal work
class EqualWorkError(AssertionError):
    """The two sides of a comparison did not do the same work; its message names every difference."""


#: What "the same work" counts, per iteration: trajectories (completions), turns taken, prompt
#: tokens, generated (model) tokens, trajectory tokens (prompt + everything after it: what
#: the update computes on), optimizer steps.
WORK_KEYS = ("trajectories", "turns", "prompt_tokens", "generated_tokens", "trajectory_tokens", "updates")


def check_equal_work(fastpo: dict, peer: dict, peer_name: str, tolerance: dict | None = None) -> None:
    """Raise EqualWorkError unless `fastpo` and `peer` (dicts over WORK_KEYS, ints) match.

    Every key in WORK_KEYS must be present on both sides. `tolerance` maps a key to the
    relative difference allowed for it (default: none, equality). The message lists every
    key that differs with both values, so a mismatch is never silent.
    """
    tolerance = tolerance or {}
    bad = []
    for key in WORK_KEYS:
        if key not in fastpo or key not in peer:
            bad.append(f"{key}: missing ({'fastpo' if key not in fastpo else peer_name})")
            continue
        a, b = fastpo[key], peer[key]
        tol = tolerance.get(key, 0.0)
        if (a != b) if tol == 0 else abs(a - b) > tol * max(abs(a), abs(b), 1):
            bad.append(f"{key}: fastpo {a} vs {peer_name} {b}" + (f" (allowed {tol:.0%})" if tol else ""))
    if bad:
        raise EqualWorkError(f"fastpo and {peer_name} did not do the same work: " + "; ".join(bad))


def fastpo_work(batch, updates: int) -> dict:
    """WORK_KEYS of one fastpo iteration from its (unfiltered) TrajectoryBatch and update count."""
    first = [int(torch.as_tensor(m).float().argmax()) for m in batch.loss_mask]  # the first model token
    return {"trajectories": len(batch.input_ids), "turns": int(batch.num_turns.sum()),
            "prompt_tokens": sum(first), "generated_tokens": sum(int(torch.as_tensor(m).sum()) for m in batch.loss_mask),
            "trajectory_tokens": sum(len(x) for x in batch.input_ids), "updates": int(updates)}


def trl_work(inputs: dict, turns: int, updates: int) -> dict:
    """WORK_KEYS of one TRL iteration from `GRPOTrainer._generate_and_score_completions`' output."""
    pm, cm = inputs["prompt_mask"], inputs["completion_mask"]
    model_tokens = cm * inputs["tool_mask"] if "tool_mask" in inputs else cm
    return {"trajectories": int(pm.shape[0]), "turns": int(turns), "prompt_tokens": int(pm.sum()),
            "generated_tokens": int(model_tokens.sum()), "trajectory_tokens": int(pm.sum() + cm.sum()),
            "updates": int(updates)}


# ------------------------------------------------------------------------------------------ TRL
@dataclasses.dataclass
class Sizes:
    env: str
    groups: int
    group_size: int
    new_tokens: int
    turns: int = 1


def _sizes(ctx: BenchContext) -> list[Sizes]:
    if ctx.quick:  # a smoke test under 2 minutes (the FrozenLake path has its own test)
        return [Sizes("bandit", 1, 2, 8)]
    if len(ctx.parts) > 1:  # the full run: what fits in its 10 minutes
        return [Sizes("bandit", 1, 4, 32)]
    return [Sizes("bandit", 2, 4, 32), Sizes("frozenlake", 1, 4, 24, turns=2)]


def _fastpo_trainer(ctx: BenchContext, s: Sizes, out: str):
    from rich.console import Console

    from fastpo.config import load_config
    from fastpo.trainer import Trainer

    ov = [f"model.name={ctx.model}", f"trainer.seed={ctx.seed}", "trainer.eval_every=0", "trainer.save_every=0",
          "trainer.plots=false", "trainer.progress=false", "trainer.device=cpu", f"trainer.output_dir={out}",
          f"rollout.env_groups={s.groups}", f"rollout.group_size={s.group_size}",
          f"rollout.max_new_tokens={s.new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
          "rollout.top_k=0", "algorithm.adv_estimator=grpo", "algorithm.filter_mode=none",
          "algorithm.loss_agg=token-mean", "algorithm.dual_clip=null", f"algorithm.clip_low={CLIP_LOW}",
          f"algorithm.clip_high={CLIP_HIGH}", f"algorithm.entropy_coef={ENTROPY_COEF}", "algorithm.kl_coef=0",
          "optim.ppo_epochs=1", f"optim.mini_batch_size={s.groups * s.group_size}"]
    if s.env == "frozenlake":
        ov += [f"rollout.max_turns={s.turns}", "rollout.max_actions_per_turn=2", f"rollout.max_actions_per_traj={2 * s.turns}",
               "env.options={desc: [" + ", ".join(NO_END_MAP) + "]}"]
    cfg = load_config(env=s.env, preset="cpu", overrides=ov)
    tr = Trainer(cfg, console=Console(quiet=True))
    tr.setup()
    orig = tr.parts.sampler.rollout.sampling_params

    def no_stop(temperature=None):  # every turn exactly max_new_tokens long (TRL: min_new_tokens)
        return dataclasses.replace(orig(temperature), stop_token_ids=(), stop_strings=())

    tr.parts.sampler.rollout.sampling_params = no_stop
    return tr


def _prompt_ids(rollout, seed: int) -> list:
    """fastpo's first-turn prompt (token ids) of one env seed, as MultiTurnRollout renders it
    (its own first message: with `rollout.prompt_examples`, the closing question too)."""
    from fastpo.rollout.multiturn import _close

    env = rollout.make_env(1)
    try:
        obs = env.reset(np.asarray([seed], dtype=np.int64))
        return rollout.chat.prompt_ids(rollout._first_messages(env, obs)[0])
    finally:
        _close(env)


def _model_folder(ctx: BenchContext, tr, tmp: str) -> str:
    """An HF folder holding the weights fastpo's trainer starts from."""
    from fastpo.model_loading import DEFAULT_MODEL, embedded_model_dir

    if ctx.model == DEFAULT_MODEL:
        return embedded_model_dir()
    folder = os.path.join(tmp, "model")
    tr.model.save_pretrained(folder)
    tr.tokenizer.save_pretrained(folder)
    return folder


class _TrlRollout:
    """TRL `rollout_func` for multi-turn FrozenLake (user code, see the module doc): per turn
    `model.generate` over each trajectory's whole history (prompt + turns so far, left-padded),
    exactly `new_tokens` new tokens, fastpo's game rules and between-turn tokens."""

    def __init__(self, fastpo_rollout, new_tokens: int):
        self.ro = fastpo_rollout
        self.new_tokens = new_tokens
        self.turns = 0

    def __call__(self, prompts: list, trainer) -> dict:
        from fastpo.envs_native import make_native_env
        from fastpo.rollout.turns import end_reason, env_turn
        from fastpo.rollout.prompts import next_user_message

        ro, cfg, tok = self.ro, self.ro.cfg, self.ro.tokenizer
        n = trainer.num_generations
        # the dataloader repeats each prompt n times; one env group per distinct prompt
        rows = list(prompts)
        seeds = [trainer._seed_of[p] for p in rows]
        B = len(rows)
        env = make_native_env(ro.env_name, B, **ro.env_config)
        obs = env.reset(np.asarray(seeds, dtype=np.int64))
        prompt_ids = [_prompt_ids(ro, s) for s in seeds]
        completion = [[] for _ in range(B)]
        env_mask = [[] for _ in range(B)]
        rewards = np.zeros(B, dtype=np.float32)
        actions_left = np.full(B, cfg.max_actions_per_traj, dtype=np.int64)
        active = list(range(B))
        model = trainer.model
        pad = tok.pad_token_id
        dev = next(model.parameters()).device
        for turn in range(cfg.max_turns):
            if not active:
                break
            hist = [prompt_ids[b] + completion[b] for b in active]
            L = max(len(h) for h in hist)
            ids = torch.full((len(active), L), pad, dtype=torch.long)
            att = torch.zeros((len(active), L), dtype=torch.long)
            for i, h in enumerate(hist):
                ids[i, L - len(h):] = torch.tensor(h)
                att[i, L - len(h):] = 1
            with torch.no_grad():
                out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), do_sample=True,
                                     temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                                     max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, pad_token_id=pad)
            new = out[:, L:].cpu().tolist()
            texts = [None] * B
            for i, b in enumerate(active):
                completion[b] += new[i]
                env_mask[b] += [1] * len(new[i])
                texts[b] = ro._response_text(new[i])[0]
            res = env_turn(env, cfg, texts, actions_left)
            rewards += res.reward
            self.turns += len(active)
            obs = env.render()
            nxt = []
            for b in active:
                if end_reason(res, b, actions_left, turn, cfg.max_turns):
                    continue
                msg = next_user_message(turn + 2, float(res.reward[b]), obs[b], int(actions_left[b]), cfg.think,
                                        cfg.max_new_tokens, note=res.notes[b])
                between = ro.chat.between_turn_ids(msg, bool(new[active.index(b)]) and
                                                   new[active.index(b)][-1] == ro.chat.template_eot_id)
                completion[b] += between
                env_mask[b] += [0] * len(between)
                nxt.append(b)
            active = nxt
        assert B % n == 0
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "logprobs": None, "env_mask": env_mask,
                "env_reward": [float(r) for r in rewards]}


def _trl_trainer(ctx: BenchContext, s: Sizes, fastpo_tr, folder: str, out: str, seeds: list[int], steps: int):
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from fastpo.envs_native import make_native_env
    from fastpo.rollout.turns import env_turn

    ro = fastpo_tr.parts.sampler.rollout
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.decode(_prompt_ids(ro, sd)) for sd in seeds]
    rows = [{"prompt": t, "seed": sd} for t, sd in zip(texts, seeds)]
    o = fastpo_tr.cfg.optim
    args = GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False, seed=ctx.seed,
        per_device_train_batch_size=s.groups * s.group_size, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=s.group_size, num_iterations=1, max_steps=steps, shuffle_dataset=False,
        max_completion_length=s.new_tokens * s.turns + (4096 if s.turns > 1 else 0), temperature=1.0, top_p=1.0,
        top_k=0, generation_kwargs={"min_new_tokens": s.new_tokens},
        learning_rate=o.actor_lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=o.weight_decay,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], max_grad_norm=o.grad_clip, optim="adamw_torch",
        beta=0.0, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, loss_type="dapo", scale_rewards="group",
        entropy_coef=ENTROPY_COEF, mask_truncated_completions=False,
        logging_steps=10**6, save_strategy="no", report_to="none", disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32})
    rollout_func = None
    if s.turns == 1:
        env_opts, rcfg = dict(ro.env_config), ro.cfg

        def env_reward(prompts, completions, completion_ids, seed, **kw):
            env = make_native_env(ro.env_name, len(seed), **env_opts)
            env.reset(np.asarray(seed, dtype=np.int64))
            parsed = [ro._response_text(list(ids))[0] for ids in completion_ids]
            res = env_turn(env, rcfg, parsed, np.full(len(seed), rcfg.max_actions_per_traj, dtype=np.int64))
            return [float(r) for r in res.reward]
    else:
        rollout_func = _TrlRollout(ro, s.new_tokens)

        def env_reward(prompts, completions, env_reward, **kw):
            return list(env_reward)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = GRPOTrainer(model=folder, reward_funcs=env_reward, args=args, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list(rows), rollout_func=rollout_func)
    trainer._seed_of = dict(zip(texts, seeds))
    return trainer, rollout_func


def _trl_vs_fastpo(ctx: BenchContext, s: Sizes) -> list[Record]:
    from transformers import TrainerCallback

    from fastpo.seeds import iteration_seeds

    warmup = 1
    timed = max(1, min(ctx.repeats, 2)) if len(ctx.parts) == 1 and not ctx.quick else 1
    steps = warmup + timed
    res = {side: {"s": [], "rollout": [], "mem": [], "work": []} for side in ("fastpo", "trl")}
    with tempfile.TemporaryDirectory() as tmp:
        tr = _fastpo_trainer(ctx, s, os.path.join(tmp, "fastpo"))
        folder = _model_folder(ctx, tr, tmp)
        seeds = [sd for it in range(1, steps + 1) for sd in iteration_seeds(ctx.seed, it, s.groups)]
        trainer, rollout_func = _trl_trainer(ctx, s, tr, folder, os.path.join(tmp, "trl"), seeds, steps)
        fastpo_batch = {}
        orig_generate = tr.parts.sampler.generate

        def keep_batch(*a, **kw):
            fastpo_batch["b"] = orig_generate(*a, **kw)
            return fastpo_batch["b"]

        tr.parts.sampler.generate = keep_batch
        trl = {"gen": 0.0, "inputs": None}
        orig_trl_gen, orig_score = trainer._generate, trainer._generate_and_score_completions

        def trl_gen(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig_trl_gen(*a, **kw)
            finally:
                trl["gen"] += time.perf_counter() - t0

        def trl_score(*a, **kw):
            trl["inputs"] = orig_score(*a, **kw)
            return trl["inputs"]

        trainer._generate, trainer._generate_and_score_completions = trl_gen, trl_score

        def fastpo_iteration(it):
            box = {}

            def one():
                t0 = time.perf_counter()
                box["m"] = tr.iteration(it)
                box["s"] = time.perf_counter() - t0

            mem, _ = peak_memory(one, "cpu")
            return box["s"], box["m"], mem

        class Alternate(TrainerCallback):
            """Times each TRL step and runs fastpo's iteration of the same index after it."""

            def on_step_begin(self, args, state, control, **kw):
                gc.collect()
                self.turns0 = rollout_func.turns if rollout_func else 0
                trl["gen"] = 0.0
                self.mem0 = _hwm_reset()
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                sec = time.perf_counter() - self.t0
                mem = _hwm_since(self.mem0)
                it = state.global_step
                turns = (rollout_func.turns - self.turns0) if rollout_func else int(trl["inputs"]["prompt_mask"].shape[0])
                trl_w = trl_work(trl["inputs"], turns, updates=1)
                print(f"peers: {s.env} TRL step {it}: {sec:.1f} s", file=sys.stderr, flush=True)
                fs, fm, fmem = fastpo_iteration(it)
                print(f"peers: {s.env} fastpo iteration {it}: {fs:.1f} s", file=sys.stderr, flush=True)
                fw = fastpo_work(fastpo_batch["b"], fm["actor/updates"])
                check_equal_work(fw, trl_w, "TRL", {"trajectory_tokens": 0.05} if s.turns > 1 else None)
                if it <= warmup:
                    return
                for side, (t, r, m, w) in (("trl", (sec, trl["gen"], mem, trl_w)),
                                           ("fastpo", (fs, fm["time/rollout_s"], fmem, fw))):
                    res[side]["s"].append(t)
                    res[side]["rollout"].append(r)
                    res[side]["mem"].append(m)
                    res[side]["work"].append(w)

        trainer.add_callback(Alternate())
        trainer.train()
        tr.logger.close()
        label = tr.parts.models.info.label
        del trainer, tr
        gc.collect()
    if len(res["trl"]["s"]) != timed or len(res["fastpo"]["s"]) != timed:
        raise RuntimeError(f"expected {timed} timed iterations per side, got TRL {len(res['trl']['s'])}, "
                           f"fastpo {len(res['fastpo']['s'])}")
    return _trl_records(s, res, label, warmup, timed)


def _hwm_reset() -> int:
    """Reset the resident-set high-water mark; returns the resident set now (KiB)."""
    from _common import _status_kib, _trim

    _trim()
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
        return _status_kib("VmRSS")
    except OSError:
        return -1


def _hwm_since(start_kib: int) -> float:
    from _common import _status_kib

    if start_kib < 0:
        return float("nan")
    return max(0, _status_kib("VmHWM") - start_kib) * 1024.0


def _trl_records(s: Sizes, res: dict, label: str, warmup: int, timed: int) -> list[Record]:
    def med(side, key):
        v = res[side][key]
        return statistics.median(v), max(v) - min(v)

    w = res["fastpo"]["work"][-1]
    traj = s.groups * s.group_size
    what = (f"{s.env}, {s.groups}x{s.group_size} completions, "
            + (f"{s.turns} turns x " if s.turns > 1 else "") + f"{s.new_tokens} new tokens"
            + (" per turn" if s.turns > 1 else "") + f", {label}, cpu fp32; GRPO token-mean, clip "
            f"{CLIP_LOW}/{CLIP_HIGH}, entropy {ENTROPY_COEF}, 1 update/iteration; {warmup} warm-up + {timed} timed "
            f"iteration(s) per side, alternating; equal work checked: {traj} trajectories, "
            f"{w['generated_tokens']} generated tokens, {w['trajectory_tokens']} trajectory tokens"
            + (" (fastpo's; TRL's within 5%)" if s.turns > 1 else "") + f", {w['updates']} update(s) per iteration")
    base = (f"TRL {TRL_VERSION} GRPOTrainer" + (" + rollout_func (model.generate per turn)" if s.turns > 1 else ""))
    env = "Bandit" if s.env == "bandit" else f"FrozenLake {s.turns} turns"
    target = 3.0 if s.env == "bandit" else None
    tf, sf = med("fastpo", "s")
    tb, sb = med("trl", "s")
    recs = [Record(PART, f"{env}: seconds per iteration", "s", tf, tb, False, sf, sb, base, target, what)]
    for side in ("fastpo", "trl"):
        ws = res[side]["work"]
        res[side]["gen_rate"] = [x["generated_tokens"] / r for x, r in zip(ws, res[side]["rollout"])]
        res[side]["train_rate"] = [x["trajectory_tokens"] / max(t - r, 1e-9)
                                   for x, t, r in zip(ws, res[side]["s"], res[side]["rollout"])]
    a, sa = med("fastpo", "gen_rate")
    b, sb_ = med("trl", "gen_rate")
    recs.append(Record(PART, f"{env}: generated tokens/s (rollout phase)", "tokens/s", a, b, True, sa, sb_, base,
                       notes="TRL: GRPOTrainer._generate (generation, decoding" + (", env" if s.turns > 1 else "")
                       + "); fastpo: the rollout phase"))
    a, sa = med("fastpo", "train_rate")
    b, sb_ = med("trl", "train_rate")
    recs.append(Record(PART, f"{env}: trained tokens/s (rest of the iteration)", "tokens/s", a, b, True, sa, sb_, base,
                       notes="trajectory tokens (prompt + completion, no padding) over the iteration minus its "
                             "rollout phase (rewards, advantages, old log-probs, forward + backward, optimizer step)"))
    mf = statistics.median(res["fastpo"]["mem"]) / 2**20
    mb = statistics.median(res["trl"]["mem"]) / 2**20
    rec = Record(PART, f"{env}: peak memory per iteration", "MiB", max(mf, 1e-3), mb, False, baseline_name=base,
                 notes="resident-set high-water mark (VmHWM) above the start of the iteration")
    recs.append(rec)
    return recs


# ---------------------------------------------------------------------------------------- Liger
def _liger_inputs(n, seq, h, v, dtype, device, seed):
    from fastpo.kernels import linear_logprob_entropy

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) * h ** -0.5).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    b = n // seq
    mask = (torch.rand(n, generator=g) > 0.1).to(device)
    adv_seq = torch.randn(b, generator=g).to(device)
    with torch.no_grad():  # old log-probs near the current ones, so that some ratios are clipped
        lp, _ = linear_logprob_entropy(hidden, weight, targets)
    old = (lp.float().cpu() + 0.3 * torch.randn(n, generator=g)).to(device)
    return hidden, weight, targets, old, adv_seq, mask


def _liger_methods(data, seq, device, compiled_too=True, liger=True, cce=False):
    """name -> fn(hidden, weight) -> loss: fastpo's fused loss first, then Liger's (eager and
    compiled) where `liger`, Cut Cross-Entropy's where `cce` (see `_cce_fn`)."""
    from fastpo.kernels import linear_policy_loss

    hidden, weight, targets, old, adv_seq, mask = data
    n = hidden.shape[0]
    b = n // seq
    adv_tok = adv_seq.repeat_interleave(seq)
    impl = "triton" if device == "cuda" else "chunked"
    methods = {f"fastpo-{impl}": lambda hh, ww: linear_policy_loss(
        hh, ww, targets, old, adv_tok, mask, clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=None, entropy_coef=0.0,
        loss_agg="token-mean", impl=impl).loss}
    if cce:
        name, fn = _cce_fn(targets, old, adv_tok, mask, device)
        methods[name] = fn
    if not liger:
        return impl, methods
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    for compiled in ((False, True) if compiled_too else (False,)):
        mod = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=CLIP_LOW, epsilon_high=CLIP_HIGH,
                                       loss_type="bnpo", compiled=compiled)

        def fn(hh, ww, mod=mod):
            out = mod(hh.view(b, seq, -1), ww, targets.view(b, seq), mask.view(b, seq).long(), adv_seq,
                      old_per_token_logps=old.view(b, seq))
            return out[0] if isinstance(out, tuple) else out

        methods[f"liger-{'compiled' if compiled else 'eager'}"] = fn
    return impl, methods


def cce_impl(device: str) -> str:
    """Cut Cross-Entropy's implementation for `device`: its Triton kernels on CUDA, else the
    torch.compile'd dense path (the only one that runs on a CPU)."""
    return "cce" if str(device).startswith("cuda") else "torch_compile"


def _cce_fn(targets, old, adv_tok, mask, device):
    """("cce-<impl>", fn(hidden, weight) -> loss): log-probs = -CCE's per-token cross-entropy,
    then the same clipped loss (token-mean over the mask, entropy off) by autograd."""
    from cut_cross_entropy import linear_cross_entropy

    from fastpo.kernels import policy_loss_terms

    impl = cce_impl(device)
    extra = {"filter_eps": None} if impl == "cce" else {}  # its default filter skips small gradients
    sel = mask > 0
    count = sel.sum().clamp(min=1)

    def fn(hh, ww):
        lp = -linear_cross_entropy(hh, ww, targets, reduction="none", impl=impl, **extra).float()
        terms = policy_loss_terms(lp, torch.zeros_like(lp), old, adv_tok, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
        return torch.where(sel, terms["loss"], 0.0).sum() / count

    return f"cce-{impl}", fn


def _fwd_bwd(fn, hidden, weight):
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    loss = fn(h, w)
    loss.backward()
    return loss.detach().float(), h.grad, w.grad


def numerics(results: dict, ref: str, rel_tol: float = 1e-3) -> dict:
    """Max differences of every method's (loss, d hidden, d weight) to `ref`'s.

    results: name -> (loss, grad_hidden, grad_weight). Returns name -> dict(loss, d_hidden,
    d_weight: max |difference|; rel: the largest of them over the reference's max |value|;
    ok: rel <= rel_tol).
    """
    r_loss, r_h, r_w = results[ref]
    out = {}
    for name, (loss, gh, gw) in results.items():
        if name == ref:
            continue
        d = {"loss": float((loss - r_loss).abs()), "d_hidden": float((gh.float() - r_h.float()).abs().max()),
             "d_weight": float((gw.float() - r_w.float()).abs().max())}
        scale = {"loss": float(r_loss.abs()), "d_hidden": float(r_h.float().abs().max()),
                 "d_weight": float(r_w.float().abs().max())}
        d["rel"] = max(d[k] / max(scale[k], 1e-30) for k in scale)
        d["ok"] = d["rel"] <= rel_tol
        out[name] = d
    return out


def _peer_label(name: str) -> str:
    if name.startswith("cce-"):
        return f"Cut Cross-Entropy {CCE_VERSION} {name}"
    return f"Liger {LIGER_VERSION} {name}"


def _fused(ctx: BenchContext, liger: bool = True, cce: bool = False) -> list[Record]:
    """fastpo's fused loss against Liger's and/or Cut Cross-Entropy's at equal loss (see the
    module doc, 3.-5.): numerics first (a peer that disagrees gets a failing record, no
    time), then time and peak memory, methods and the bare matmuls alternating."""
    import part_kernels

    cuda = ctx.device.startswith("cuda")
    if cuda:
        h, v, dtype, seq = 896, 151936, torch.bfloat16, 512
        ns = [4096] if ctx.quick else [4096, 16384]
        sync = torch.cuda.synchronize
    else:
        h, v, dtype, seq = 576, 49152, torch.float32, (128 if ctx.quick else 512)
        ns = [512 if ctx.quick else 2048]
        sync = None
    repeats = ctx.repeats if (len(ctx.parts) == 1 or cuda) else 1
    records = []
    for n in ns:
        shape = f"N={n} ({n // seq} x {seq}) H={h} V={v} {'bf16' if cuda else 'fp32'}"
        data = _liger_inputs(n, seq, h, v, dtype, ctx.device, ctx.seed)
        impl, methods = _liger_methods(data, seq, ctx.device, liger=liger, cce=cce)
        fast = f"fastpo-{impl}"
        # 1. numerics (this first call of every method is also its warm-up / compilation)
        results, failed = {}, {}
        for name, fn in methods.items():
            try:
                results[name] = _fwd_bwd(fn, data[0], data[1])
            except Exception as e:  # e.g. torch.compile without a C++ compiler: record it, keep going
                failed[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                print(f"part peers: {name} at {shape} failed: {failed[name]}", file=sys.stderr)
        if fast not in results:
            raise RuntimeError(f"{fast} failed at {shape}: {failed.get(fast)}")
        num = numerics(results, fast)
        for name, d in num.items():
            print(f"peers: {name} vs {fast} at {shape}: max |diff| loss {d['loss']:.3g}, d hidden {d['d_hidden']:.3g}, "
                  f"d weight {d['d_weight']:.3g} (relative {d['rel']:.3g})", file=sys.stderr, flush=True)
        results.clear()
        gc.collect()
        # 2. time and memory, methods (and the bare matmuls) alternating
        runs = {k: [] for k in methods if k not in failed}
        mems = {k: [] for k in runs}
        mm_run, mm_flops = part_kernels.bare_matmuls(n, h, v, dtype, ctx.device, ctx.seed)
        sq_run, sq_flops = part_kernels.square_matmul(ctx.device, dtype)
        n_mm = 4 if cuda else 3
        mm_run(), sq_run()  # warm-up
        mm_times, sq_times = [], []
        for _ in range(repeats):
            for name in runs:
                if cuda:
                    torch.cuda.empty_cache()
                box = {}

                def one(fn=methods[name]):
                    if sync:
                        sync()
                    t0 = time.perf_counter()
                    out = _fwd_bwd(fn, data[0], data[1])
                    if sync:
                        sync()
                    box["s"] = time.perf_counter() - t0
                    return out

                peak, (loss, gh, gw) = peak_memory(one, ctx.device)
                grads = gh.numel() * gh.element_size() + gw.numel() * gw.element_size()
                del loss, gh, gw
                runs[name].append(box["s"])
                mems[name].append(max(1, peak - grads))
            mm_times.append(measure(mm_run, repeats=1, warmup=0, sync=sync)[0])
            sq_times.append(measure(sq_run, repeats=1, warmup=0, sync=sync)[0])
        del mm_run, sq_run
        machine = sq_flops / min(sq_times)
        t_mm, s_mm = statistics.median(mm_times), max(mm_times) - min(mm_times)
        tf = statistics.median(runs[fast])
        sf = max(runs[fast]) - min(runs[fast])
        k_unit = ("ms", 1e3) if cuda else ("s", 1.0)
        for name in runs:
            tb = statistics.median(runs[name])
            ok = name == fast or num[name]["ok"]
            rec = part_kernels.limit_record(PART, shape, name, tb, t_mm, n_mm, mm_flops, machine,
                                            target=1 / 1.15 if name == fast else None,
                                            spreads=(max(runs[name]) - min(runs[name]), s_mm),
                                            notes=f"median of {repeats} run(s), alternating with the other methods"
                                            + ("" if ok else "; this method's numerics disagree with fastpo's"))
            records.append(rec)
        for name in methods:
            if name == fast:
                continue
            label = _peer_label(name)
            if name in failed:
                records.append(Record(PART, f"fused GRPO loss fwd+bwd ({shape}): {name} failed ({failed[name]})",
                                      "s", tf, None, False, baseline_name=label, met=False, notes=failed[name]))
                continue
            d = num[name]
            eq = (f"same loss (token-mean, clip {CLIP_LOW}/{CLIP_HIGH}, no KL/entropy): max |diff| loss "
                  f"{d['loss']:.2g}, d hidden {d['d_hidden']:.2g}, d weight {d['d_weight']:.2g} (relative {d['rel']:.2g})")
            if not d["ok"]:
                records.append(Record(PART, f"fused GRPO loss ({shape}): {name} disagrees with {fast}", "s", tf,
                                      None, False, baseline_name=label, met=False, notes=eq))
                continue
            tb = statistics.median(runs[name])
            sb = max(runs[name]) - min(runs[name])
            unit, k = k_unit
            # Liger: the earlier issue's 1.3x; every peer: fastpo at least as fast (this issue)
            target = 1.3 if name.startswith("liger") else 1.0
            records.append(Record(PART, f"fused GRPO loss fwd+bwd time ({shape}, {fast})", unit, tf * k, tb * k, False,
                                  sf * k, sb * k, label, target=target,
                                  notes=f"{eq}; median of {repeats} run(s), alternating between methods"))
            mf = statistics.median(mems[fast]) / 2**20
            mb = statistics.median(mems[name]) / 2**20
            records.append(Record(PART, f"fused GRPO loss peak memory ({shape}, {fast})", "MiB", mf, mb, False,
                                  baseline_name=label, target=1.0,
                                  notes=("torch.cuda.max_memory_allocated" if cuda else "VmHWM") + " above the start, "
                                  "minus the returned gradients; target: lower or equal"))
        del data, methods
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return records


# ------------------------------------------------------------------------------------------ run
def _missing(module: str, version: str) -> str | None:
    """None when `module` imports at `version`, else a one-line reason."""
    try:
        mod = __import__(module)
    except Exception as e:  # not installed: the bench extra is optional
        return f"{module} not importable ({type(e).__name__}: {e}); install the bench extra: make bench"
    got = getattr(mod, "__version__", None)
    if module == "liger_kernel" and got is None:
        from importlib.metadata import version as dist_version

        got = dist_version("liger-kernel")
    if got != version:
        return f"{module} {got} installed, the benchmark is pinned to {version} (make bench)"
    return None


def run(ctx: BenchContext) -> list[Record]:
    """Side-by-side records against TRL, Liger and Cut Cross-Entropy; raises PartSkipped when
    none is installed."""
    records: list[Record] = []
    skipped: dict[str, str] = {}
    no_liger = _missing("liger_kernel", LIGER_VERSION)
    no_cce = _missing("cut_cross_entropy", CCE_VERSION)
    if no_liger:
        skipped["Liger"] = no_liger
    if no_cce:
        skipped["Cut Cross-Entropy"] = no_cce
    if not (no_liger and no_cce):
        records += _fused(ctx, liger=not no_liger, cce=not no_cce)
    why = _missing("trl", TRL_VERSION)
    if ctx.device.startswith("cuda"):
        skipped["TRL"] = "TRL is compared on the CPU only"
    elif why:
        skipped["TRL"] = why
    else:
        for s in _sizes(ctx):
            records += _trl_vs_fastpo(ctx, s)
        if len(ctx.parts) > 1 or ctx.quick:
            skipped["TRL FrozenLake"] = ("not in --quick / the full run (its 10 minutes): "
                                         "python bench/throughput.py --part peers")
    for k, v in skipped.items():
        ctx.skipped[f"{PART}: {k}"] = v
        print(f"part {PART}: {k} skipped: {v}", file=sys.stderr, flush=True)
    if not records:
        raise PartSkipped("; ".join(f"{k}: {v}" for k, v in skipped.items()))
    return records


if __name__ == "__main__":
    for r in run(BenchContext(quick="--quick" in sys.argv, parts=(PART,))):
        print(r)
