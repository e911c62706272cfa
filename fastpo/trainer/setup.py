"""Set-up: the model(s), critic, optimizers, engine, rollout and logger, the run folder and
resume; generation and evaluation with the engine.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
from typing import Any, Optional

import numpy as np
import torch

from fastpo import distributed as fdist
from fastpo import fsdp as ffsdp
from fastpo.checkpoint import (LOCK_FILE, RunLock, atomic_write_text, clear_run_folder, load_checkpoint, load_state,
                               plan_resume, run_folder_in_use, tidy_run_folder, untrained_start)
from fastpo.config import ConfigError, dump_yaml, run_settings
from fastpo.evaluate import config_success_bounds, evaluate_config, write_json
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.models import ModelLoadError, check_lora_targets, load_model_checked
from fastpo.metrics import EchoTrapDetector, MetricsLogger, warn_user, write_samples
from fastpo.packing import packing_attention, use_segment_attention
from fastpo.registry import estimator
from fastpo.seeds import iteration_seeds
from fastpo.trainer.update import policy_loss_settings


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


class NothingToTrain(ConfigError):
    """The prompts leave no room for a response: the run would train on nothing."""


class ValueHead(torch.nn.Module):
    """Scalar value V(s_t) from a hidden state [.., H] -> [..] fp32 (zero-initialised output)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h.to(self.proj.weight.dtype)).squeeze(-1).float()


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


class Setup:
    """`Trainer`'s set-up: models, critic, optimizers, engine, rollout, logger, run folder and
    resume (`setup`); generation and evaluation with the engine."""

    def setup(self) -> None:
        """Load the model(s), build the critic, optimizers, engine, rollout and logger; restore a checkpoint.

        A start that fails (e.g. the model cannot load) leaves no empty output folder behind."""
        created = not os.path.exists(self.out)
        try:
            self._setup()
        except BaseException:
            self._shutdown_engine()  # a started SGLang server must not outlive the failed start
            logger = getattr(self, "logger", None)
            if logger is not None:  # TensorBoard / wandb opened before the failure
                with contextlib.suppress(Exception):
                    logger.close()
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
        cfg = self.cfg
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
        ckpt = None
        if self.resume:
            plan = plan_resume(self.out, trust=self.trust_checkpoint)
            for note in (plan.note, plan.trust_note):
                if note:
                    self._warn(note)
            ckpt = plan.checkpoint
        self.model, self.tokenizer = model, tok = self._load_models(tok, ckpt)
        self._build_trainables(ckpt)
        self._restore(ckpt)
        self._start_logger(ckpt)

    def _load_models(self, tok, ckpt: Optional[str]):
        """(policy model, tokenizer): the policy loaded (its checkpointed weights on resume), its
        packing attention set; the frozen reference model (KL term) and the critic (value head,
        and a separate critic's body) built beside it; LoRA adapters wrapped around it."""
        cfg, c = self.cfg, self.console
        dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
        if dtype is None:
            dtype = torch.float32  # fp32 master weights; CUDA runs the math under bf16 autocast
        t0 = time.perf_counter()
        model, tok, info = load_model_checked(cfg.model.name, device=str(self.device), dtype=dtype, tokenizer=tok)
        self.info = info
        try:  # the fused kernels compute plain linear heads only (fastpo.kernels.hf.lm_head_weight)
            lm_head_weight(model)
            decoder_body(model)
        except ValueError as e:
            raise ModelLoadError(f"model.name={cfg.model.name!r}: {e}") from None
        # packed rows attend per trajectory (sum of L_i^2, not N^2); generation still runs sdpa
        use_segment_attention(model)
        if cfg.rollout.context_window != "full" and packing_attention(model) == "varlen":
            raise ConfigError(f"config key 'rollout.context_window' = {cfg.rollout.context_window!r} needs a "
                              "per-token attention mask, which flash-attn's varlen packing cannot take; load the "
                              "model with sdpa or eager attention")
        if cfg.model.gradient_checkpointing:  # (transformers >= 5.2x renamed it; the old name warns)
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            # the KL term's reference is the run's starting model (model.name, which a resume
            # cannot change): copied before a checkpoint's weights load into the policy
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if ckpt is not None and cfg.model.lora_rank == 0:
            # (with LoRA the base stays frozen; only the adapter is restored, below)
            load_checkpoint(ckpt, model=model, trust=self.trust_checkpoint)
        self.load_seconds = time.perf_counter() - t0
        c.print(f"[bold]model[/] {info.label}: {info.num_params / 1e6:.1f}M parameters, {info.dtype}, "
                f"{self.device} (loaded in {self.load_seconds:.1f} s)")
        hidden = model.config.hidden_size
        a = cfg.algorithm
        self.critic_body = None
        self.value_head = None
        if estimator(a.adv_estimator).needs_critic:
            self.value_head = ValueHead(hidden).to(self.device)
            if a.critic == "separate":
                # A copy of the policy's architecture (initialised from the policy, as RAGEN/verl do).
                self.critic_body = copy.deepcopy(decoder_body(model)).to(self.device)
                self.critic_body.requires_grad_(True)
        if cfg.model.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            check_lora_targets(model, cfg.model.lora_target_modules, cfg.model.name)  # peft's error is a traceback
            model = get_peft_model(model, LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                                                     lora_dropout=cfg.model.lora_dropout,
                                                     target_modules=list(cfg.model.lora_target_modules),
                                                     task_type="CAUSAL_LM"))
            if ckpt is not None:
                load_checkpoint(ckpt, model=model, trust=self.trust_checkpoint)  # the adapter
        return model, tok

    def _build_trainables(self, ckpt: Optional[str]) -> None:
        """Data-parallel replicas made equal (FSDP2: sharded), the optimizers, the policy loss
        settings, the engine and rollout, the Echo-Trap detector and the reuse/replay schedule."""
        cfg, model, tok, a = self.cfg, self.model, self.tokenizer, self.cfg.algorithm
        from fastpo import rollout as ro

        # data parallel: every replica starts from rank 0's weights (and stays equal: summed gradients)
        fdist.broadcast_modules(self.dist, model, self.ref_model, self.critic_body, self.value_head)
        if self.dist.initialized and cfg.trainer.data_parallel == "fsdp":
            if ckpt is not None and self.value_head is not None:  # whole tensors, before sharding
                load_checkpoint(ckpt, critic_backbone=self.critic_body, value_head=self.value_head,
                                trust=self.trust_checkpoint)
            # FSDP2: the policy, a separate critic and the value head sharded over the ranks (the
            # reference model stays whole on every rank: no gradient, no optimizer state)
            self._fsdp_root = ffsdp.shard_trainer_modules(self.dist, model, self.critic_body, self.value_head)
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

    def _restore(self, ckpt: Optional[str]) -> None:
        """Resume: the optimizers' (sharded: gathered) state, RNG states, the loop's state and the
        reuse/replay schedule from checkpoint `ckpt` (None: a new run)."""
        c = self.console
        if ckpt is not None and self._fsdp_root is not None:  # the one-process optimizer state, sharded
            state = load_checkpoint(ckpt, rng=True, trust=self.trust_checkpoint)
            saved = load_state(ckpt, trust=self.trust_checkpoint)[1]
            for name, opt in self._optimizers().items():
                ffsdp.load_full_optimizer_state(self.dist, self._fsdp_root, opt, saved[name])
        elif ckpt is not None:
            state = load_checkpoint(ckpt, optimizers=self._optimizers(), critic_backbone=self.critic_body,
                                    value_head=self.value_head, rng=True, trust=self.trust_checkpoint)
        if ckpt is not None:
            self.start_iteration = int(state["iteration"]) + 1
            self.last_eval = state.get("last_eval", {})
            self._eval_pending = bool(state.get("eval_pending"))
            if self.schedule is not None and state.get("rollout_schedule") is not None:
                self.schedule.load_state_dict(state["rollout_schedule"])
            c.print(f"[bold]resumed[/] from {ckpt} at iteration {self.start_iteration}")

    def _start_logger(self, ckpt: Optional[str]) -> None:
        """The metrics logger (rank 0; the other ranks keep records in memory) and config.yaml
        (a resume with changed settings keeps the old ones beside it)."""
        cfg, c = self.cfg, self.console
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
            elif untrained_start(self.out):  # stopped or failed before its first checkpoint: nothing to keep
                self.console.print(f"{self.out}: reusing the folder of a run that stopped before its first "
                                   "checkpoint (nothing was trained there)", markup=False, soft_wrap=True)
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

    def evaluate(self, it: int) -> dict:
        """Success rate and pass@k on the fixed eval seeds at the eval temperature, with the
        best and the random policy's success on the same seeds and horizon beside it
        (`eval/optimal_success`, `eval/random_success`, computed once); writes samples and the
        per-trajectory outcomes. Several processes: collective, every rank evaluates its share
        of the seeds (`evaluate_config`), rank 0 writes the files, each rank's seed count and
        rollout seconds are `dist/rank<R>/eval_seeds` and `eval_rollout_s`, and every rank
        gets the metrics."""
        t = self.cfg.trainer
        t0 = time.perf_counter()
        with self._engine_awake():
            res, batch = evaluate_config(self.rollout, self.cfg, autocast=self._autocast, model=self.model,
                                         dist=self.dist)
        ranks = res.pop("_ranks")
        per_traj = res.pop("_per_trajectory")

        def record() -> dict:
            if self._success_bounds is None:  # fixed seeds: computed once (a Sokoban search past its cap: none)
                self._success_bounds = config_success_bounds(self.cfg, warn=self._warn)
            res.update(self._success_bounds)
            # per-trajectory outcomes, for the paired before/after comparison (metrics.before_after)
            write_json(os.path.join(self.out, "eval", f"iter_{it:06d}.json"), per_traj)
            write_samples(os.path.join(self.out, "samples"), it, batch.texts()[: max(1, t.num_samples)],
                          header=f"eval at iteration {it}: success rate {res['eval/success_rate']:.3f} "
                                 f"(temperature {t.eval_temperature}, {t.eval_seeds} seeds)",
                          model_label=self.info.label)
            if self.dist.initialized:
                for r, info in enumerate(ranks):
                    res[f"dist/rank{r}/eval_seeds"] = info["seeds"]
                    res[f"dist/rank{r}/eval_rollout_s"] = info["seconds"]
            res["time/eval_s"] = time.perf_counter() - t0
            return res

        return fdist.on_main(self.dist, record)

    def collapse_metrics(self, batch) -> dict:
        """`collapse/*` (fastpo/collapse.py) of a rollout batch's first turns, scored by the
        current policy at the rollout temperature with the trainer's packing and kernels."""
        from fastpo.collapse import batch_collapse_metrics

        r = self.cfg.rollout
        return batch_collapse_metrics(self.model, self.tokenizer, batch, think=r.think, temperature=r.temperature,
                                      token_budget=self.cfg.optim.micro_token_budget,
                                      share_prompt=self.cfg.optim.share_prefix, impl=self.cfg.trainer.kernel_impl,
                                      autocast=self._autocast)
