"""The StarPO trainer (RAGEN, arXiv 2504.20073, Alg. 1): one iteration read top to bottom
(`Trainer.iteration`: rollout -> filter -> batch -> old log-probs -> advantages -> update, each
step a call into its part), and `train`, what `fastpo train` runs.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from fastpo.config.presets import cpu_preset_note
from fastpo.config.schema import TrainConfig
from fastpo.distributed.context import DistContext, SINGLE
from fastpo.distributed.data_parallel import global_dynamic_filter, global_filter
from fastpo.distributed.launch import check_trainer_support
from fastpo.judge import judge_from_config
from fastpo.memory import held_state_mib, peak_memory_mib
from fastpo.rewards import RewardFunction
import fastpo.trainer.fsdp as ffsdp
from fastpo.trainer.batch_advantages import Advantages
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.lifecycle import Stopped
from fastpo.trainer.loop import RunLoop, RunTrainer
from fastpo.trainer.metric_sums import MetricSums
from fastpo.trainer.plan import rl_plan
from fastpo.trainer.replay import off_policy_batch
from fastpo.trainer.logprobs import token_sums
from fastpo.trainer.setup import open_run


class Trainer(RunTrainer):
    """Runs StarPO / StarPO-S for `cfg.trainer.iterations` iterations into `cfg.trainer.output_dir`
    (arguments: `fastpo.trainer.loop.RunTrainer`). After `setup()` its parts are `parts`
    (fastpo.trainer.setup.Parts: models, sampler, logprobs, updater, ...) and `advantages`
    (`fastpo.trainer.batch_advantages.Advantages`); `iteration(it)` runs one StarPO iteration."""

    progress_fields = (("success", "train/success_rate", ".2f"), ("score", "train/score_mean", ".3f"),
                       ("entropy", "train/rollout_entropy", ".2f"))

    def setup(self) -> None:
        """Load the model(s), build the critic, optimizers, engine, rollout and logger; restore a
        checkpoint (`fastpo.trainer.setup.open_run`); reward.fn and the LLM judge on the training
        batches. A start that fails leaves no empty output folder behind."""
        cfg = self.cfg
        if cfg.rollout.group_size == 1 and cfg.algorithm.filter_mode != "none":
            self.warn(f"algorithm.filter_mode={cfg.algorithm.filter_mode} with rollout.group_size=1: "
                      "the in-group reward std is undefined with one trajectory per env group, so StarPO-S "
                      "filtering is skipped (every group is trained on)")
        parts = open_run(self, rl_plan(cfg, self.dist.initialized))
        judge = None
        if parts.models.judge is not None:
            judge = judge_from_config(cfg.reward, parts.models.judge, parts.models.judge_tokenizer)
        if cfg.reward.fn or judge is not None:
            parts.sampler.rewards = RewardFunction(cfg.reward.fn, cfg.reward.mode, cfg.env.name, judge=judge)
        self.advantages = Advantages(cfg, self.dist, parts.plan)

    def iteration(self, it: int) -> Optional[dict]:
        """One StarPO iteration; its metrics, or None when a SIGTERM dropped it before its update
        (nothing changed: a resume redoes it identically). Raises NothingToTrain when no
        trajectory had room for a response. One process and N run the same steps (one is a
        world of one: the collectives are identities); each step records its figures of this
        process's share into one MetricSums, reduced over the processes once, at the end."""
        p, stop = self.parts, self.stop
        stop.iteration_begins()
        sums = MetricSums()
        skip = reuse = None
        fresh = p.schedule is None or p.schedule.needs_rollout(it)
        if not fresh:  # rollout.reuse = K > 1
            batch, tm = self.reused_batch(it, sums)
        else:
            # FSDP2: whole parameters on every rank up to the update (the ranks' forward counts differ)
            with ffsdp.gathered(p.models.fsdp_root):
                # 1. rollout: this process's env groups, rescored, and their figures
                rolled = p.sampler.roll_out(it, sums)
                if rolled is None:  # a SIGTERM ended it
                    return None
                full, tm = rolled
                # 2. filter: StarPO-S keeps the env groups with the largest in-group reward std
                rollout, filt = self.filter(full, sums)
                # 3. batch: the trajectories to train on, one record
                t1 = time.perf_counter()
                batch = TrainBatch.from_rollout(rollout, it)
                # 4. old log-probs (and values, reference log-probs): the sampler's or recomputed
                recomputed = p.logprobs.old_logprobs(rollout, batch)
                tm["time/old_logprob_s"] = time.perf_counter() - t1
                token_sums(batch, recomputed, sums)
                if not filt.kept_groups:
                    skip = filt
                else:
                    # 5. advantages (and returns), then off-policy data: reuse, replay, IS weights
                    t2 = time.perf_counter()
                    self.advantages.estimate(rollout, batch, sums)
                    tm["time/advantage_s"] = time.perf_counter() - t2
                    if p.schedule is not None:  # what the iterations reusing this batch train on and log
                        reuse = (it, batch.rows(), sums.copy())
                    if p.schedule is not None or self.cfg.algorithm.is_correction != "none":
                        batch = off_policy_batch(self.cfg, p.schedule, p.logprobs, it, sums, batch, fresh=True)
        if stop.drop_before_update():
            return None
        if skip is not None:
            return self.skipped(it, skip, sums, tm)
        if reuse is not None:  # past the drop point: a dropped iteration leaves the schedule as it was
            p.schedule.start(*reuse[:2])
        # 6. update: PPO's epochs over the batch (the weights change from here on)
        stop.update_begins()
        t3 = time.perf_counter()
        sums.merge(p.updater.update(it, batch), replace=True)  # (its critic/value_mean replaces the batch's)
        p.sampler.weights_changed()  # a separate engine (SGLang) loads them before it next generates
        tm["time/update_s"] = time.perf_counter() - t3
        if self.dist.initialized and fresh:  # each rank's own figures (a data-parallel job's report)
            per_rank_figures(self, tm, len(batch), sums)
        metrics = sums.reduce(self.dist)  # the iteration's one reduction
        if reuse is not None:  # the figures the iterations reusing this batch log again (one process)
            p.schedule.metrics = {k: v for k, v in reuse[2].reduce(self.dist).items() if not k.startswith("perf/")}
        return {**metrics, **tm}

    def filter(self, full, sums: MetricSums):
        """Step 2: StarPO-S over every process's env groups (DAPO's dynamic sampling: the
        varying ones); (the kept trajectories, the FilterResult), its figures (global) into
        `sums`. With no group kept the full batch is still scored for its metrics, then the
        update is skipped."""
        a = self.cfg.algorithm
        if self.parts.plan.filter_mode == "dynamic":
            filt = global_dynamic_filter(self.dist, full.scores.float(), full.group_ids, self.cfg.rollout.env_groups)
        else:
            filt = global_filter(self.dist, full.scores.float(), full.group_ids, a.filter_ratio,
                                 self.parts.plan.filter_mode, a.filter_strategy, a.filter_top_p_mode, a.filter_eps,
                                 a.filter_keep_zero_std)
        kept = filt.indices.numel()
        rollout = full if not filt.kept_groups or kept == len(full.input_ids) else full.select(filt.indices)
        sums.value("train/filter_kept_ratio", filt.kept_ratio)
        sums.value("train/in_group_reward_std_kept", filt.std_after)
        sums.value("train/filter_zero_std_groups", filt.zero_std_groups)
        return rollout, filt

    def skipped(self, it: int, filt, sums: MetricSums, tm: dict) -> dict:
        """The metrics of iteration `it` whose filter kept no env group: no update (said)."""
        a = self.cfg.algorithm
        which = "dynamic sampling" if self.parts.plan.filter_mode == "dynamic" else f"the {a.filter_strategy} filter"
        self.warn(f"iteration {it}: {which} kept no env group "
                  f"({filt.zero_std_groups} of {len(filt.group_std)} without reward spread); update skipped")
        sums.value("actor/updates", 0)
        sums.value("actor/skipped_updates", 0)
        return {**sums.reduce(self.dist), **tm}

    def reused_batch(self, it: int, sums: MetricSums) -> tuple:
        """Steps 1-5 of an iteration inside a reuse cycle (rollout.reuse = K > 1): no rollout;
        the batch the cycle's first iteration sampled, trained on again with its old log-probs
        (those of the policy that sampled it), advantages and rollout metrics (logged again,
        with `rollout/reuse_index` 1..K-1), plus this iteration's replayed trajectories.
        Returns (batch, phase seconds); the figures into `sums`."""
        p = self.parts
        tm: dict[str, float] = {"time/rollout_s": 0.0, "time/weight_sync_s": 0.0}
        t1 = time.perf_counter()
        for k, v in p.schedule.metrics.items():  # (the figures its rollout iteration logged)
            sums.value(k, v)
        batch = off_policy_batch(self.cfg, p.schedule, p.logprobs, it, sums, TrainBatch.from_rows(p.schedule.current))
        tm["time/old_logprob_s"] = time.perf_counter() - t1
        return batch, tm


def per_rank_figures(trainer: Trainer, tm: dict, trajectories: int, sums: MetricSums) -> None:
    """Each rank's phase times (seconds), peak memory (MiB), trajectories trained on (after
    the filter) and the parameters and optimizer state it holds of the trained modules (MiB:
    the whole model replicated, about 1/N of it under FSDP2), into `sums` as dist/rank<R>/<name>."""
    models = trainer.parts.models
    sums.per_rank("trajectories", trajectories)
    for key in ("time/rollout_s", "time/old_logprob_s", "time/update_s"):
        sums.per_rank(key[5:], tm.get(key, 0.0))
    sums.per_rank("peak_memory_mib", peak_memory_mib(models.device))
    held = held_state_mib(models.trained(), trainer.parts.updater.optimizers().values())
    for name, value in zip(("parameter_mib", "optimizer_state_mib"), held):
        sums.per_rank(name, value)

def train(cfg: TrainConfig, resume: bool = False, console: Any = None, overwrite: bool = False,
          dist: DistContext = SINGLE, trust_checkpoint: bool = False) -> list[dict]:
    """Build a Trainer and run it; prints what the CPU preset scaled down.

    A new run (resume=False) refuses an output folder that already holds a run
    (FileExistsError) unless `overwrite` is true, which clears that run first. Raises
    Stopped (a KeyboardInterrupt) after a Ctrl-C or SIGTERM stop, once the checkpoint is saved.
    `dist`: this process's place in a data-parallel job (`fastpo.distributed.context.init_from_env`);
    the default is one process. Raises fastpo.distributed.context.DistributedError for a setting the
    data-parallel trainer does not support (`check_trainer_support`). `trust_checkpoint`
    (`--trust-checkpoint`): a resume may load checkpoint files that need full unpickling
    (an older fastpo's), with a warning; without it they raise
    fastpo.run.checkpoint.UntrustedCheckpoint (a ConfigError naming the file).
    """
    from rich.console import Console

    check_trainer_support(cfg, dist.world_size, torchrun=dist.initialized)
    console = console or Console(quiet=not dist.is_main)
    if "cpu" in cfg.preset.split(",") and dist.is_main:
        console.print(f"[cyan]{cpu_preset_note(cfg)}[/]")
    trainer = Trainer(cfg, resume=resume, console=console, overwrite=overwrite, dist=dist,
                      trust_checkpoint=trust_checkpoint)
    records = RunLoop(trainer).run()
    if trainer.stop_state.interrupted:
        raise Stopped(trainer.stop_state.signum)  # after the checkpoint: the CLI exits 130 (SIGINT) or 143 (SIGTERM)
    return records
