"""The StarPO / StarPO-S training loop (RAGEN, arXiv 2504.20073, Alg. 1).

One iteration:

1. rollout: P env groups x N trajectories from seeds derived from (seed, iteration), with the
   native engine sharing the policy module (so step 6 needs no weight transfer);
2. filter: StarPO-S keeps the env groups with the highest in-group reward std;
3. old log-probs (and values, reference log-probs) recomputed by the trainer on packed
   micro-batches, the gap to the sampling log-probs logged (`train/logprob_gap_*`); or,
   where they are the same quantity (`algorithm.old_logprob`, fastpo.old_logprob), the
   sampler's own log-probs and entropies, with a shared critic's values read out in the
   sampling pass, and only what is still missing computed;
4. advantages: GAE over model tokens with the critic (PPO), group-baselined scores (GRPO,
   Dr.GRPO, RLOO, REINFORCE++-baseline) or batch-normalised returns (REINFORCE++);
   off-policy data (fastpo.replay): with `rollout.reuse` = K > 1 the next K - 1 iterations
   skip steps 1-4 and train again on this batch; `rollout.replay` mixes in trajectories of
   earlier batches (old log-probs recomputed); `algorithm.is_correction` weighs the
   sampler -> trainer gap (fastpo.algorithms.correction);
5. updates: `ppo_epochs` passes over shuffled mini-batches of trajectories, each split into
   token-budget micro-batches with gradient accumulation, fused policy loss from
   `fastpo.kernels`, clipped value loss, gradient clipping; a non-finite loss or gradient
   skips the update with a warning;
6. the engine sees the new weights (same module); evaluation, metrics, plots, samples and
   checkpoints as configured.

Data parallel (N processes under torchrun, `dist`; README "Several processes"): each rank
rolls out its whole env groups (each group from its own sampling stream, so trajectories do
not depend on N), the StarPO-S filter ranks every rank's groups, advantages are per group
(batch statistics such as GAE's whitening over every rank's tokens), the mini-batches are
those of the global batch with global loss denominators, gradients are summed over the
ranks before clipping (trainer.data_parallel: `fsdp`, the default, shards the policy, a
separate critic and the value head with FSDP2, their parameters gathered whole for the
rollout and the evaluation; `replicate` keeps whole parameters and optimizer state on every
rank), and rank 0 alone evaluates and writes metrics, samples and checkpoints (whole model
and optimizer state, gathered from the shards). One process runs none of this.

Stopping: Ctrl-C (SIGINT) finishes the iteration, saves and exits; SIGTERM (what schedulers
send before they kill) stops within a bounded time: an iteration whose update has not begun
is dropped at once (resume redoes it identically), an update under way is finished, and an
evaluation it interrupts or would start is postponed to the resume; then the last complete
iteration is saved. The process holds its run folder (`fastpo.checkpoint.RunLock`).
Data parallel, a signal takes effect at the next point the ranks share (before the
iteration's update, where SIGTERM drops the iteration, or after it), so a rollout or an
evaluation under way finishes first; rank 0 saves; there is no second-signal abort
(torchrun kills the workers itself after its grace period).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import signal
import time
from typing import Any, Optional

import numpy as np
import torch

from fastpo import algorithms as alg
from fastpo import distributed as fdist
from fastpo.checkpoint import (LOCK_FILE, CheckpointSaveError, RunLock, atomic_write_text, clear_run_folder,
                               load_checkpoint, load_state, nothing_to_train_note, plan_resume, rng_state,
                               run_folder_in_use, save_checkpoint, tidy_run_folder)
from fastpo.config import ConfigError, TrainConfig, cpu_preset_note, dump_yaml, run_settings
from fastpo.evaluate import config_success_bounds, evaluate_config, write_json
from fastpo.kernels import PolicyLossSettings, linear_logprob_entropy, linear_policy_loss
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.models import ModelLoadError, load_model_checked, resolve_device
from fastpo.metrics import (EchoTrapDetector, MetricsLogger, before_after_table, plot_curves, rollout_metrics,
                            summary_table, warn_user, write_samples)
from fastpo import window as ctxwin
from fastpo.packing import (pack_micro_batch, packing_attention, plan_micro_batches, shared_prefixes,
                            use_segment_attention)
from fastpo.seeds import iteration_seeds, mini_batch_generator_seed, rollout_sampling_seed


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class NothingToTrain(ConfigError):
    """The prompts leave no room for a response: the run would train on nothing."""


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal after saving (or, on a second signal, without): `signum`
    is SIGINT (Ctrl-C) or SIGTERM; the CLI exits with 128 + signum (130, 143)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__()
        self.signum = int(signum)


class _Drop(BaseException):
    """Raised by the SIGTERM handler inside a phase that changes no weight (a rollout, an
    evaluation): that work is dropped. A BaseException, so no `except Exception` swallows it."""


def policy_loss_settings(cfg: TrainConfig) -> PolicyLossSettings:
    """The fused policy loss's settings for `cfg` (built once per run): the algorithm's clip,
    entropy, KL and aggregation settings at the rollout temperature; no KL term in the loss
    when the KL is on the reward (`TrainConfig.kl_in_reward`)."""
    a = cfg.algorithm
    return PolicyLossSettings(clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
                              entropy_coef=a.entropy_coef, kl_coef=0.0 if cfg.kl_in_reward else a.kl_coef,
                              kl_estimator=a.kl_estimator, temperature=cfg.rollout.temperature, loss_agg=a.loss_agg,
                              ratio_level=a.ratio_level)


def loss_denominator(loss_agg: str, masks: list, indices: list[int]) -> float:
    """The normaliser of a mini-batch's loss under `loss_agg` (fastpo.kernels.aggregation_weights'
    `denominator`), so that micro-batch losses accumulate to the mini-batch's: its scored tokens
    for "token-mean", else its trajectories with a scored token; at least 1."""
    if loss_agg == "token-mean":
        return float(max(1, sum(int(masks[i][1:].sum()) for i in indices)))
    return float(sum(1 for i in indices if bool(masks[i][1:].any())) or 1)


class _MetricMeans:
    """Running means of named scalars (floats or 0-dim tensors) over an update."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, key: str, value) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.counts[key] = self.counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}

    @classmethod
    def merged(cls, parts: list) -> "_MetricMeans":
        """The running means of several ranks' (sums, counts), as if one had seen every value."""
        out = cls()
        for sums, counts in parts:
            for k, v in sums.items():
                out.sums[k] = out.sums.get(k, 0.0) + float(v)
                out.counts[k] = out.counts.get(k, 0) + int(counts[k])
        return out


class ValueHead(torch.nn.Module):
    """Scalar value V(s_t) from a hidden state [.., H] -> [..] fp32 (zero-initialised output)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h.to(self.proj.weight.dtype)).squeeze(-1).float()


def _pad(rows: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-trajectory 1-D tensors -> [B, T] right-padded with zeros (False)."""
    out = torch.zeros(len(rows), max((int(x.numel()) for x in rows), default=0), dtype=dtype)
    for i, x in enumerate(rows):
        out[i, : x.numel()] = x.to(dtype)
    return out


def _traj_items(it: int, ids, masks, samp, old_lp, adv, returns, vals, ref) -> list[dict]:
    """One dict per trajectory of what training on it again needs (fastpo.replay's items)."""
    items = []
    for i in range(len(ids)):
        item = {"input_ids": ids[i], "loss_mask": masks[i], "sample_logprobs": samp[i], "old_logprobs": old_lp[i],
                "advantages": adv[i], "iteration": it}
        for key, col in (("returns", returns), ("values", vals), ("ref_logprobs", ref)):
            if col is not None:
                item[key] = col[i]
        items.append(item)
    return items


class _RankRecords:
    """The metric records of a rank other than 0 under data parallelism: kept in memory, never
    written (rank 0's MetricsLogger writes the run's metrics.jsonl)."""

    def __init__(self):
        self.records: list[dict] = []

    def log(self, iteration: int, metrics: dict) -> dict:
        rec = {"iteration": int(iteration), **MetricsLogger.log_values(metrics)}
        self.records.append(rec)
        return rec

    def amend_last(self, values: dict) -> None:
        self.records[-1].update(values)

    def extend_last(self, metrics: dict) -> dict:
        self.records[-1].update({k: v for k, v in MetricsLogger.log_values(metrics).items() if k not in self.records[-1]})
        return self.records[-1]

    def close(self) -> None:
        pass


class Trainer:
    """Runs StarPO / StarPO-S for `cfg.trainer.iterations` iterations into `cfg.trainer.output_dir`.

    `resume=True` continues the run found in the output folder from its latest checkpoint.
    `console` is a rich Console (created when None). `stop_after` (an iteration) stops the
    run there exactly as a Ctrl-C during that iteration would: checkpoint, then return.
    Public entry point: `run()`, returning the list of metric records.
    """

    def __init__(self, cfg: TrainConfig, resume: bool = False, console: Any = None,
                 stop_after: Optional[int] = None, overwrite: bool = False, dist: fdist.DistContext = fdist.SINGLE):
        from rich.console import Console

        self.cfg = cfg
        self.dist = dist
        self.console = console or Console(quiet=not dist.is_main)
        self.out = cfg.trainer.output_dir
        self.resume = resume
        self.overwrite = overwrite
        self.device = dist.device if dist.initialized and dist.device.type == "cuda" else resolve_device(cfg.trainer.device)
        self._stop_requested = False
        self.interrupted = False  # stopped by Ctrl-C or SIGTERM (after saving), not by reaching the end
        self.stop_signal: Optional[int] = None
        self._droppable_now = False  # inside a phase a SIGTERM may drop (see _droppable)
        self._weights_touched = False  # the current iteration's update has begun
        self._eval_pending = False
        self._lock: Optional[RunLock] = None
        self.stop_after = stop_after
        self.start_iteration = 1
        self.weight_sync_seconds = 0.0
        self.last_eval: dict = {}
        self._success_bounds: Optional[dict] = None  # eval/optimal_success, eval/random_success (fixed seeds)
        self._fsdp_root: Optional[torch.nn.Module] = None  # trainer.data_parallel=fsdp: the FSDP2 root

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Load the model(s), build the critic, optimizers, engine, rollout and logger; restore a checkpoint.

        A start that fails (e.g. the model cannot load) leaves no empty output folder behind."""
        created = not os.path.exists(self.out)
        try:
            self._setup()
        except BaseException:
            self._shutdown_engine()  # a started SGLang server must not outlive the failed start
            empty = (self.dist.is_main and created and os.path.isdir(self.out)
                     and set(os.listdir(self.out)) <= {LOCK_FILE})
            self._release_lock(remove=empty)
            if empty:
                with contextlib.suppress(OSError):
                    os.rmdir(self.out)
            raise

    def _warn(self, text: str) -> None:
        """A warning for the user (`fastpo.metrics.warn_user`: the "fastpo" logger, shown on
        this run's console unless that logger has handlers of its own); rank 0's only."""
        if self.dist.is_main:
            warn_user(text, self.console)

    def _release_lock(self, remove: bool = False) -> None:
        if self._lock is not None:
            self._lock.release(remove=remove)
            self._lock = None

    def check_prompts_fit(self) -> Any:
        """Refuse, before any model loads, prompts that leave no room for one response turn:
        the first prompt of the first iteration's env groups and of the first eval seed (with
        the model's chat template and tokenizer) plus rollout.max_new_tokens must fit in
        rollout.max_context. Returns the tokenizer; raises NothingToTrain (a ConfigError)
        naming both numbers."""
        from fastpo import rollout as ro

        cfg, r = self.cfg, self.cfg.rollout
        tok = load_model_checked(cfg.model.name, tokenizer_only=True)
        try:
            probe = ro.MultiTurnRollout(None, tok, cfg.env.name, dict(cfg.env.options), r.rollout_config())
        except ValueError as e:  # e.g. a tokenizer without a chat template
            raise ModelLoadError(f"model.name={cfg.model.name!r}: {e}") from None
        seeds = iteration_seeds(cfg.trainer.seed, 1, r.env_groups) + [cfg.trainer.eval_seed_offset]
        longest = max(probe.prompt_lengths(seeds))
        if longest + r.max_new_tokens > r.max_context:
            raise NothingToTrain(
                f"config key 'rollout.max_context' = {r.max_context}: the first prompt of {cfg.env.name} takes "
                f"{longest} tokens with {cfg.model.name}'s chat template, so no response of rollout.max_new_tokens = "
                f"{r.max_new_tokens} fits; raise rollout.max_context to at least {longest + r.max_new_tokens} "
                f"(or make the env's state smaller)")
        return tok

    def _setup(self) -> None:
        from fastpo import rollout as ro

        cfg, c = self.cfg, self.console
        if cfg.rollout.engine == "sglang":
            from fastpo.rollout.sglang_engine import sglang_available

            if not sglang_available():  # before anything loads or is written
                raise ConfigError("config key 'rollout.engine' = 'sglang': needs CUDA and sglang "
                                  "(pip install 'fastpo[sglang]'); use rollout.engine=native on this machine")
        if cfg.rollout.group_size == 1 and cfg.algorithm.filter_mode != "none":
            self._warn(f"algorithm.filter_mode={cfg.algorithm.filter_mode} with rollout.group_size=1: "
                       "the in-group reward std is undefined with one trajectory per env group, so StarPO-S "
                       "filtering is skipped (every group is trained on)")
        tok = self.check_prompts_fit()
        torch.manual_seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed % 2**32)
        # rank 0 alone holds and writes the run folder; the others read it once it is ready
        fdist.on_main(self.dist, self._prepare_folder)
        dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
        if dtype is None:
            dtype = torch.float32  # fp32 master weights; CUDA runs the math under bf16 autocast
        ckpt = None
        if self.resume:
            plan = plan_resume(self.out)
            if plan.note:
                self._warn(plan.note)
            ckpt = plan.checkpoint
        t0 = time.perf_counter()
        model, tok, info = load_model_checked(cfg.model.name, device=str(self.device), dtype=dtype, tokenizer=tok)
        self.info = info
        try:  # the fused kernels compute plain linear heads only (fastpo.kernels.hf.lm_head_weight)
            lm_head_weight(model)
            decoder_body(model)
        except ValueError as e:
            raise ModelLoadError(f"model.name={cfg.model.name!r}: {e}") from None
        if ckpt is not None and cfg.model.lora_rank == 0:
            # (with LoRA the base stays frozen; only the adapter is restored, below)
            load_checkpoint(ckpt, model=model)
        self.load_seconds = time.perf_counter() - t0
        c.print(f"[bold]model[/] {info.label}: {info.num_params / 1e6:.1f}M parameters, {info.dtype}, "
                f"{self.device} (loaded in {self.load_seconds:.1f} s)")
        # packed rows attend per trajectory (sum of L_i^2, not N^2); generation still runs sdpa
        use_segment_attention(model)
        if cfg.rollout.context_window != "full" and packing_attention(model) == "varlen":
            raise ConfigError(f"config key 'rollout.context_window' = {cfg.rollout.context_window!r} needs a "
                              "per-token attention mask, which flash-attn's varlen packing cannot take; load the "
                              "model with sdpa or eager attention")
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        hidden = model.config.hidden_size
        a = cfg.algorithm
        self.critic_body = None
        self.value_head = None
        if a.adv_estimator == "gae":
            self.value_head = ValueHead(hidden).to(self.device)
            if a.critic == "separate":
                # A copy of the policy's architecture (initialised from the policy, as RAGEN/verl do).
                self.critic_body = copy.deepcopy(decoder_body(model)).to(self.device)
                self.critic_body.requires_grad_(True)
        if cfg.model.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                                                     lora_dropout=cfg.model.lora_dropout,
                                                     target_modules=list(cfg.model.lora_target_modules),
                                                     task_type="CAUSAL_LM"))
            if ckpt is not None:
                load_checkpoint(ckpt, model=model)  # the adapter
        self.model, self.tokenizer = model, tok
        # data parallel: every replica starts from rank 0's weights (and stays equal: summed gradients)
        fdist.broadcast_modules(self.dist, model, self.ref_model, self.critic_body, self.value_head)
        if self.dist.initialized and cfg.trainer.data_parallel == "fsdp":
            if ckpt is not None and self.value_head is not None:  # whole tensors, before sharding
                load_checkpoint(ckpt, critic_backbone=self.critic_body, value_head=self.value_head)
            # FSDP2: the policy, a separate critic and the value head sharded over the ranks (the
            # reference model stays whole on every rank: no gradient, no optimizer state)
            self._fsdp_root = fdist.shard_trainer_modules(self.dist, model, self.critic_body, self.value_head)
        o = cfg.optim
        actor_params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": actor_params, "lr": o.actor_lr}]
        self.critic_opt = None
        if self.value_head is not None and a.critic == "shared":
            groups.append({"params": list(self.value_head.parameters()), "lr": o.critic_lr})
        self.actor_opt = torch.optim.AdamW(groups, lr=o.actor_lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        if self.critic_body is not None:
            self.critic_opt = torch.optim.AdamW(list(self.critic_body.parameters()) + list(self.value_head.parameters()),
                                                lr=o.critic_lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.loss_settings = policy_loss_settings(cfg)
        self.rollout_cfg = cfg.rollout.rollout_config()
        self.engine = self._make_engine(model, tok)
        self._resolve_old_logprob()
        self.rollout = ro.MultiTurnRollout(self.engine, tok, cfg.env.name, dict(cfg.env.options), self.rollout_cfg,
                                           env_workers=cfg.env.workers)
        self.echo = EchoTrapDetector(cfg.trainer.echo_trap_drop, cfg.trainer.echo_trap_window)
        self.schedule = None  # rollout reuse (Online-K) and replay (fastpo.replay); None: a fresh batch each time
        if cfg.rollout.reuse > 1 or cfg.rollout.replay > 0:
            from fastpo.replay import RolloutSchedule

            self.schedule = RolloutSchedule(cfg.rollout.reuse, cfg.rollout.replay, cfg.rollout.replay_fraction,
                                            cfg.train_batch_size, cfg.trainer.seed)
        if ckpt is not None and self._fsdp_root is not None:  # the one-process optimizer state, sharded
            state = load_checkpoint(ckpt, rng=True)
            saved = load_state(ckpt)[1]
            for name, opt in self._optimizers().items():
                fdist.load_full_optimizer_state(self.dist, self._fsdp_root, opt, saved[name])
        elif ckpt is not None:
            state = load_checkpoint(ckpt, optimizers=self._optimizers(), critic_backbone=self.critic_body,
                                    value_head=self.value_head, rng=True)
        if ckpt is not None:
            self.start_iteration = int(state["iteration"]) + 1
            self.last_eval = state.get("last_eval", {})
            self._eval_pending = bool(state.get("eval_pending"))
            if self.schedule is not None and state.get("rollout_schedule") is not None:
                self.schedule.load_state_dict(state["rollout_schedule"])
            c.print(f"[bold]resumed[/] from {ckpt} at iteration {self.start_iteration}")
        if not self.dist.is_main:  # the other ranks keep their records in memory, write nothing
            self.logger = _RankRecords()
            return
        self.logger = MetricsLogger(self.out, cfg.trainer.ema_decay, cfg.trainer.tensorboard, cfg.trainer.wandb,
                                    resume_from=self.start_iteration - 1 if ckpt is not None else None,
                                    run_name=os.path.basename(os.path.abspath(self.out)), config=cfg.to_dict(),
                                    model_label=self.info.label,
                                    warn=self._warn)
        for rec in self.logger.records:
            self.echo.update(rec)
        path, text = os.path.join(self.out, "config.yaml"), dump_yaml(cfg)
        if ckpt is not None and self.start_iteration > cfg.trainer.iterations:
            return  # a finished run resumed with nothing to train: its config.yaml stays as it ran
        ran = os.path.join(ckpt, "config.yaml") if ckpt is not None else None
        if ran is not None and os.path.exists(ran) and run_settings(_read(ran)) != run_settings(text):
            # resumed with changed settings: keep beside the run those the checkpoint's iterations
            # ran with (from the checkpoint, so a failed resume in between cannot blur them)
            kept = os.path.join(self.out, f"config.until_iter_{self.start_iteration - 1:06d}.yaml")
            if not os.path.exists(kept):
                shutil.copyfile(ran, kept)
            c.print(f"settings changed on resume: iterations up to {self.start_iteration - 1} ran with {kept}")
        atomic_write_text(path, text)

    def _prepare_folder(self) -> None:
        """Lock the run folder, clear it (a new run with overwrite) and tidy it after an
        interrupted write (rank 0 only)."""
        self._lock = RunLock(self.out).acquire()  # before anything in the folder is read or written
        if not self.resume:
            used = run_folder_in_use(self.out)
            if used and not self.overwrite:
                # never destroy a previous run by starting a new one on top of it
                raise FileExistsError(f"{self.out} already holds a run ({', '.join(used)}); resume it, "
                                      f"choose another output folder or pass overwrite=True (--overwrite)")
            if used:
                clear_run_folder(self.out)
        tidied = tidy_run_folder(self.out)
        if tidied:
            self.console.print(f"{self.out}: after an interrupted write: {'; '.join(tidied)}", markup=False,
                               soft_wrap=True)
        os.makedirs(self.out, exist_ok=True)

    def _make_engine(self, model, tok):
        """The generation engine of `rollout.engine`: the native one samples from `model` itself;
        SGLang's holds a copy, refreshed by `_engine_awake` after each update."""
        from fastpo import rollout as ro

        r = self.cfg.rollout
        self._engine_released = self._weights_stale = False
        if r.engine == "native":
            return ro.NativeEngine(model, tok)
        import tempfile

        from fastpo.rollout.sglang_engine import SGLangEngine

        # SGLang loads the weights from an HF folder once; later updates go as tensors, so the
        # folder (a full copy of the model) lives only until the engine has started
        folder = tempfile.mkdtemp(prefix="fastpo-sglang-")
        try:
            return SGLangEngine.from_model(model, tok, folder, mem_fraction_static=r.sglang_mem_fraction,
                                           dtype="float32" if self.cfg.model.dtype == "float32" else "bfloat16")
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _resolve_old_logprob(self) -> None:
        """Set `self.old_logprob_source` ("sampler" | "recompute") from `algorithm.old_logprob`."""
        from fastpo.old_logprob import resolve_old_logprob

        autocast = self.device.type == "cuda" and self.cfg.model.dtype == "auto"  # as _autocast()
        self.old_logprob_source, why, warn = resolve_old_logprob(
            self.cfg.algorithm.old_logprob, self.engine, self.model, self.cfg.rollout.temperature, autocast)
        line = f"old log-probs: {self.old_logprob_source} ({why})"
        if warn:
            self._warn(line)
        else:
            self.console.print(line)

    def _shutdown_engine(self) -> None:
        """Stop an engine that runs its own processes (SGLang); the native one has none."""
        engine = getattr(self, "engine", None)
        if hasattr(engine, "shutdown"):
            engine.shutdown()

    @contextlib.contextmanager
    def _engine_awake(self):
        """Around generation: an engine that frees its GPU memory for training (SGLang) takes
        it back and loads the weights of the last update first, and frees it again after."""
        if not hasattr(self.engine, "release_memory"):
            yield  # the native engine is the trained module: nothing to move
            return
        if self._engine_released:
            self.engine.resume_memory()
            self._engine_released = False
        if self._weights_stale:
            t0 = time.perf_counter()
            self.engine.update_weights(self.model)
            self._weights_stale = False
            self.weight_sync_seconds += time.perf_counter() - t0
        try:
            yield
        finally:
            self.engine.release_memory()
            self._engine_released = True

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.model.dtype == "auto":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ phases
    def _generate(self, seeds: list[int], group_size: int, temperature: float, seed: int,
                  group_ids: Optional[list[int]] = None):
        """Roll out env groups `seeds` x group_size; `group_ids` (global ids): each group samples
        from its own stream (rollout.sampling_streams), else one stream for the batch."""
        self.model.eval()
        # old log-probs from the sampler: a critic on the policy's trunk reads its values off
        # the sampling pass's hidden states, so no pass over the batch is left to do
        readout = (getattr(self, "old_logprob_source", "recompute") == "sampler" and self.value_head is not None
                   and self.critic_body is None and hasattr(self.engine, "readout"))
        if readout:
            self.engine.readout = self.value_head
        try:
            with torch.no_grad(), self._autocast(), self._engine_awake():
                if group_ids is None:
                    return self.rollout.generate(seeds, group_size, temperature=temperature, seed=seed)
                return self.rollout.generate(seeds, group_size, temperature=temperature, seed=seed,
                                             group_ids=group_ids)
        finally:
            if readout:
                self.engine.readout = None

    def _micro_batches(self, ids: list[torch.Tensor], indices: list[int], masks: list[torch.Tensor]):
        """Packed micro-batches of the trajectories `indices`; an env group's shared prompt is
        computed once per micro-batch where the attention allows it (optim.share_prefix)."""
        attention = packing_attention(self.model)
        prefix = groups = None
        if attention == "segments" and self.cfg.optim.share_prefix:
            pl, pg = shared_prefixes([ids[i] for i in indices], [masks[i] for i in indices])
            prefix, groups = dict(zip(indices, pl)), dict(zip(indices, pg))
        lengths = [int(ids[i].numel()) for i in indices]
        plan = plan_micro_batches(lengths, self.cfg.optim.micro_token_budget,
                                  None if prefix is None else [prefix[i] for i in indices],
                                  None if groups is None else [groups[i] for i in indices])
        # sdpa takes a boolean mask whatever the query dtype (autocast or not); eager adds a float one
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        mdtype = torch.bool if impl == "sdpa" else torch.float32
        windows = None
        if self.cfg.rollout.context_window != "full":  # each turn attends as the sampler's window did
            windows = {i: ctxwin.labels(ids[i]) for i in indices}
            missing = [i for i, w in windows.items() if w is None]
            if missing:
                raise RuntimeError(f"trajectories {missing[:5]} carry no context-window labels "
                                   "(fastpo.window.attach); they cannot be scored as the sampler saw them")
        for mb in plan:
            yield pack_micro_batch(ids, [indices[j] for j in mb], attention=attention, mask_dtype=mdtype,
                                   device=self.device, prefix_lengths=prefix, prefix_groups=groups, windows=windows)

    @staticmethod
    def _hidden(body: torch.nn.Module, micro) -> torch.Tensor:
        """The last hidden states [L, H] of packed micro-batch `micro` (one row of L tokens)
        through decoder body `body` (the policy's, the reference model's or a separate critic's):
        the forward that computing old log-probs and the update share."""
        return body(**micro.model_inputs(), use_cache=False).last_hidden_state[0]

    def _values(self, micro, rows: torch.Tensor, h_policy: Optional[torch.Tensor]) -> torch.Tensor:
        """The critic's values [M] fp32 from the hidden-state rows `rows` [M]: the policy's
        hidden states `h_policy` for a critic on the shared trunk, else its own body's."""
        hv = h_policy if self.critic_body is None else self._hidden(self.critic_body, micro)
        return self.value_head(hv[rows])

    @torch.no_grad()
    def compute_old(self, ids, masks, logprobs: bool = True, values: bool = True) -> tuple[list, list, list, list]:
        """Old log-probs, entropies, values and reference log-probs per trajectory ([T_i] fp32 each).

        Log-prob/entropy of token t sit at index t (0 off the loss mask); values likewise.
        `logprobs=False` skips the policy's LM head (log-probs and entropies stay None),
        `values=False` the critic (values None): what the sampler already gave.
        """
        temp = self.cfg.rollout.temperature
        impl = self.cfg.trainer.kernel_impl
        n = len(ids)
        values = values and self.value_head is not None
        old_lp = [torch.zeros(int(x.numel())) for x in ids] if logprobs else None
        ent = [torch.zeros(int(x.numel())) for x in ids] if logprobs else None
        vals = [torch.zeros(int(x.numel())) for x in ids] if values else None
        ref = [torch.zeros(int(x.numel())) for x in ids] if self.ref_model is not None else None
        if not (logprobs or values or ref is not None) or n == 0:
            return old_lp, ent, vals, ref
        policy_body = logprobs or (values and self.critic_body is None)
        self.model.eval()
        for micro in self._micro_batches(ids, list(range(n)), masks):
            scored = micro.scored(masks)  # token t is scored from the hidden state at t - 1
            if scored.count == 0:
                continue
            with self._autocast():
                h = self._hidden(decoder_body(self.model), micro) if policy_body else None
                if logprobs:
                    lp, e = linear_logprob_entropy(h[scored.rows], lm_head_weight(self.model), scored.targets, temp,
                                                   impl=impl)
                    scored.scatter(lp.float(), old_lp)
                    scored.scatter(e.float(), ent)
                if values:
                    scored.scatter(self._values(micro, scored.rows, h).float(), vals)
                if self.ref_model is not None:
                    hr = self._hidden(decoder_body(self.ref_model), micro)
                    rlp, _ = linear_logprob_entropy(hr[scored.rows], lm_head_weight(self.ref_model), scored.targets,
                                                    temp, impl=impl)
                    scored.scatter(rlp.float(), ref)
        return old_lp, ent, vals, ref

    def _old_from_sampler(self, batch, ids, masks, samp):
        """(old_lp, ent, vals, ref, recomputed log-probs or None) with the sampler's log-probs as
        old_lp; entropies and a shared critic's values from the rollout where it recorded them,
        and one pass over the batch for only what is still missing (a separate critic, a
        reference model, or an engine that records no entropies)."""
        ent = [torch.as_tensor(x, dtype=torch.float32) for x in batch.sample_entropies] or None
        if ent is None and not ids:  # no trajectory (a rank the filter left empty): nothing is missing
            ent = []
        vals = None
        if self.value_head is not None and self.critic_body is None and batch.sample_values:
            vals = [torch.as_tensor(x, dtype=torch.float32) for x in batch.sample_values]
        lp2, ent2, vals2, ref = self.compute_old(ids, masks, logprobs=ent is None,
                                                 values=self.value_head is not None and vals is None)
        return samp, ent if ent is not None else ent2, vals if vals is not None else vals2, ref, lp2

    def collapse_metrics(self, batch) -> dict:
        """`collapse/*` (fastpo/collapse.py) of a rollout batch's first turns, scored by the
        current policy at the rollout temperature with the trainer's packing and kernels."""
        from fastpo.collapse import batch_collapse_metrics

        r = self.cfg.rollout
        return batch_collapse_metrics(self.model, self.tokenizer, batch, think=r.think, temperature=r.temperature,
                                      token_budget=self.cfg.optim.micro_token_budget,
                                      share_prompt=self.cfg.optim.share_prefix, impl=self.cfg.trainer.kernel_impl,
                                      autocast=self._autocast)

    def compute_advantages(self, batch, masks, vals, old_lp=None, ref=None) -> tuple[list, Optional[list], dict]:
        """Per-trajectory advantages (and returns for PPO), [T_i] fp32 each, zero off the loss mask.

        Estimators (algorithm.adv_estimator): gae (critic), reinforce_pp (token returns
        normalised over the batch), and the group ones on trajectory scores: grpo, drgrpo,
        rloo, reinforce_pp_baseline (fastpo.algorithms.advantages).
        With algorithm.kl_coef > 0 and the KL on the reward (`TrainConfig.kl_in_reward`), old_lp
        and ref (the policy's and the reference model's log-probs, [T_i] each) give each model
        token's KL, subtracted (times kl_coef) from its reward before GAE or REINFORCE++, or,
        for the group estimators, from the trajectory's score (the sum of its token rewards)
        before the group baseline.
        """
        a = self.cfg.algorithm
        B = len(masks)
        ctx = self.dist
        if B == 0:  # a process whose env groups the filter all dropped (data parallel): it
            # still joins the batch statistics, in the order the other ranks compute them
            if a.adv_estimator not in ("gae", "reinforce_pp", "reinforce_pp_baseline"):
                return [], None, {}
            empty, none = torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.bool)
            if a.adv_estimator in ("reinforce_pp", "reinforce_pp_baseline"):
                fdist.masked_whiten(ctx, empty, none, unbiased=True)
                return [], None, {}
            m = {"critic/return_mean": fdist.masked_mean(ctx, empty, none),
                 "critic/value_mean": fdist.masked_mean(ctx, empty, none)}
            if a.whiten_advantages:
                fdist.masked_whiten(ctx, empty, none)
            return [], [], m
        T = max(int(mask.numel()) for mask in masks)
        M = torch.zeros(B, T, dtype=torch.bool)
        for i, mask in enumerate(masks):
            M[i, : mask.numel()] = mask
        metrics: dict = {}
        KL = None
        if a.kl_coef > 0 and self.cfg.kl_in_reward and ref is not None:
            LP, REF = torch.zeros(B, T), torch.zeros(B, T)
            for i in range(B):
                LP[i, : old_lp[i].numel()] = old_lp[i]
                REF[i, : ref[i].numel()] = ref[i]
            _, KL = alg.apply_kl_penalty(torch.zeros(B, T), LP, REF, M, a.kl_coef, a.kl_estimator)
            n = M.sum(1)
            # verl's critic/kl: the mean over trajectories of each one's mean token KL
            metrics["train/kl_reward"] = float((KL.sum(1)[n > 0] / n[n > 0]).mean()) if bool((n > 0).any()) else 0.0
        R = None
        if a.adv_estimator in ("gae", "reinforce_pp"):  # token rewards
            turn = None
            if a.reward_position == "turn":
                turn = torch.full((B, T), -1, dtype=torch.long)
                for i, t in enumerate(batch.turn_index):
                    t = torch.as_tensor(t)
                    turn[i, : t.numel()] = t
            # turn_rewards already hold each turn's env reward plus its format penalty
            turn_rewards = batch.turn_rewards.float() if a.reward_position == "turn" else None
            R = alg.place_rewards(M, batch.scores.float(), a.reward_position, turn, turn_rewards)
            if KL is not None:
                R = R - a.kl_coef * KL
        scores = None if R is not None else (
            batch.scores.float() if KL is None else batch.scores.float() - a.kl_coef * KL.sum(1))
        if a.adv_estimator == "gae":
            V = torch.zeros(B, T)
            for i, v in enumerate(vals):
                V[i, : v.numel()] = v
            adv, ret = alg.compute_gae(R, V, M, a.gamma, a.lam)
            # (data parallel: over every rank's tokens)
            metrics["critic/return_mean"] = fdist.masked_mean(ctx, ret, M)
            metrics["critic/value_mean"] = fdist.masked_mean(ctx, V, M)
            if a.whiten_advantages:
                adv = fdist.masked_whiten(ctx, adv, M)
            returns = [ret[i, : masks[i].numel()] for i in range(B)]
        elif a.adv_estimator == "reinforce_pp":  # REINFORCE++: returns normalised over the batch
            adv, ret = alg.reinforce_pp_advantages(R, M, a.gamma)
            if ctx.initialized:  # normalised over every rank's tokens
                adv = fdist.masked_whiten(ctx, ret, M, unbiased=True)
            returns = None
        elif a.adv_estimator == "reinforce_pp_baseline":
            # (data parallel: normalised over every rank's tokens)
            whiten = (lambda x, m: fdist.masked_whiten(ctx, x, m, unbiased=True)) if ctx.initialized else None
            adv = alg.reinforce_pp_baseline_advantages(scores, batch.group_ids, M, whiten=whiten)
            returns = None
        else:
            if a.adv_estimator == "rloo":
                per_traj = alg.rloo_advantages(scores, batch.group_ids)
            else:
                per_traj = alg.grpo_advantages(scores, batch.group_ids, scale_by_std=a.adv_estimator == "grpo")
            adv = per_traj[:, None] * M
            returns = None
        metrics["train/advantage_mean"] = float(adv[M].mean()) if M.any() else 0.0
        metrics["train/advantage_std"] = float(adv[M].std()) if int(M.sum()) > 1 else 0.0
        return [adv[i, : masks[i].numel()] for i in range(B)], returns, metrics

    def epoch_mini_batches(self, masks: list, generator: torch.Generator):
        """One PPO epoch's mini-batches: shuffled trajectory indices, the last one smaller when
        n % mini_batch_size != 0. Yields (indices, scored tokens, loss denominator): the
        denominator of `algorithm.loss_agg` (`loss_denominator`). Data parallel: the shuffle
        is of the global batch (the ranks' trajectories in rank order), each rank gets its
        trajectories of each mini-batch (maybe none) and the global denominator, so the
        mini-batches are those of one process whatever the world size."""
        size = self.cfg.optim.mini_batch_size
        if self.dist.initialized:  # the global batch's mini-batches, this rank's part of each
            counts = [int(x) for x in fdist.per_rank(self.dist, len(masks))]
            offset, total = sum(counts[: self.dist.rank]), sum(counts)
            perm = torch.randperm(total, generator=generator).tolist()
            for start in range(0, total, size):
                mini = [i - offset for i in perm[start:start + size] if offset <= i < offset + len(masks)]
                n_tok = sum(int(masks[i][1:].sum()) for i in mini)
                yield mini, n_tok, fdist.global_loss_denominator(self.dist, self.cfg.algorithm.loss_agg, masks, mini)
            return
        perm = torch.randperm(len(masks), generator=generator).tolist()
        for start in range(0, len(masks), size):
            mini = perm[start:start + size]
            n_tok = sum(int(masks[i][1:].sum()) for i in mini)
            yield mini, n_tok, loss_denominator(self.cfg.algorithm.loss_agg, masks, mini)

    def update(self, it: int, ids, masks, old_lp, adv, vals, returns, ref, is_weights=None) -> dict:
        """PPO epochs over shuffled mini-batches, each a gradient accumulated over its packed
        micro-batches (`_micro_batch_loss`) and one optimizer step (`_optimizer_step`); returns
        averaged update metrics. `is_weights` ([T_i] fp32 per trajectory, or None): the
        importance-sampling correction's weights on the policy-gradient term
        (fastpo.algorithms.rollout_correction)."""
        cfg, o = self.cfg, self.cfg.optim
        g = torch.Generator().manual_seed(mini_batch_generator_seed(cfg.trainer.seed, it))
        per_traj = {"old_lp": old_lp, "adv": adv, "vals": vals, "returns": returns, "ref": ref,
                    "is_weights": is_weights}
        metrics = _MetricMeans()
        skipped = steps = train_tokens = 0
        self.model.train()
        for _epoch in range(o.ppo_epochs):
            for mini, _n_tok, denom in self.epoch_mini_batches(masks, g):
                value_denom = (fdist.global_loss_denominator(self.dist, cfg.algorithm.value_loss_agg, masks, mini)
                               if self.dist.initialized else loss_denominator(cfg.algorithm.value_loss_agg, masks, mini))
                self._zero_grad()
                finite = True
                if self._fsdp_root is not None:
                    finite, n = self._fsdp_accumulate(ids, mini, masks, per_traj, denom, value_denom, metrics)
                    train_tokens += n
                for micro in (self._micro_batches(ids, mini, masks) if self._fsdp_root is None else ()):
                    scored = micro.scored(masks)
                    if scored.count == 0:
                        continue
                    train_tokens += micro.trajectory_tokens
                    total, out = self._micro_batch_loss(micro, scored, per_traj, denom, value_denom, metrics)
                    if not torch.isfinite(total.detach()):
                        finite = False
                        break
                    total.backward()
                    for k, val in out.metrics.items():
                        metrics.add(f"actor/{k}", val)
                    metrics.add("actor/pg_loss_micro", out.loss.detach())
                if self.dist.initialized:  # every rank steps, or none; the gradient is the sum over ranks
                    finite = fdist.all_reduce(self.dist, [0.0 if finite else 1.0], "max")[0] == 0.0
                    if finite and self._fsdp_root is None:  # (FSDP2 reduce-scattered them in the backward)
                        fdist.all_reduce_gradients(self.dist, self._trained_parameters())
                if finite and self._optimizer_step(metrics):
                    steps += 1
                    continue
                skipped += 1
                self._warn(f"iteration {it}: non-finite loss or gradient; update skipped (weights unchanged)")
                self._zero_grad()
        self.model.eval()
        if self.dist.initialized:  # means over every rank's micro-batches (and steps)
            metrics = _MetricMeans.merged(fdist.all_gather_object(self.dist, (metrics.sums, metrics.counts)))
            train_tokens = int(fdist.all_reduce(self.dist, [train_tokens])[0])
        res = metrics.means()
        res["actor/updates"] = steps
        res["actor/skipped_updates"] = skipped
        res["_train_tokens"] = train_tokens
        return res

    def _fsdp_accumulate(self, ids, mini, masks, per_traj: dict, denom: float, value_denom: float,
                         metrics: "_MetricMeans") -> tuple[bool, int]:
        """FSDP2: accumulate this rank's gradient of mini-batch `mini` (its trajectories on this
        rank), each micro-batch's loss computed inside the FSDP root's forward, then empty
        micro-batches up to the largest rank's count (`fdist.micro_batch_count`: every
        forward and backward runs FSDP's all-gathers and reduce-scatters, so every rank runs
        as many). A non-finite loss is still backpropagated (the same collectives on every
        rank); the step is then skipped on every rank. Returns (finite, trained tokens)."""
        real = [(m, sc) for m in self._micro_batches(ids, mini, masks) for sc in (m.scored(masks),) if sc.count]
        finite, tokens = True, 0
        for k in range(fdist.micro_batch_count(self.dist, len(real))):
            if k >= len(real):
                self._fsdp_root(self._empty_micro_loss).backward()
                continue
            micro, scored = real[k]
            tokens += micro.trajectory_tokens
            total, out = self._fsdp_root(self._micro_batch_loss, micro, scored, per_traj, denom, value_denom, metrics)
            if torch.isfinite(total.detach()):
                for key, val in out.metrics.items():
                    metrics.add(f"actor/{key}", val)
                metrics.add("actor/pg_loss_micro", out.loss.detach())
            else:
                finite = False
            total.backward()
        return finite, tokens

    def _empty_micro_loss(self) -> torch.Tensor:
        """0 from a 2-token dummy row through every sharded module (the policy's body and LM
        head, the critic): the forward and backward of a micro-batch this rank does not have,
        with zero gradients."""
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        micro = pack_micro_batch([torch.zeros(2, dtype=torch.long)], [0], attention=packing_attention(self.model),
                                 mask_dtype=torch.bool if impl == "sdpa" else torch.float32, device=self.device)
        with self._autocast():
            h = self._hidden(decoder_body(self.model), micro)
            total = h.float().sum() * 0 + lm_head_weight(self.model).float().sum() * 0
            if self.value_head is not None:
                total = total + self._values(micro, torch.zeros(1, dtype=torch.long, device=h.device), h).sum() * 0
        return total

    def _trained_parameters(self) -> list:
        """Every parameter the optimizers step, in one fixed order (the same on every rank)."""
        opts = [self.actor_opt] + ([self.critic_opt] if self.critic_opt is not None else [])
        return [p for o in opts for grp in o.param_groups for p in grp["params"]]

    def _optimizers(self) -> dict:
        """The optimizers by checkpoint name: "actor", and "critic" for a separate critic."""
        return {"actor": self.actor_opt, **({"critic": self.critic_opt} if self.critic_opt is not None else {})}

    def _zero_grad(self) -> None:
        self.actor_opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)

    def _micro_batch_loss(self, micro, scored, per_traj: dict, denom: float, value_denom: float,
                          metrics: "_MetricMeans"):
        """(total loss to backpropagate, the policy loss's PolicyLossOutput) of one packed
        micro-batch: the fused policy loss plus the critic's value loss (times value_coef
        when the critic shares the policy's optimizer), both normalised by their mini-batch
        denominators so that the accumulated gradient is the mini-batch's. Critic metrics
        go into `metrics`."""
        a = self.cfg.algorithm
        take = {k: None if v is None else scored.take(v) for k, v in per_traj.items()}
        ref = None if self.cfg.kl_in_reward else take["ref"]  # the KL is then in the advantages
        with self._autocast():
            h = self._hidden(decoder_body(self.model), micro)
            out = linear_policy_loss(h[scored.rows], lm_head_weight(self.model), scored.targets, take["old_lp"],
                                     take["adv"], torch.ones_like(take["old_lp"], dtype=torch.bool), ref,
                                     settings=self.loss_settings, seq_ids=scored.seq, denominator=denom,
                                     is_weights=take["is_weights"], impl=self.cfg.trainer.kernel_impl)
            total = out.loss
            if self.value_head is not None:
                v = self._values(micro, scored.rows, h)
                vloss, vm = alg.clipped_value_loss(v, take["vals"], take["returns"], torch.ones_like(v, dtype=torch.bool),
                                                   clip=a.value_clip, mode=a.value_loss_agg, seq_ids=scored.seq,
                                                   denominator=value_denom)
                for k, val in vm.items():
                    metrics.add(f"critic/{k}", val)
                # a separate critic has its own optimizer: no coefficient needed
                total = total + (a.value_coef * vloss if self.critic_body is None else vloss)
        return total, out

    def _optimizer_step(self, metrics: "_MetricMeans") -> bool:
        """Clip the accumulated gradients (optim.grad_clip) and step the optimizers; False,
        without a step, when a gradient norm is not finite."""
        clip = self.cfg.optim.grad_clip
        gn = torch.nn.utils.clip_grad_norm_([p for grp in self.actor_opt.param_groups for p in grp["params"]], clip)
        cgn = None
        if self.critic_opt is not None:
            cgn = torch.nn.utils.clip_grad_norm_([p for grp in self.critic_opt.param_groups for p in grp["params"]],
                                                 clip)
        if self._fsdp_root is not None:  # sharded gradients: the norms are DTensors of the global norm
            gn, cgn = fdist.full_value(gn), None if cgn is None else fdist.full_value(cgn)
        if not (bool(torch.isfinite(gn)) and (cgn is None or bool(torch.isfinite(cgn)))):
            return False
        self.actor_opt.step()
        if self.critic_opt is not None:
            self.critic_opt.step()
            metrics.add("critic/grad_norm", cgn)
        metrics.add("actor/grad_norm", gn)
        return True

    def evaluate(self, it: int) -> dict:
        """Success rate and pass@k on the fixed eval seeds at the eval temperature, with the
        best and the random policy's success on the same seeds and horizon beside it
        (`eval/optimal_success`, `eval/random_success`, computed once); writes samples."""
        t = self.cfg.trainer
        t0 = time.perf_counter()
        with self._engine_awake():
            res, batch = evaluate_config(self.rollout, self.cfg, autocast=self._autocast, model=self.model)
        if self._success_bounds is None:  # fixed seeds: computed once (a Sokoban search past its cap: none)
            self._success_bounds = config_success_bounds(self.cfg, warn=self._warn)
        res.update(self._success_bounds)
        # per-trajectory outcomes, for the paired before/after comparison (metrics.before_after)
        write_json(os.path.join(self.out, "eval", f"iter_{it:06d}.json"), res.pop("_per_trajectory"))
        write_samples(os.path.join(self.out, "samples"), it, batch.texts()[: max(1, t.num_samples)],
                      header=f"eval at iteration {it}: success rate {res['eval/success_rate']:.3f} "
                             f"(temperature {t.eval_temperature}, {t.eval_seeds} seeds)",
                      model_label=self.info.label)
        res["time/eval_s"] = time.perf_counter() - t0
        return res

    # ------------------------------------------------------------------ loop
    def iteration(self, it: int) -> dict:
        """One StarPO iteration; returns its metrics. Until its update begins, a SIGTERM drops it
        (raises _Drop; nothing has changed). Raises NothingToTrain when no trajectory had room
        for a response."""
        cfg, r, a = self.cfg, self.cfg.rollout, self.cfg.algorithm
        if self.schedule is not None and not self.schedule.needs_rollout(it):
            return self._reuse_iteration(it)
        tm: dict[str, float] = {}
        t0 = time.perf_counter()
        self.weight_sync_seconds = 0.0
        self._weights_touched = False
        isw = items = None
        ctx = self.dist
        # FSDP2: whole parameters on every rank from the rollout to the advantages (generation,
        # old log-probs and collapse metrics run different forward counts on each rank)
        with self._droppable(), fdist.gathered(self._fsdp_root):
            group_ids = None  # one sampling stream for the batch (today's one-process sampling)
            if ctx.initialized:  # this rank's whole env groups, their seeds and ids as in one process
                group_ids, seeds = fdist.rank_seeds(cfg.trainer.seed, it, r.env_groups, ctx.world_size, ctx.rank)
            else:
                seeds = iteration_seeds(cfg.trainer.seed, it, r.env_groups)
                if r.sampling_streams == "group":
                    group_ids = list(range(r.env_groups))
            extra = {} if group_ids is None else {"group_ids": group_ids}  # (subclasses override _generate)
            batch = self._generate(seeds, r.group_size, r.temperature, seed=rollout_sampling_seed(cfg.trainer.seed, it),
                                   **extra)
            tm["time/rollout_s"] = time.perf_counter() - t0 - self.weight_sync_seconds
            tm["time/weight_sync_s"] = self.weight_sync_seconds
            full = batch
            turns, longest = int(full.num_turns.sum()), max(int(x.numel()) for x in full.input_ids)
            if ctx.initialized:
                turns, longest = int(fdist.all_reduce(ctx, [turns])[0]), int(fdist.all_reduce(ctx, [longest], "max")[0])
            if not turns:
                raise NothingToTrain(
                    f"iteration {it}: no trajectory had room for a response (prompts of up to {longest} tokens, "
                    f"config key 'rollout.max_context' = {r.max_context}); raise rollout.max_context to at least "
                    f"{longest + r.max_new_tokens}")
            every = cfg.trainer.collapse_every
            collapse = bool(every and (it == 1 or it % every == 0))
            if ctx.initialized:  # computed by rank 0 on the global batch
                metrics, gen_tokens, collapse_s = self._global_rollout_metrics(full, collapse)
                if collapse:
                    tm["time/collapse_s"] = collapse_s
            else:
                metrics = rollout_metrics(full, prefix="train")
                if collapse:
                    t_c = time.perf_counter()
                    metrics.update(self.collapse_metrics(full))  # before filtering: the policy's, not the selection's
                    tm["time/collapse_s"] = time.perf_counter() - t_c
            t1 = time.perf_counter()
            # one trajectory per group: no in-group std to filter by (said once at start)
            mode = a.filter_mode if r.group_size > 1 else "none"
            if ctx.initialized:  # StarPO-S over every rank's groups (their stds are gathered)
                filt = fdist.global_filter(ctx, full.scores.float(), full.group_ids, a.filter_ratio, mode,
                                           a.filter_strategy, a.filter_top_p_mode, a.filter_eps, a.filter_keep_zero_std)
                skip = not filt.kept_groups
                batch = full.select(filt.indices) if filt.indices.numel() < len(full.input_ids) else full
            else:
                filt = alg.filter_groups(full.scores.float(), full.group_ids, a.filter_ratio, mode, a.filter_strategy,
                                         a.filter_top_p_mode, a.filter_eps, a.filter_keep_zero_std)
                # no group kept (top_p's threshold not reached, or only zero-std groups dropped): the
                # full batch is still scored for its metrics, then the update is skipped
                skip = filt.indices.numel() == 0
                batch = full.select(filt.indices) if 0 < filt.indices.numel() < len(full.input_ids) else full
            metrics["train/filter_kept_ratio"] = filt.kept_ratio
            metrics["train/in_group_reward_std_kept"] = filt.std_after
            metrics["train/filter_zero_std_groups"] = filt.zero_std_groups
            ids = [torch.as_tensor(x, dtype=torch.long) for x in batch.input_ids]
            for x, tn, vf in zip(ids, batch.context_turns, batch.visible_from):  # context window only
                ctxwin.attach(x, tn, vf)
            masks = [torch.as_tensor(x, dtype=torch.bool).clone() for x in batch.loss_mask]
            for mk in masks:
                mk[0] = False
            samp = [torch.as_tensor(x, dtype=torch.float32) for x in batch.sample_logprobs]
            if getattr(self, "old_logprob_source", "recompute") == "sampler":
                old_lp, ent, vals, ref, recomputed = self._old_from_sampler(batch, ids, masks, samp)
            else:
                old_lp, ent, vals, ref = self.compute_old(ids, masks)
                recomputed = old_lp
            tm["time/old_logprob_s"] = time.perf_counter() - t1
            metrics["train/old_logprob_from_sampler"] = float(old_lp is samp)
            if ctx.initialized:
                metrics.update(self._global_token_metrics(masks, samp, recomputed, ent))
            else:
                allm = torch.cat(masks)
                if recomputed is not None:  # both available: how far the sampler's are from the trainer's
                    gap = (torch.cat(recomputed) - torch.cat(samp))[allm].abs()
                    metrics["train/logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
                    metrics["train/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
                metrics["train/rollout_entropy"] = float(torch.cat(ent)[allm].mean()) if allm.any() else 0.0
            if skip:
                self._warn(f"iteration {it}: the {a.filter_strategy} filter kept no env group "
                           f"({filt.zero_std_groups} of {len(filt.group_std)} without reward spread); update skipped")
                metrics.update({"actor/updates": 0, "actor/skipped_updates": 0, **tm})
                return metrics
            t2 = time.perf_counter()
            adv, returns, am = self.compute_advantages(batch, masks, vals, old_lp, ref)
            if ctx.initialized:  # per group on each rank; the batch statistics over every rank
                am = self._global_advantage_metrics(adv, masks, am)
            metrics.update(am)
            if a.soft_advantage_reweight and ctx.initialized:  # the largest group std over every rank
                w, wm = self._global_soft_weights(batch)
                adv = [x * w[i] for i, x in enumerate(adv)]
                metrics.update(wm)
            elif a.soft_advantage_reweight:
                w = alg.soft_advantage_weights(batch.scores.float(), batch.group_ids)
                adv = [x * w[i] for i, x in enumerate(adv)]
                metrics.update({"train/soft_reweight_min": float(w.min()), "train/soft_reweight_max": float(w.max()),
                          "train/soft_reweight_mean": float(w.mean())})
            tm["time/advantage_s"] = time.perf_counter() - t2
            if self.schedule is not None or a.is_correction != "none":
                rollout_m = dict(metrics)  # what the iterations reusing this batch log again
                if self.schedule is not None:
                    items = _traj_items(it, ids, masks, samp, old_lp, adv, returns, vals, ref)
                ids, masks, old_lp, adv, vals, returns, ref, isw = self._off_policy(
                    it, metrics, ids, masks, samp, old_lp, adv, vals, returns, ref, fresh=True)
            if ctx.initialized and self._sync_stop() and self._term_requested():
                raise _Drop  # every rank drops this iteration before its update (see _request_stop)
        if items is not None:  # past the droppable part: a dropped iteration leaves the schedule as it was
            self.schedule.start(it, items, rollout_m)
        self._train(it, metrics, tm, ids, masks, old_lp, adv, vals, returns, ref, isw)
        if ctx.initialized:
            gen = gen_tokens
            metrics.update(self._per_rank_figures(tm, len(ids)))
        else:
            gen = float(full.metrics.get("generated_tokens", sum(int(torch.as_tensor(x).sum()) for x in full.loss_mask)))
        metrics["perf/rollout_tokens_per_s"] = gen / max(tm["time/rollout_s"], 1e-9)
        metrics.update(tm)
        return metrics

    # ------------------------------------------------------------------ data parallel
    def _global_rollout_metrics(self, full, collapse: bool) -> tuple[dict, float, float]:
        """(rollout metrics, generated tokens, collapse seconds) of the global batch: every
        rank's trajectories are gathered to rank 0, which computes `rollout_metrics` (and the
        collapse metrics when `collapse`) on their concatenation, as one process would; the
        result is shared with every rank."""
        from fastpo.rollout.batch import TrajectoryBatch

        parts = fdist.gather_to_main(self.dist, dataclasses.replace(full, tokenizer=None))

        def compute():
            whole = TrajectoryBatch.concat(parts)
            whole.tokenizer = self.tokenizer
            m = rollout_metrics(whole, prefix="train")
            t_c, secs = time.perf_counter(), 0.0
            if collapse:
                m.update(self.collapse_metrics(whole))
                secs = time.perf_counter() - t_c
            gen = float(whole.metrics.get("generated_tokens",
                                          sum(int(torch.as_tensor(x).sum()) for x in whole.loss_mask)))
            return m, gen, secs

        return fdist.on_main(self.dist, compute)

    def _global_token_metrics(self, masks, samp, recomputed, ent) -> dict:
        """train/logprob_gap_mean|max and train/rollout_entropy over every rank's scored tokens."""
        allm = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
        e = torch.cat(ent)[allm].double() if masks else torch.zeros(0, dtype=torch.float64)
        out = {}
        # (a rank without trajectories may not know whether the others recomputed log-probs)
        if fdist.all_reduce(self.dist, [float(recomputed is not None)], "max")[0]:
            gap = ((torch.cat(recomputed) - torch.cat(samp))[allm].abs().double() if masks and recomputed is not None
                   else torch.zeros(0, dtype=torch.float64))
            n, total = fdist.all_reduce(self.dist, [gap.numel(), float(gap.sum())])
            top = fdist.all_reduce(self.dist, [float(gap.max()) if gap.numel() else 0.0], "max")[0]
            out["train/logprob_gap_mean"] = total / n if n else 0.0
            out["train/logprob_gap_max"] = top if n else 0.0
        n, total = fdist.all_reduce(self.dist, [e.numel(), float(e.sum())])
        out["train/rollout_entropy"] = total / n if n else 0.0
        return out

    def _global_advantage_metrics(self, adv, masks, local: dict) -> dict:
        """`compute_advantages`' batch metrics over every rank: the mean and sample std (n - 1)
        of the advantages on scored tokens, and the KL-in-reward mean over trajectories."""
        x = torch.cat([a[m] for a, m in zip(adv, masks)]).double() if masks else torch.zeros(0, dtype=torch.float64)
        n, s1, s2 = fdist.all_reduce(self.dist, [x.numel(), float(x.sum()), float((x * x).sum())])
        out = dict(local)
        mean = s1 / n if n else 0.0
        out["train/advantage_mean"] = mean
        out["train/advantage_std"] = float(np.sqrt(max(0.0, (s2 - n * mean * mean) / (n - 1)))) if n > 1 else 0.0
        if self.cfg.algorithm.kl_coef > 0 and self.cfg.kl_in_reward:
            with_tokens = sum(1 for m in masks if bool(m.any()))
            out["train/kl_reward"] = fdist.weighted_means(self.dist, {"kl": local.get("train/kl_reward", 0.0)},
                                                          with_tokens)["kl"]
        return out

    def _global_soft_weights(self, batch) -> tuple[torch.Tensor, dict]:
        """`soft_advantage_weights` of this rank's trajectories with the largest group std of
        the global batch, and train/soft_reweight_min|max|mean over every rank's trajectories."""
        from fastpo.algorithms.filtering import group_reward_std

        scores = batch.scores.float()
        local = max(group_reward_std(scores, batch.group_ids).values(), default=0.0) if len(scores) else 0.0
        top = fdist.all_reduce(self.dist, [local], "max")[0]
        w = alg.soft_advantage_weights(scores, batch.group_ids, top=top) if len(scores) else torch.zeros(0)
        n, total = fdist.all_reduce(self.dist, [w.numel(), float(w.double().sum())])
        lo = -fdist.all_reduce(self.dist, [-float(w.min()) if w.numel() else -np.inf], "max")[0]
        hi = fdist.all_reduce(self.dist, [float(w.max()) if w.numel() else -np.inf], "max")[0]
        return w, {"train/soft_reweight_min": lo, "train/soft_reweight_max": hi,
                   "train/soft_reweight_mean": total / n if n else 0.0}

    def _per_rank_figures(self, tm: dict, trajectories: int) -> dict:
        """Each rank's phase times (seconds), peak memory (MiB), trajectories trained on (after
        the filter) and the parameters and optimizer state it holds of the trained modules (MiB:
        the whole model replicated, about 1/N of it under FSDP2) as dist/rank<R>/<name>."""
        out = {}
        for r, v in enumerate(fdist.per_rank(self.dist, trajectories)):
            out[f"dist/rank{r}/trajectories"] = int(v)
        for key in ("time/rollout_s", "time/old_logprob_s", "time/update_s"):
            for r, v in enumerate(fdist.per_rank(self.dist, tm.get(key, 0.0))):
                out[f"dist/rank{r}/{key[5:]}"] = v
        for r, v in enumerate(fdist.per_rank(self.dist, fdist.peak_memory_mib(self.device))):
            out[f"dist/rank{r}/peak_memory_mib"] = v
        held = fdist.held_state_mib([self.model, self.critic_body, self.value_head], self._optimizers().values())
        for name, value in zip(("parameter_mib", "optimizer_state_mib"), held):
            for r, v in enumerate(fdist.per_rank(self.dist, value)):
                out[f"dist/rank{r}/{name}"] = v
        return out

    def _sync_stop(self) -> bool:
        """Data parallel: share a stop request among the ranks (each may have got its signal at
        another moment), so that all of them stop at the same point; SIGTERM wins over SIGINT.
        Returns whether a stop is requested."""
        stop, term = fdist.all_reduce(self.dist, [float(self._stop_requested), float(self._term_requested())], "max")
        if stop and not self._stop_requested:
            self._stop_requested = self.interrupted = True
        if stop:
            self.stop_signal = signal.SIGTERM if term else (self.stop_signal or signal.SIGINT)
        return bool(stop)

    def _evaluate_all(self, it: int) -> dict:
        """`evaluate` on rank 0 (the others wait for its result; one process: evaluate);
        FSDP2: with the parameters gathered on every rank meanwhile."""
        with fdist.gathered(self._fsdp_root):
            return fdist.on_main(self.dist, self.evaluate, it)

    def _train(self, it: int, metrics: dict, tm: dict, ids, masks, old_lp, adv, vals, returns, ref, isw) -> None:
        """The update phase of an iteration: `update`, then its metrics into `metrics` and its time into `tm`."""
        self._weights_touched = True
        t3 = time.perf_counter()
        # (is_weights only when there are some: subclasses such as bench's ReferenceTrainer override update)
        extra = {} if isw is None else {"is_weights": isw}
        um = self.update(it, ids, masks, old_lp, adv, vals, returns, ref, **extra)
        self._weights_stale = True  # a separate engine (SGLang) loads them before it next generates
        train_tokens = um.pop("_train_tokens")
        um.pop("actor/pg_loss_micro", None)
        metrics.update(um)
        tm["time/update_s"] = time.perf_counter() - t3
        metrics["perf/train_tokens_per_s"] = train_tokens / max(tm["time/update_s"], 1e-9)

    def _reuse_iteration(self, it: int) -> dict:
        """An iteration inside a reuse cycle (rollout.reuse = K > 1): no rollout; the batch the
        cycle's first iteration sampled is trained on again with its old log-probs (those of
        the policy that sampled it), advantages and rollout metrics (logged again, with
        `rollout/reuse_index` 1..K-1), plus this iteration's replayed trajectories."""
        tm: dict[str, float] = {"time/rollout_s": 0.0, "time/weight_sync_s": 0.0}
        self.weight_sync_seconds = 0.0
        self._weights_touched = False
        with self._droppable():
            t1 = time.perf_counter()
            metrics = dict(self.schedule.metrics)
            cur = self.schedule.current

            def col(key):
                return [x[key] for x in cur] if cur and key in cur[0] else None

            ids, masks, samp, old_lp, adv = (col(k) or [] for k in (
                "input_ids", "loss_mask", "sample_logprobs", "old_logprobs", "advantages"))
            returns, vals, ref = col("returns"), col("values"), col("ref_logprobs")
            ids, masks, old_lp, adv, vals, returns, ref, isw = self._off_policy(
                it, metrics, ids, masks, samp, old_lp, adv, vals, returns, ref)
            tm["time/old_logprob_s"] = time.perf_counter() - t1
        self._train(it, metrics, tm, ids, masks, old_lp, adv, vals, returns, ref, isw)
        metrics.update(tm)
        return metrics

    def _off_policy(self, it: int, metrics: dict, ids, masks, samp, old_lp, adv, vals, returns, ref, fresh: bool = False):
        """Mix this iteration's replayed trajectories into the batch and apply the importance-
        sampling correction (algorithm.is_correction); `fresh`: the batch was just rolled out
        (the schedule takes it after the droppable part). Per-trajectory lists in, the same
        lists (replayed ones appended; with "mis", trajectories left with no token dropped)
        and the IS weights (None without correction) out; metrics into `metrics`.

        Replayed trajectories keep their sampler log-probs, advantages and returns; their old
        log-probs (the ratio's anchor), values and reference log-probs are the current
        models', so the weights pi_old / pi_sampler correct the policy lag (decoupled PPO)."""
        a, sched = self.cfg.algorithm, self.schedule
        rep = sched.replayed(it, len(ids), fresh) if sched is not None else []
        if sched is not None:
            metrics["rollout/reuse_index"] = sched.reuse_index(it, fresh)
            metrics["replay/size"] = len(sched.pool(fresh))
            metrics["replay/trajectories"] = len(rep)
            if rep:
                metrics["replay/age_mean"] = float(np.mean([it - x["iteration"] for x in rep]))
        if rep:
            r_ids, r_masks = [x["input_ids"] for x in rep], [x["loss_mask"] for x in rep]
            r_old, _, r_vals, r_ref = self.compute_old(r_ids, r_masks)
            ids, masks, old_lp = ids + r_ids, masks + r_masks, old_lp + r_old
            samp, adv = samp + [x["sample_logprobs"] for x in rep], adv + [x["advantages"] for x in rep]
            returns = None if returns is None else returns + [x["returns"] for x in rep]
            vals = None if vals is None else vals + r_vals
            ref = None if ref is None else ref + r_ref
        corr = alg.rollout_correction(_pad(old_lp), _pad(samp), _pad(masks, torch.bool), a.is_correction, a.is_level,
                                      a.is_cap)
        for k in ("is_ratio_mean", "is_ratio_max", "is_ratio_min", "is_weight_mean", "is_truncated_frac"):
            metrics[f"actor/{k}"] = corr.metrics[k]
        metrics["rollout/mismatch_kl"] = corr.metrics["mismatch_kl"]
        if a.is_correction == "none":
            return ids, masks, old_lp, adv, vals, returns, ref, None
        n = [int(x.numel()) for x in ids]
        isw = [corr.weights[i, : n[i]] for i in range(len(ids))]
        if a.is_correction == "mis":  # dropped tokens leave the loss (and the loss's normalisation)
            masks = [corr.keep[i, : n[i]] for i in range(len(ids))]
            kept = [i for i in range(len(ids)) if bool(masks[i].any())]
            if len(kept) < len(ids):
                def sel(xs):
                    return None if xs is None else [xs[i] for i in kept]

                ids, masks, old_lp, adv, vals, returns, ref, isw = map(
                    sel, (ids, masks, old_lp, adv, vals, returns, ref, isw))
        return ids, masks, old_lp, adv, vals, returns, ref, isw

    def _request_stop(self, signum, frame) -> None:
        """The SIGINT / SIGTERM handler (see the module docstring); a second signal aborts at once
        without saving (Stopped)."""
        signum = signum or signal.SIGINT
        if self.dist.initialized:
            # Data parallel: only note the request; the ranks agree on it at the next shared point
            # (`_sync_stop`: before an update, after an iteration), so a rollout or evaluation under
            # way finishes. No second-signal abort: torchrun forwards one signal as several and
            # kills the workers itself after its grace period.
            first = not self._stop_requested
            self._stop_requested = self.interrupted = True
            if self.stop_signal != signal.SIGTERM:
                self.stop_signal = signum
            if first and self.dist.is_main:
                self.console.print(f"[yellow]{signal.Signals(signum).name}[/]: stopping all processes at the next "
                                   "shared point (before this iteration's update or after it), saving the last "
                                   "complete iteration, then exit")
            return
        if self._stop_requested:
            raise Stopped(signum)
        self._stop_requested = self.interrupted = True
        self.stop_signal = signum
        if signum == signal.SIGTERM:
            self.console.print("[yellow]SIGTERM[/]: stopping: the current rollout or evaluation is dropped (an update "
                               "under way finishes), the last complete iteration is saved, then exit (signal again "
                               "to abort without saving)")
            if self._droppable_now:
                self._droppable_now = False
                raise _Drop
        else:
            self.console.print("[yellow]Ctrl-C[/]: finishing this iteration, saving a checkpoint, then exiting "
                               "(press again to abort without saving)")

    @contextlib.contextmanager
    def _droppable(self):
        """Around work that changes no weight (a rollout and what follows it up to the update, an
        evaluation): a SIGTERM inside raises _Drop out of it at once."""
        self._droppable_now = True
        try:
            yield
        finally:
            self._droppable_now = False

    def _term_requested(self) -> bool:
        return self._stop_requested and self.stop_signal == signal.SIGTERM

    def _save(self, it: int, rng: Optional[dict] = None, eval_pending: bool = False) -> str:
        """Checkpoint iteration `it`; `rng` (default: the current RNG states) is what a resume
        restores; `eval_pending` marks an evaluation of `it` still to run on resume. Data
        parallel: rank 0 writes it in the one-process format (whole model and optimizer state,
        so any world size resumes from it); the others return "". Replicated: the replicas
        are equal, rank 0 writes its own. FSDP2: every
        rank first joins the gathering of the full model, critic and optimizer states
        (`torch.distributed.checkpoint.state_dict`), which rank 0 writes in the one-process
        format."""
        t0 = time.perf_counter()
        model, opts, critic, head = self.model, self._optimizers(), self.critic_body, self.value_head
        if self._fsdp_root is not None:
            model, opts, critic, head = self._full_state_views()
        if not self.dist.is_main:
            return ""
        path = save_checkpoint(self.out, it, model=model, tokenizer=self.tokenizer, optimizers=opts,
                               state={"last_eval": self.last_eval, "eval_pending": eval_pending,
                                      **({} if self.schedule is None else
                                         {"rollout_schedule": self.schedule.state_dict()})},
                               config_yaml=dump_yaml(self.cfg), critic_backbone=critic,
                               value_head=head, keep=self.cfg.trainer.keep_checkpoints, rng=rng)
        self.console.print(f"checkpoint: {path} ({time.perf_counter() - t0:.1f} s)")
        return path

    def _full_state_views(self) -> tuple:
        """(model, optimizers, critic body, value head) as `save_checkpoint` reads them, from the
        full states of the FSDP2-sharded modules (gathered on every rank, on the CPU, complete
        on rank 0): `get_model_state_dict` / `fdist.full_optimizer_state`."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)

        def view(module):
            if module is None:
                return None
            state = get_model_state_dict(module, options=full)
            # a tied weight (the LM head) is written once, under its first name, as one process does
            names = {n for n, _ in module.named_parameters()}
            tied = {n for n, _ in module.named_parameters(remove_duplicate=False)} - names
            return fdist.FullStateView({k: v for k, v in state.items() if k not in tied}, module)

        opts = {k: fdist.FullStateView(fdist.full_optimizer_state(self.dist, self._fsdp_root, o))
                for k, o in self._optimizers().items()}
        return view(self.model), opts, view(self.critic_body), view(self.value_head)

    def _run_pending_eval(self) -> bool:
        """The evaluation of the resumed checkpoint's iteration that a SIGTERM stopped: run it and
        add it to that iteration's record. False when stopped again (it stays pending)."""
        it = self.start_iteration - 1
        self.console.print(f"evaluating iteration {it} (postponed by the SIGTERM that stopped the run)")
        try:
            with self._droppable():
                ev = self._evaluate_all(it)
        except _Drop:
            return False
        self.last_eval = ev
        if self.logger.records and self.logger.records[-1].get("iteration") == it:
            self.logger.extend_last(ev)
        else:
            self.logger.log(it, ev)
        self._eval_pending = False
        return True

    def run(self) -> list[dict]:
        """Train; returns the metric records (also in OUT/metrics.jsonl)."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        cfg, t = self.cfg, self.cfg.trainer
        self.setup()
        total = t.iterations
        old_handlers = {}
        if _in_main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._request_stop)
        last_saved = self.start_iteration - 1
        updated = self.start_iteration - 1  # the last iteration whose update is complete
        it = self.start_iteration - 1
        rng_at_start = None
        try:
            if self._eval_pending:
                if not self._run_pending_eval():
                    self.console.print("stopped again; the evaluation stays pending in the checkpoint")
                    return self.logger.records
                if self.start_iteration > total:
                    self._save(updated)  # the finished run's checkpoint, without the pending mark
            if self.start_iteration > total:
                self.console.print(nothing_to_train_note(self.out, self.start_iteration - 1, total), style="yellow")
                return self.logger.records
            if t.eval_before_training and self.start_iteration == 1:
                try:
                    with self._droppable():
                        ev = self._evaluate_all(0)
                    self.last_eval = ev
                    self.logger.log(0, ev)
                except _Drop:
                    pass
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                          console=self.console, disable=not t.progress) as progress:
                task = progress.add_task("train", total=total, completed=self.start_iteration - 1, stats="")
                echo_on = False
                for it in range(self.start_iteration, total + 1):
                    if self.dist.initialized:
                        self._sync_stop()
                    if self._stop_requested:  # a signal before this iteration began (e.g. the initial eval)
                        if updated > last_saved:
                            self._save(updated)
                            last_saved = updated
                        self.console.print(f"stopped before iteration {it}" +
                                           ("" if updated > self.start_iteration - 1 else "; nothing new to save"))
                        break
                    t_it = time.perf_counter()
                    rng_at_start = rng_state()  # what a resume restores if this iteration is dropped
                    self._weights_touched = True  # until iteration() says its update has not begun
                    try:
                        metrics = self.iteration(it)
                    except _Drop:
                        if updated > last_saved:
                            self._save(updated, rng=rng_at_start)
                            last_saved = updated
                        self.console.print(f"stopped in iteration {it} before its update: dropped (a resume redoes "
                                           f"it); resume with `fastpo train --resume {self.out}`")
                        break
                    updated = it  # the weights now hold this iteration's update
                    if self.stop_after is not None and it >= self.stop_after:
                        self._stop_requested = True
                    if self.dist.initialized:  # every rank takes the same evaluate/save/stop decisions
                        self._sync_stop()
                    eval_pending, rng_before_eval = False, None
                    if t.eval_every and (it % t.eval_every == 0 or it == total):
                        rng_before_eval = rng_state()
                        ev = None
                        if not self._term_requested():
                            try:
                                with self._droppable():
                                    ev = self._evaluate_all(it)
                            except _Drop:
                                pass
                        if ev is None:  # SIGTERM: the resume runs it (the record gets it then)
                            eval_pending = True
                            self.console.print(f"evaluation of iteration {it} postponed to the resume")
                        else:
                            self.last_eval = ev
                            metrics.update(ev)
                    metrics["time/iteration_s"] = time.perf_counter() - t_it
                    metrics["echo_trap_warning"] = 0
                    rec = self.logger.log(it, metrics)
                    warn = self.echo.update(rec)
                    if warn:
                        self.logger.amend_last({"echo_trap_warning": 1})
                        if not echo_on:  # printed when it starts firing; the flag is in every record
                            self._warn(f"iteration {it}: {warn} (flagged as echo_trap_warning in "
                                       "metrics.jsonl while it lasts)")
                    echo_on = bool(warn)
                    stats = (f"success {metrics['train/success_rate']:.2f} | score {metrics['train/score_mean']:.3f} | "
                             f"entropy {metrics['train/rollout_entropy']:.2f} | {metrics['time/iteration_s']:.0f} s/it")
                    if "eval/success_rate" in metrics:
                        stats += f" | eval {metrics['eval/success_rate']:.2f}"
                    progress.update(task, completed=it, stats=stats)
                    if not t.progress:
                        self.console.print(f"iteration {it}/{total}: {stats}")
                    if t.plots and self.dist.is_main and (("eval/success_rate" in metrics) or it == total):
                        plot_curves(self.logger.records, os.path.join(self.out, "plots"), model_label=self.info.label)
                    if (t.save_every and it % t.save_every == 0) or it == total or self._stop_requested:
                        self._save(it, rng=rng_before_eval if eval_pending else None, eval_pending=eval_pending)
                        last_saved = it
                    if self._stop_requested and (it < total or eval_pending):
                        self.console.print(f"stopped after iteration {it}; resume with "
                                           f"`fastpo train --resume {self.out}`")
                        break
                    self.interrupted = False  # a Ctrl-C in the last iteration still finished the run
        except KeyboardInterrupt:
            # A second signal: the current iteration is incomplete; keep the last saved checkpoint.
            self.console.print(f"[yellow]aborted[/]; the last checkpoint is iteration {last_saved}")
            raise
        except Exception as e:
            # An error after an update (eval, logging, plots, disk) or before one began: keep the
            # trained iterations. (Not when the failure was that very save: it would fail again.)
            consistent = updated == it or not self._weights_touched
            if consistent and updated > last_saved and not isinstance(e, CheckpointSaveError):
                try:
                    self._save(updated, rng=rng_at_start if updated < it else None)
                    self.console.print(f"[red]error after iteration {updated}[/]: emergency checkpoint saved; "
                                       f"resume with `fastpo train --resume {self.out}`")
                except Exception as e2:  # the original error matters more than the failed save
                    self.console.print(f"[red]emergency checkpoint failed[/]: {e2}", markup=False)
            raise
        finally:
            self._droppable_now = False
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.logger.close()
            self._shutdown_engine()
            self._release_lock()
        if not self.dist.is_main:
            return self.logger.records
        if t.plots and self.logger.records:
            plot_curves(self.logger.records, os.path.join(self.out, "plots"), model_label=self.info.label)
        self.console.print(summary_table(self.logger.records, title=f"fastpo: {cfg.env.name}, {self.info.label}"))
        ba = before_after_table(self.logger.records, run_dir=self.out)
        if ba is not None:
            self.console.print(ba)
        held = [name for name in ("metrics.jsonl", "plots/", "eval/", "samples/", "checkpoints/")
                if os.path.exists(os.path.join(self.out, name))]  # plots off or no eval: not there
        self.console.print(f"outputs in {self.out}/: {', '.join(held)}")
        return self.logger.records


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def train(cfg: TrainConfig, resume: bool = False, console: Any = None, overwrite: bool = False,
          dist: fdist.DistContext = fdist.SINGLE) -> list[dict]:
    """Build a Trainer and run it; prints what the CPU preset scaled down.

    A new run (resume=False) refuses an output folder that already holds a run
    (FileExistsError) unless `overwrite` is true, which clears that run first. Raises
    Stopped (a KeyboardInterrupt) after a Ctrl-C or SIGTERM stop, once the checkpoint is saved.
    `dist`: this process's place in a data-parallel job (`fastpo.distributed.init_from_env`);
    the default is one process. Raises fastpo.distributed.DistributedError for a setting the
    data-parallel trainer does not support (`check_trainer_support`).
    """
    from rich.console import Console

    fdist.check_trainer_support(cfg, dist.world_size, torchrun=dist.initialized)
    console = console or Console(quiet=not dist.is_main)
    if "cpu" in cfg.preset.split(",") and dist.is_main:
        console.print(f"[cyan]{cpu_preset_note(cfg)}[/]")
    trainer = Trainer(cfg, resume=resume, console=console, overwrite=overwrite, dist=dist)
    records = trainer.run()
    if trainer.interrupted:
        raise Stopped(trainer.stop_signal)  # after the checkpoint: the CLI exits 130 (SIGINT) or 143 (SIGTERM)
    return records
