"""Set-up of a run: the run folder (locked, cleared or tidied), the prompts checked against the
context window before any model loads, the parts built (models, log-prob computer, updater, sampler,
checkpointer; `build_parts`), a checkpoint restored, the metrics logger started (`open_run`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from typing import Any, Optional

import numpy as np
import torch

from fastpo import rollout as ro
from fastpo.distributed.collectives import broadcast_modules, on_main

from fastpo.distributed.context import DistContext
from fastpo.envs import EnvError
from fastpo.rollout import sglang_engine
import fastpo.trainer.fsdp as ffsdp
from fastpo.run.checkpoint import load_checkpoint, load_state, plan_resume, tidy_run_folder
from fastpo.run.folder import (LOCK_FILE, RunLock, atomic_write_text, clear_run_folder, reuse_untrained_start,
                               run_folder_in_use, unsaved_note, untrained_start)
from fastpo.config.schema import TrainConfig
from fastpo.config.fields import ConfigError
from fastpo.config.files import dump_yaml, run_settings
from fastpo.report.metrics import EchoTrapDetector, MetricsLogger
from fastpo.model_loading import ModelLoadError, load_model_checked
from fastpo.seeds import iteration_seeds
from fastpo.trainer.lifecycle import Checkpointer
from fastpo.trainer.models import Models, load_models
from fastpo.trainer.old_logprob import resolve_old_logprob
from fastpo.trainer.plan import RunPlan
from fastpo.trainer.replay import RolloutSchedule
from fastpo.trainer.sampler import NothingToTrain, Sampler, make_engine
from fastpo.trainer.logprobs import LogProbComputer
from fastpo.trainer.update import PolicyUpdater


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


class RankRecords:
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


@dataclasses.dataclass
class Parts:
    """What a trainer is made of (`build_parts`, `open_run`): the plan, the models, the log-prob computer,
    the updater, the sampler, the checkpointer, the Echo-Trap detector, the reuse/replay
    schedule (None: a fresh batch each iteration), and, once the run is open, its metrics
    logger and where it starts (the loop's state restored from a checkpoint)."""

    plan: RunPlan
    models: Models
    logprobs: LogProbComputer
    updater: PolicyUpdater
    sampler: Sampler
    checkpointer: Checkpointer
    echo: EchoTrapDetector
    schedule: Any = None
    logger: Any = None
    start_iteration: int = 1
    last_eval: dict = dataclasses.field(default_factory=dict)
    eval_pending: bool = False


class SetupEnvError(ConfigError):
    """The user's game failed while the run was set up, before any model loaded (e.g. its reset
    on the first eval seed raised): bad input, as the game check of `load_config` finds it."""


def check_prompts_fit(cfg: TrainConfig, tokenizer: Any = None) -> Any:
    """Refuse, before any model loads, prompts that leave no room for one response turn: the
    first prompt of the first iteration's env groups and of the first eval seed (with the
    model's chat template and tokenizer: `tokenizer`, else loaded) plus rollout.max_new_tokens
    must fit in rollout.max_context. Returns the tokenizer; raises NothingToTrain (a
    ConfigError) naming both numbers, SetupEnvError (a ConfigError) when the game fails
    resetting those seeds."""
    r = cfg.rollout
    tok = load_model_checked(cfg.model.name, tokenizer_only=True) if tokenizer is None else tokenizer
    try:
        probe = ro.MultiTurnRollout.from_config(cfg, None, tok)
    except EnvError as e:
        raise SetupEnvError(f"{e} (at set-up, before any model loaded)") from None
    except ValueError as e:  # e.g. a tokenizer without a chat template
        raise ModelLoadError(f"model.name={cfg.model.name!r}: {e}") from None
    seeds = iteration_seeds(cfg.trainer.seed, 1, r.env_groups) + [cfg.trainer.eval_seed_offset]
    # every game of a mixture is evaluated on the first eval seed
    games = [(probe, seeds)] if not probe.mixed else \
        [(probe, seeds[:-1])] + [(probe.only(m.label), seeds[-1:]) for m, _ in probe.members]
    try:
        longest, name = max((max(ro_.prompt_lengths(s)), ro_.env_name) for ro_, s in games)
    except EnvError as e:  # the user's game failing here is bad input found at set-up, as in load_config's check
        raise SetupEnvError(f"{e} (at set-up, before any model loaded)") from None
    if longest + r.max_new_tokens > r.max_context:
        raise NothingToTrain(
            f"config key 'rollout.max_context' = {r.max_context}: the first prompt of {name} takes "
            f"{longest} tokens with {cfg.model.name}'s chat template, so no response of rollout.max_new_tokens = "
            f"{r.max_new_tokens} fits; raise rollout.max_context to at least {longest + r.max_new_tokens} "
            f"(or make the env's state smaller)")
    return tok


def prepare_folder(out: str, resume: bool, overwrite: bool, console) -> RunLock:
    """Lock the run folder `out`, clear it (a new run with `overwrite`) and tidy it after an
    interrupted write (rank 0 only); returns the held lock. Raises FileExistsError for a new
    run on a folder holding one without `overwrite`."""
    lock = RunLock(out).acquire()  # before anything in the folder is read or written
    try:
        if not resume:
            used = run_folder_in_use(out)
            if used and not overwrite:
                # never destroy a previous run by starting a new one on top of it
                raise FileExistsError(f"{out} already holds a run ({', '.join(used)}); resume it, "
                                      f"choose another output folder or pass overwrite=True (--overwrite)")
            if used:
                clear_run_folder(out)
            elif untrained_start(out):  # stopped or failed before its first checkpoint: no weights to keep
                note = unsaved_note(out)
                kept = reuse_untrained_start(out)
                console.print(f"{out}: reusing the folder of a run that stopped before its first "
                              f"checkpoint ({note}" + (f"; its metrics.jsonl is kept as {kept}" if kept else "")
                              + ")", markup=False, soft_wrap=True)
        tidied = tidy_run_folder(out)
        if tidied:
            console.print(f"{out}: after an interrupted write: {'; '.join(tidied)}", markup=False, soft_wrap=True)
        os.makedirs(out, exist_ok=True)
    except BaseException:
        lock.release()
        raise
    return lock


def build_parts(trainer, tok, ckpt: Optional[str], plan: RunPlan) -> Parts:
    """The parts of `trainer` (a Trainer or SFTTrainer: its cfg, dist, device, out, console,
    warn, trust_checkpoint) for `plan`, from tokenizer `tok` and checkpoint `ckpt` (None: a new
    run): models loaded, data-parallel replicas made equal (FSDP2: sharded), the optimizers,
    the engine, the old-log-prob source (into the plan), the rollout, log-prob computer, sampler and
    checkpointer, the Echo-Trap detector and the reuse/replay schedule."""
    cfg, dist, trust = trainer.cfg, trainer.dist, trainer.trust_checkpoint
    models = load_models(cfg, trainer.device, tok, ckpt, trust, trainer.console, plan)
    # data parallel: every replica starts from rank 0's weights (and stays equal: summed gradients)
    broadcast_modules(dist, models.policy, models.reference, models.critic_body, models.value_head)
    if dist.initialized and cfg.trainer.data_parallel == "fsdp":
        if ckpt is not None and models.value_head is not None:  # whole tensors, before sharding
            load_checkpoint(ckpt, critic_backbone=models.critic_body, value_head=models.value_head, trust=trust)
        # FSDP2: the policy, a separate critic and the value head sharded over the ranks (the
        # reference model stays whole on every rank: no gradient, no optimizer state)
        models.fsdp_root = ffsdp.shard_trainer_modules(dist, models.policy, models.critic_body, models.value_head)
    engine = make_engine(cfg, models)
    try:
        if plan.old_logprob_source is None:  # decided here: it depends on the engine
            source, why, warn = resolve_old_logprob(cfg.algorithm.old_logprob, engine, models.policy,
                                                    cfg.rollout.temperature, models.autocast_bf16)
            plan = dataclasses.replace(plan, old_logprob_source=source)
            line = f"old log-probs: {source} ({why})"
            if warn:
                trainer.warn(line)
            else:
                trainer.console.print(line)
        rollout = ro.MultiTurnRollout.from_config(cfg, engine, models.tokenizer)
        rollout.stop_check = trainer.stop.dropping  # a SIGTERM ends a rollout between turns
    except BaseException:
        if hasattr(engine, "shutdown"):  # a started SGLang server must not outlive the failed start
            engine.shutdown()
        raise
    logprobs = LogProbComputer(cfg, models, plan)
    updater = PolicyUpdater(cfg, dist, models, logprobs, plan, trainer.warn)
    sampler = Sampler(cfg, dist, models, engine, rollout, plan, trainer.out, trainer.warn, trainer.stop.dropping)
    checkpointer = Checkpointer(cfg, dist, models, updater.optimizers(), trainer.out, trainer.console)
    schedule = None  # rollout reuse (Online-K) and replay (fastpo.trainer.replay)
    if cfg.rollout.reuse > 1 or cfg.rollout.replay > 0:
        schedule = RolloutSchedule(cfg.rollout.reuse, cfg.rollout.replay, cfg.rollout.replay_fraction,
                                   cfg.train_batch_size, cfg.trainer.seed)
    echo = EchoTrapDetector(cfg.trainer.echo_trap_drop, cfg.trainer.echo_trap_window)
    return Parts(plan, models, logprobs, updater, sampler, checkpointer, echo, schedule)


def restore(parts: Parts, ckpt: str, dist: DistContext, trust: bool, console) -> None:
    """Resume from checkpoint `ckpt`: the optimizers' (sharded: gathered) state, RNG states,
    the loop's state and the reuse/replay schedule into `parts`."""
    m, opts = parts.models, parts.updater.optimizers()
    if m.fsdp_root is not None:  # the one-process optimizer state, sharded
        state = load_checkpoint(ckpt, rng=True, trust=trust)
        saved = load_state(ckpt, trust=trust)[1]
        for name, opt in opts.items():
            ffsdp.load_full_optimizer_state(dist, m.fsdp_root, opt, saved[name])
    else:
        state = load_checkpoint(ckpt, optimizers=opts, critic_backbone=m.critic_body, value_head=m.value_head,
                                rng=True, trust=trust)
    parts.start_iteration = int(state["iteration"]) + 1
    parts.last_eval = state.get("last_eval", {})
    parts.eval_pending = bool(state.get("eval_pending"))
    if parts.schedule is not None and state.get("rollout_schedule") is not None:
        parts.schedule.load_state_dict(state["rollout_schedule"])
    console.print(f"[bold]resumed[/] from {ckpt} at iteration {parts.start_iteration}")


def start_logger(trainer, parts: Parts, ckpt: Optional[str]) -> None:
    """The metrics logger (rank 0; the other ranks keep records in memory) into `parts`, and
    config.yaml (a resume with changed settings keeps the old ones beside it)."""
    cfg, c, out = trainer.cfg, trainer.console, trainer.out
    if not trainer.dist.is_main:  # the other ranks keep their records in memory, write nothing
        parts.logger = RankRecords()
        return
    parts.logger = MetricsLogger(out, cfg.trainer.ema_decay, cfg.trainer.tensorboard, cfg.trainer.wandb,
                                 resume_from=parts.start_iteration - 1 if ckpt is not None else None,
                                 run_name=os.path.basename(os.path.abspath(out)), config=cfg.to_dict(),
                                 model_label=parts.models.info.trained_label(), warn=trainer.warn,
                                 start_label=parts.models.info.label)
    for rec in parts.logger.records:
        parts.echo.update(rec)
    path, text = os.path.join(out, "config.yaml"), dump_yaml(cfg)
    if ckpt is not None and parts.start_iteration > cfg.trainer.iterations:
        return  # a finished run resumed with nothing to train: its config.yaml stays as it ran
    ran = os.path.join(ckpt, "config.yaml") if ckpt is not None else None
    if ran is not None and os.path.exists(ran) and run_settings(_read(ran)) != run_settings(text):
        # resumed with changed settings: keep beside the run those the checkpoint's iterations
        # ran with (from the checkpoint, so a failed resume in between cannot blur them)
        kept = os.path.join(out, f"config.until_iter_{parts.start_iteration - 1:06d}.yaml")
        if not os.path.exists(kept):
            shutil.copyfile(ran, kept)
        c.print(f"settings changed on resume: iterations up to {parts.start_iteration - 1} ran with {kept}")
    atomic_write_text(path, text)


def open_run(trainer, plan: RunPlan) -> Parts:
    """Open `trainer`'s run (a Trainer or SFTTrainer): prompts checked, seeds set, the folder
    locked and prepared (rank 0; `trainer.lock`), the resume planned, the parts built
    (`build_parts`), a checkpoint restored, the logger started. A start that fails (e.g. the
    model cannot load) stops what it started and leaves no empty output folder behind."""
    cfg, dist, out = trainer.cfg, trainer.dist, trainer.out
    created = not os.path.exists(out)
    parts = None
    try:
        if cfg.rollout.engine == "sglang":
            if not sglang_engine.sglang_available():  # before anything loads or is written
                raise ConfigError("config key 'rollout.engine' = 'sglang': needs CUDA and sglang "
                                  "(pip install 'fastpo[sglang]'); use rollout.engine=native on this machine")
        tok = trainer.check_prompts_fit()
        torch.manual_seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed % 2**32)

        def lock():  # rank 0 alone holds and writes the run folder; the others read it once it is ready
            trainer.lock = prepare_folder(out, trainer.resume, trainer.overwrite, trainer.console)

        on_main(dist, lock)
        ckpt = None
        if trainer.resume:
            rp = plan_resume(out, trust=trainer.trust_checkpoint)
            for note in (rp.note, rp.trust_note):
                if note:
                    trainer.warn(note)
            ckpt = rp.checkpoint
        trainer.parts = parts = build_parts(trainer, tok, ckpt, plan)
        if ckpt is not None:
            restore(parts, ckpt, dist, trainer.trust_checkpoint, trainer.console)
        start_logger(trainer, parts, ckpt)
        return parts
    except BaseException:
        if parts is not None:
            parts.sampler.shutdown()  # a started SGLang server must not outlive the failed start
            if parts.logger is not None:  # TensorBoard / wandb opened before the failure
                with contextlib.suppress(Exception):
                    parts.logger.close()
        empty = dist.is_main and created and os.path.isdir(out) and set(os.listdir(out)) <= {LOCK_FILE}
        trainer.release_lock(remove=empty)
        if empty:
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise
