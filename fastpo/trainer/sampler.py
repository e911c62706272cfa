"""The rollout runner: the generation engine and the multi-turn rollout over it, for an
iteration's training batch (`Sampler.roll_out`: its env groups, rewards and metrics), for plain
batches (`generate`) and for the evaluation on the fixed eval seeds (`evaluate`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from typing import Callable, Optional

import torch

from fastpo import algorithms as alg
from fastpo import rollout as ro
from fastpo.algorithms.filtering import group_reward_std, varying_groups
from fastpo.config.fields import ConfigError
from fastpo.config.schema import TrainConfig
from fastpo.distributed.collectives import all_reduce, gather_to_main, on_main
from fastpo.distributed.context import DistContext
from fastpo.distributed.data_parallel import gather_group_stds, rank_seeds, split_groups
from fastpo.evaluation.policy import config_success_bounds, evaluate_config
from fastpo.memory import release_free_memory
from fastpo.report.metrics import rollout_sums, write_samples
from fastpo.rollout.sglang_engine import SGLangEngine
from fastpo.rollout.trajectory_batch import TrajectoryBatch
from fastpo.run.folder import write_json
from fastpo.seeds import dynamic_draw_seeds, rollout_sampling_seed
from fastpo.trainer.collapse import batch_collapse_metrics
from fastpo.trainer.metric_sums import MetricSums
from fastpo.trainer.models import Models
from fastpo.trainer.plan import RunPlan


class NothingToTrain(ConfigError):
    """The prompts leave no room for a response: the run would train on nothing."""


def make_engine(cfg: TrainConfig, models: Models):
    """The generation engine of `rollout.engine`: the native one samples from the policy module
    itself; SGLang's holds a copy, refreshed by `Sampler.awake` after each update."""
    model, tok = models.policy, models.tokenizer
    if cfg.rollout.engine == "native":
        return ro.NativeEngine(model, tok)
    import tempfile

    # SGLang loads the weights from an HF folder once; later updates go as tensors, so the
    # folder (a full copy of the model) lives only until the engine has started
    folder = tempfile.mkdtemp(prefix="fastpo-sglang-")
    try:
        return SGLangEngine.from_model(model, tok, folder, mem_fraction_static=cfg.rollout.sglang_mem_fraction,
                                       dtype="float32" if cfg.model.dtype == "float32" else "bfloat16")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Sampler:
    """Trajectories from the current policy: an iteration's training batch (`roll_out`), a plain
    batch (`generate`) and the evaluation on the fixed eval seeds (`evaluate`), the engine kept
    in step with the trained weights (`weights_changed`).

    `rollout`: a `fastpo.rollout.MultiTurnRollout` over `engine`; `out`: the run folder (eval
    outcomes and samples are written there); `warn(text)`: the run's user warnings;
    `stopping()`: whether a stop asks the work under way to end (the rollout's `stop_check`,
    asked between turns; the caller then drops the work). `rewards`: reward.fn and the LLM
    judge (`fastpo.rewards.RewardFunction`) rescoring the training batches, or None."""

    def __init__(self, cfg: TrainConfig, dist: DistContext, models: Models, engine, rollout, plan: RunPlan,
                 out: str, warn: Callable[[str], None], stopping: Callable[[], bool] = lambda: False):
        self.cfg, self.dist, self.models, self.engine, self.rollout = cfg, dist, models, engine, rollout
        self.plan, self.out, self.warn, self.stopping = plan, out, warn, stopping
        self.rewards = None
        self.reward_totals: dict = {}  # this iteration's sums of RewardFunction.apply's figures
        self._released = self._stale = False
        self.weight_sync_seconds = 0.0  # since the last `take_weight_sync_seconds`
        self._success_bounds: Optional[dict] = None  # eval/optimal_success, eval/random_success (fixed seeds)

    def take_weight_sync_seconds(self) -> float:
        """Seconds spent loading new weights into the engine since the last call."""
        s, self.weight_sync_seconds = self.weight_sync_seconds, 0.0
        return s

    def weights_changed(self) -> None:
        """After an update: an engine with its own copy (SGLang) loads them before it next generates."""
        self._stale = True

    def shutdown(self) -> None:
        """Stop an engine that runs its own processes (SGLang); the native one has none."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    @contextlib.contextmanager
    def awake(self):
        """Around generation: an engine that frees its GPU memory for training (SGLang) takes
        it back and loads the weights of the last update first, and frees it again after."""
        if not hasattr(self.engine, "release_memory"):
            yield  # the native engine is the trained module: nothing to move
            return
        if self._released:
            self.engine.resume_memory()
            self._released = False
        if self._stale:
            t0 = time.perf_counter()
            self.engine.update_weights(self.models.policy)
            self._stale = False
            self.weight_sync_seconds += time.perf_counter() - t0
        try:
            yield
        finally:
            self.engine.release_memory()
            self._released = True

    def roll_out(self, it: int, sums: MetricSums) -> Optional[tuple]:
        """Step 1 of a StarPO iteration: this process's env groups of iteration `it` rolled out
        (their seeds and ids as in one process; DAPO's extra draws with algorithm.filter_mode
        dynamic), rescored by `rewards`; the rollout's figures into `sums` (this process's
        share: `fastpo.report.metrics.rollout_sums`, and perf/rollout_tokens_per_s: the
        processes' rates added; the collapse metrics at iteration 1 and
        every trainer.collapse_every, on the whole batch gathered to rank 0), then DAPO's
        overlong shaping. Returns (the TrajectoryBatch, {"time/rollout_s", "time/weight_sync_s"
        (, "time/collapse_s")}), or None when `stopping()` ended it (the caller drops the
        iteration). Raises NothingToTrain when no trajectory had room for a response."""
        cfg, r, ctx = self.cfg, self.cfg.rollout, self.dist
        self.take_weight_sync_seconds()  # (an evaluation's since the last rollout is not this rollout's)
        t0 = time.perf_counter()
        self.reward_totals = {}
        group_ids, seeds = rank_seeds(cfg.trainer.seed, it, r.env_groups, ctx.world_size, ctx.rank)
        # each group its own sampling stream, else one stream for the whole batch (RunPlan)
        extra = {"group_ids": group_ids} if self.plan.per_group_streams else {}
        full = self.generate(seeds, r.group_size, r.temperature, seed=rollout_sampling_seed(cfg.trainer.seed, it),
                             **extra)
        release_free_memory()  # the engine's freed KV buffers and temporaries, back to the system
        if self.stopping():
            return None
        full, draws = self.rescored(full), {}
        if self.plan.filter_mode == "dynamic":
            full, draws = self.dynamic_draws(it, full)
            if full is None:
                return None
        sync_s = self.take_weight_sync_seconds()
        tm = {"time/rollout_s": time.perf_counter() - t0 - sync_s, "time/weight_sync_s": sync_s}
        # any turn on any process, and the longest prompt for the message (one collective)
        turns, longest = all_reduce(ctx, [int(full.num_turns.sum()), max(int(x.numel()) for x in full.input_ids)],
                                    "max")
        if not turns:
            raise NothingToTrain(
                f"iteration {it}: no trajectory had room for a response (prompts of up to {int(longest)} tokens, "
                f"config key 'rollout.max_context' = {r.max_context}); raise rollout.max_context to at least "
                f"{int(longest) + r.max_new_tokens}")
        rollout_sums(full, sums, prefix="train")
        generated = full.metrics.get("generated_tokens", sum(int(torch.as_tensor(x).sum()) for x in full.loss_mask))
        sums.total("perf/rollout_tokens_per_s", float(generated) / max(tm["time/rollout_s"], 1e-9))
        for k, v in draws.items():
            sums.value(k, v)
        every = cfg.trainer.collapse_every
        if every and (it == 1 or it % every == 0):
            tm["time/collapse_s"] = self.collapse_figures(full, sums)
        overlong_shaping(cfg, full, sums)
        if self.rewards is not None:
            self.reward_sums(sums)
        return full, tm

    def rescored(self, batch):
        """`batch` with reward.fn's value and the judge's score on its turn rewards and scores (in
        place; fastpo.rewards), counted into this iteration's `reward_totals`; unchanged
        without either."""
        if self.rewards is not None and len(batch.scores):
            for k, v in self.rewards.apply(batch).items():
                self.reward_totals[k] = self.reward_totals.get(k, 0.0) + v
        return batch

    def reward_sums(self, sums: MetricSums) -> None:
        """This iteration's reward.fn and judge figures into `sums`: train/reward_fn_mean (per
        trajectory; with reward.fn), train/judge_score_mean and train/judge_unparsed_rate (per
        judged trajectory), train/judge_too_long (a count) and time/judge_s (the processes'
        mean) with a judge."""
        tot = self.reward_totals
        if self.rewards.fn is not None:
            sums.mean("train/reward_fn_mean", tot.get("reward_fn_sum", 0.0), tot.get("count", 0.0))
        if self.rewards.judge is not None:
            judged = tot.get("judged", 0.0)
            sums.mean("train/judge_score_mean", tot.get("judge_score_sum", 0.0), judged)
            sums.mean("train/judge_unparsed_rate", tot.get("judge_unparsed", 0.0), judged)
            sums.total("train/judge_too_long", tot.get("judge_too_long", 0.0))
            sums.mean("time/judge_s", tot.get("judge_seconds", 0.0), 1)

    def dynamic_draws(self, it: int, first) -> tuple:
        """DAPO's dynamic sampling, the drawing half: more rollouts of `rollout.env_groups`
        fresh env groups (`fastpo.seeds.dynamic_draw_seeds`; group ids continuing after the
        earlier draws'; with several processes each rolls out its share of them, as of the
        iteration's own groups) while fewer than `rollout.env_groups` groups of the whole
        batch have rewards that vary, at most `algorithm.dynamic_max_draws` rollouts in all.
        Returns (every trajectory this process drew, in one batch; train/dynamic_draws and
        train/dynamic_varying_groups: the rollouts made and the varying groups found, global),
        or (None, None) when `stopping()` ended a draw."""
        cfg, r, ctx = self.cfg, self.cfg.rollout, self.dist
        batches = [first]
        mine = list(split_groups(r.env_groups, ctx.world_size, ctx.rank))  # every group in one process

        def varying() -> int:  # over every process's groups (collective)
            stds = group_reward_std(torch.cat([b.scores.float() for b in batches]),
                                    torch.cat([b.group_ids for b in batches]))
            return len(varying_groups(gather_group_stds(ctx, stds)))

        found = varying()
        while len(batches) < cfg.algorithm.dynamic_max_draws and found < r.env_groups:
            draw = len(batches)
            seeds, sampling_seed = dynamic_draw_seeds(cfg.trainer.seed, it, draw, r.env_groups)
            seeds = [seeds[g] for g in mine]
            ids = [draw * r.env_groups + g for g in mine]
            extra = {"group_ids": ids} if self.plan.per_group_streams else {}
            b = self.generate(seeds, r.group_size, r.temperature, seed=sampling_seed, **extra)
            if self.stopping():
                return None, None
            b = self.rescored(b)
            if not self.plan.per_group_streams:  # one stream: the rollout numbered its groups from 0
                b = dataclasses.replace(b, group_ids=b.group_ids + draw * r.env_groups)
            batches.append(b)
            release_free_memory()
            found = varying()
        return TrajectoryBatch.concat(batches), {"train/dynamic_draws": float(len(batches)),
                                                 "train/dynamic_varying_groups": float(found)}

    def collapse_figures(self, full, sums: MetricSums) -> float:
        """The collapse metrics (`collapse_metrics`) of the whole batch into `sums`: every rank's
        trajectories gathered to rank 0, which scores their first turns (the matrix of every
        prompt against every response needs all of them in one place) and shares the figures.
        Returns the seconds it took on rank 0."""
        pieces = gather_to_main(self.dist, dataclasses.replace(full, tokenizer=None))

        def compute() -> tuple:
            whole = pieces[0] if len(pieces) == 1 else TrajectoryBatch.concat(pieces)
            whole.tokenizer = self.models.tokenizer
            t0 = time.perf_counter()
            return self.collapse_metrics(whole), time.perf_counter() - t0

        figures, seconds = on_main(self.dist, compute)
        for k, v in figures.items():
            sums.value(k, v)
        return seconds

    def generate(self, seeds: list[int], group_size: int, temperature: float, seed: int,
                 group_ids: Optional[list[int]] = None):
        """Roll out env groups `seeds` x group_size (a TrajectoryBatch); `group_ids` (global
        ids): each group samples from its own stream (rollout.sampling_streams), else one
        stream for the batch (sampling seed `seed`)."""
        m = self.models
        m.policy.eval()
        # old log-probs from the sampler: a critic on the policy's trunk reads its values off
        # the sampling pass's hidden states, so no pass over the batch is left to do
        readout = (self.plan.old_logprob_source == "sampler" and m.value_head is not None
                   and m.critic_body is None and hasattr(self.engine, "readout"))
        if readout:
            self.engine.readout = m.value_head
        try:
            with torch.no_grad(), m.autocast(), self.awake():
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
        gets the metrics. Returns {} when `stopping()` ended it (nothing written)."""
        t = self.cfg.trainer
        t0 = time.perf_counter()
        with self.awake():
            res, batch = evaluate_config(self.rollout, self.cfg, autocast=self.models.autocast,
                                         model=self.models.policy, dist=self.dist)
        if self.stopping():  # ended early: the caller drops it, nothing is written
            return {}
        ranks = res.pop("_ranks")
        per_traj = res.pop("_per_trajectory")

        def record() -> dict:
            if self._success_bounds is None:  # fixed seeds: computed once (a Sokoban search past its cap: none)
                self._success_bounds = config_success_bounds(self.cfg, warn=self.warn)
            res.update(self._success_bounds)
            # per-trajectory outcomes, for the paired before/after comparison (metrics.before_after)
            write_json(os.path.join(self.out, "eval", f"iter_{it:06d}.json"), per_traj)
            write_samples(os.path.join(self.out, "samples"), it, batch.texts()[: max(1, t.num_samples)],
                          header=f"eval at iteration {it}: success rate {res['eval/success_rate']:.3f} "
                                 f"(temperature {t.eval_temperature}, {t.eval_seeds} seeds)",
                          model_label=self.models.info.label if it == 0 else self.models.info.trained_label())
            if self.dist.initialized:
                for r, info in enumerate(ranks):
                    res[f"dist/rank{r}/eval_seeds"] = info["seeds"]
                    res[f"dist/rank{r}/eval_rollout_s"] = info["seconds"]
            res["time/eval_s"] = time.perf_counter() - t0
            return res

        return on_main(self.dist, record)

    def collapse_metrics(self, batch) -> dict:
        """`collapse/*` (fastpo/trainer/collapse.py) of a rollout batch's first turns, scored by the
        current policy at the rollout temperature with the trainer's packing and kernels."""
        r = self.cfg.rollout
        return batch_collapse_metrics(self.models.policy, self.models.tokenizer, batch, think=r.think,
                                      temperature=r.temperature, token_budget=self.cfg.optim.micro_token_budget,
                                      share_prompt=self.cfg.optim.share_prefix, impl=self.cfg.trainer.kernel_impl,
                                      autocast=self.models.autocast)


def overlong_shaping(cfg: TrainConfig, full, sums: MetricSums) -> None:
    """DAPO's overlong shaping on this process's trajectories `full` (a TrajectoryBatch), in
    place, after the rollout metrics (which stay the game's): each turn's penalty
    (`fastpo.algorithms.overlong_penalty`) added to its turn reward and the trajectory's score.
    The filtering half (algorithm.overlong_filter: the turns cut at rollout.max_new_tokens out
    of the loss) is `fastpo.trainer.batch_advantages.overlong_filtered`, after the advantages, so
    that a cut turn's reward, its penalty included, still reaches the earlier turns' credit.
    Records train/overlong_penalty_mean (per trajectory) and train/overlong_filtered_turns (a
    count) into `sums`."""
    a, r = cfg.algorithm, cfg.rollout
    if not a.overlong_buffer and not a.overlong_filter:
        return
    total, cut = 0.0, 0
    for i, turns in enumerate(full.responses):
        if a.overlong_buffer and turns:
            pen = alg.overlong_penalty(torch.tensor([len(x) for x in turns]), r.max_new_tokens, a.overlong_buffer,
                                       a.overlong_penalty_factor)
            full.turn_rewards[i, : len(turns)] += pen.to(full.turn_rewards.dtype)
            full.scores[i] += pen.sum().to(full.scores.dtype)
            total += float(pen.sum())
        if a.overlong_filter and full.turn_stop_reasons:
            cut += sum(1 for why in full.turn_stop_reasons[i] if why == "length")
    if a.overlong_buffer:
        sums.mean("train/overlong_penalty_mean", total, len(full.responses))
    if a.overlong_filter:
        sums.total("train/overlong_filtered_turns", cut)
