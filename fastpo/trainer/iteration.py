"""One StarPO iteration as named steps: rollout, filter, old log-probs, advantages, off-policy
data (reuse, replay, importance-sampling correction), update (`StarPOIteration.run`).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional

import numpy as np
import torch

from fastpo import algorithms as alg
from fastpo.memory import held_state_mib, peak_memory_mib
from fastpo.distributed.collectives import all_reduce, gather_to_main, masked_mean, masked_whiten, on_main, per_rank, weighted_means
from fastpo.distributed.context import DistContext
from fastpo.distributed.data_parallel import global_dynamic_filter, global_filter, rank_seeds
import fastpo.trainer.fsdp as ffsdp
from fastpo.memory import release_free_memory
from fastpo.report.metrics import rollout_metrics
from fastpo.judge import judge_from_config
from fastpo.rewards import RewardFunction
from fastpo.registry import estimator
from fastpo.seeds import rollout_sampling_seed
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.lifecycle import StopControl
from fastpo.trainer.setup import NothingToTrain, Parts


def _pad(rows: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-trajectory 1-D tensors -> [B, T] right-padded with zeros (False)."""
    out = torch.zeros(len(rows), max((int(x.numel()) for x in rows), default=0), dtype=dtype)
    for i, x in enumerate(rows):
        out[i, : x.numel()] = x.to(dtype)
    return out


class Advantages:
    """Step 4's estimator: per-trajectory advantages (and returns) of a batch under `cfg`'s
    algorithm and `plan` (the KL on the reward or not); data parallel: batch statistics over
    every rank of `dist`. Needs no model: `Advantages(cfg, fastpo.distributed.context.SINGLE,
    rl_plan(cfg, False)).compute(...)` works on hand-made batches."""

    def __init__(self, cfg, dist: DistContext, plan):
        self.cfg, self.dist, self.plan = cfg, dist, plan

    def compute(self, batch, masks, vals, old_lp=None, ref=None) -> tuple[list, Optional[list], dict]:
        """Per-trajectory advantages (and returns for PPO), [T_i] fp32 each, zero off the loss mask.

        Estimators (algorithm.adv_estimator): gae (critic), reinforce_pp (token returns
        normalised over the batch), and the group ones on trajectory scores: grpo, drgrpo,
        rloo, reinforce_pp_baseline (fastpo.algorithms.advantages).
        With algorithm.kl_coef > 0 and the KL on the reward (`RunPlan.kl_in_reward`), old_lp
        and ref (the policy's and the reference model's log-probs, [T_i] each) give each model
        token's KL, subtracted (times kl_coef) from its reward before GAE or REINFORCE++, or,
        for the group estimators, from the trajectory's score (the sum of its token rewards)
        before the group baseline.
        """
        a = self.cfg.algorithm
        spec = estimator(a.adv_estimator)
        B = len(masks)
        if B == 0:  # a process whose env groups the filter all dropped (data parallel)
            return self._empty_advantages(spec)
        T = max(int(mask.numel()) for mask in masks)
        M = torch.zeros(B, T, dtype=torch.bool)
        for i, mask in enumerate(masks):
            M[i, : mask.numel()] = mask
        metrics: dict = {}
        KL = None
        if self.plan.kl_coef > 0 and self.plan.kl_in_reward and ref is not None:
            KL, metrics["train/kl_reward"] = self._token_kl(M, old_lp, ref)
        ctx = self.dist
        inputs = alg.AdvantageInputs(M, batch.group_ids, gamma=a.gamma, lam=a.lam, whiten_advantages=a.whiten_advantages,
                                     batch_mean=functools.partial(masked_mean, ctx),
                                     batch_whiten=functools.partial(masked_whiten, ctx))
        if spec.needs_turns:
            inputs.turn, inputs.high_level_gamma = self._turns(batch, M), a.high_level_gamma
        if spec.token_level:  # token rewards
            R = self._token_rewards(batch, M)
            inputs.rewards = R if KL is None else R - a.kl_coef * KL
        else:
            inputs.scores = batch.scores.float() if KL is None else batch.scores.float() - a.kl_coef * KL.sum(1)
        if spec.needs_critic:
            inputs.values = torch.zeros(B, T)
            for i, v in enumerate(vals):
                inputs.values[i, : v.numel()] = v
        # (data parallel: batch statistics over every rank's tokens)
        out = alg.estimate_advantages(a.adv_estimator, inputs)
        adv = out.advantages
        metrics.update(out.metrics)
        returns = None if out.returns is None else [out.returns[i, : masks[i].numel()] for i in range(B)]
        metrics["train/advantage_mean"] = float(adv[M].mean()) if M.any() else 0.0
        metrics["train/advantage_std"] = float(adv[M].std()) if int(M.sum()) > 1 else 0.0
        return [adv[i, : masks[i].numel()] for i in range(B)], returns, metrics

    def _empty_advantages(self, spec) -> tuple[list, Optional[list], dict]:
        """No trajectory on this process: it still joins the batch statistics, in the order the
        other ranks compute them."""
        ctx, a = self.dist, self.cfg.algorithm
        if not spec.batch_statistics:
            return [], None, {}
        empty, none = torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.bool)
        if not spec.needs_critic:
            masked_whiten(ctx, empty, none, unbiased=True)
            return [], None, {}
        m = {"critic/return_mean": masked_mean(ctx, empty, none),
             "critic/value_mean": masked_mean(ctx, empty, none)}
        if a.whiten_advantages:
            masked_whiten(ctx, empty, none)
        return [], [], m

    def _token_kl(self, M: torch.Tensor, old_lp: list, ref: list) -> tuple[torch.Tensor, float]:
        """(each model token's KL to the reference [B, T], verl's critic/kl: the mean over
        trajectories of each one's mean token KL)."""
        a = self.cfg.algorithm
        B, T = M.shape
        LP, REF = torch.zeros(B, T), torch.zeros(B, T)
        for i in range(B):
            LP[i, : old_lp[i].numel()] = old_lp[i]
            REF[i, : ref[i].numel()] = ref[i]
        _, KL = alg.apply_kl_penalty(torch.zeros(B, T), LP, REF, M, a.kl_coef, a.kl_estimator)
        n = M.sum(1)
        return KL, float((KL.sum(1)[n > 0] / n[n > 0]).mean()) if bool((n > 0).any()) else 0.0

    @staticmethod
    def _turns(batch, M: torch.Tensor) -> torch.Tensor:
        """Each token's turn [B, T] int64 (-1 off the responses and in the padding)."""
        turn = torch.full(M.shape, -1, dtype=torch.long)
        for i, t in enumerate(batch.turn_index):
            t = torch.as_tensor(t)
            turn[i, : t.numel()] = t
        return turn

    def _token_rewards(self, batch, M: torch.Tensor) -> torch.Tensor:
        """The token-level estimators' rewards [B, T]: each trajectory's score on its last model
        token, or each turn's reward on that turn's (algorithm.reward_position)."""
        a = self.cfg.algorithm
        turn = self._turns(batch, M) if a.reward_position == "turn" else None
        # turn_rewards already hold each turn's env reward plus its format penalty
        turn_rewards = batch.turn_rewards.float() if a.reward_position == "turn" else None
        return alg.place_rewards(M, batch.scores.float(), a.reward_position, turn, turn_rewards)

class StarPOIteration:
    """StarPO / StarPO-S iterations (RAGEN, arXiv 2504.20073, Alg. 1) on a trainer's parts:
    `run(it)` reads top to bottom as the steps of fastpo.trainer's docstring, each step a
    method that takes and returns values. `warn(text)`: the run's user warnings."""

    def __init__(self, cfg, dist: DistContext, parts: Parts, stop: StopControl, warn):
        self.cfg, self.dist, self.parts, self.stop, self.warn = cfg, dist, parts, stop, warn
        self.models, self.plan, self.schedule = parts.models, parts.plan, parts.schedule
        self.advantages = Advantages(cfg, dist, parts.plan)
        judge = None
        if parts.models.judge is not None:
            judge = judge_from_config(cfg.reward, parts.models.judge, parts.models.judge_tokenizer)
        self.reward_fn = None
        if cfg.reward.fn or judge is not None:
            self.reward_fn = RewardFunction(cfg.reward.fn, cfg.reward.mode, cfg.env.name, judge=judge)
        self.reward_fn_totals: dict = {}  # this iteration's sums of RewardFunction.apply's figures

    def run(self, it: int) -> Optional[dict]:
        """One StarPO iteration as named steps on one batch record; returns its metrics, or None
        when a SIGTERM dropped it before its update (nothing has changed: the rollout ends
        between turns, `StopControl`). Raises NothingToTrain when no trajectory had room for a
        response. One process and N run the same steps (fastpo.distributed: one process is a
        world of one)."""
        if self.schedule is not None and not self.schedule.needs_rollout(it):
            return self.reuse_iteration(it)
        tm: dict[str, float] = {}
        self.reward_fn_totals = {}
        self.parts.sampler.take_weight_sync_seconds()
        self.stop.iteration_begins()
        items = None
        # FSDP2: whole parameters on every rank from the rollout to the advantages (generation,
        # old log-probs and collapse metrics run different forward counts on each rank)
        with ffsdp.gathered(self.models.fsdp_root):
            rolled = self.rollout_step(it, tm)
            if rolled is None:  # a SIGTERM ended the rollout
                return None
            full, metrics, generated = rolled
            rollout, filt = self.filter_step(full, metrics)
            t1 = time.perf_counter()
            batch = TrainBatch.from_rollout(rollout, it)
            recomputed = self.parts.scorer.old_logprobs(rollout, batch)
            tm["time/old_logprob_s"] = time.perf_counter() - t1
            metrics["train/old_logprob_from_sampler"] = float(batch.old_logprobs is batch.sample_logprobs)
            metrics.update(self.token_metrics(batch, recomputed))
            if filt.kept_groups:
                t2 = time.perf_counter()
                self.advantage_step(rollout, batch, metrics)
                tm["time/advantage_s"] = time.perf_counter() - t2
                if self.schedule is not None or self.cfg.algorithm.is_correction != "none":
                    rollout_m = dict(metrics)  # what the iterations reusing this batch log again
                    if self.schedule is not None:
                        items = batch.rows()
                    batch = self.off_policy(it, metrics, batch, fresh=True)
        if self.stop.drop_before_update():  # every rank drops this iteration before its update
            return None
        if not filt.kept_groups:
            a = self.cfg.algorithm
            which = "dynamic sampling" if self.plan.filter_mode == "dynamic" else f"the {a.filter_strategy} filter"
            self.warn(f"iteration {it}: {which} kept no env group "
                      f"({filt.zero_std_groups} of {len(filt.group_std)} without reward spread); update skipped")
            metrics.update({"actor/updates": 0, "actor/skipped_updates": 0, **tm})
            return metrics
        if items is not None:  # past the drop point: a dropped iteration leaves the schedule as it was
            self.schedule.start(it, items, rollout_m)
        self.update_step(it, metrics, tm, batch)
        if self.dist.initialized:  # each rank's own figures (a data-parallel job's report)
            metrics.update(self.per_rank_figures(tm, len(batch)))
        metrics["perf/rollout_tokens_per_s"] = generated / max(tm["time/rollout_s"], 1e-9)
        metrics.update(tm)
        return metrics

    def rollout_step(self, it: int, tm: dict):
        """Step 1: roll out this process's env groups; (the TrajectoryBatch, the rollout metrics
        of the whole batch, generated tokens), or None when a SIGTERM ended the rollout. Times
        into `tm`."""
        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        ctx = self.dist
        # this process's whole env groups, their seeds and ids as in one process
        group_ids, seeds = rank_seeds(cfg.trainer.seed, it, r.env_groups, ctx.world_size, ctx.rank)
        # each group its own sampling stream, else one stream for the whole batch (RunPlan)
        extra = {"group_ids": group_ids} if self.plan.per_group_streams else {}
        full = self.parts.sampler.generate(seeds, r.group_size, r.temperature,
                                           seed=rollout_sampling_seed(cfg.trainer.seed, it), **extra)
        release_free_memory()  # the engine's freed KV buffers and temporaries, back to the system
        if self.stop.dropping():
            return None
        full, draws = self.rescored(full), {}
        if self.plan.filter_mode == "dynamic":
            full, draws = self.dynamic_draws(it, full)
            if full is None:
                return None
        sync_s = self.parts.sampler.take_weight_sync_seconds()
        tm["time/rollout_s"] = time.perf_counter() - t0 - sync_s
        tm["time/weight_sync_s"] = sync_s
        turns = int(all_reduce(ctx, [int(full.num_turns.sum())])[0])
        longest = int(all_reduce(ctx, [max(int(x.numel()) for x in full.input_ids)], "max")[0])
        if not turns:
            raise NothingToTrain(
                f"iteration {it}: no trajectory had room for a response (prompts of up to {longest} tokens, "
                f"config key 'rollout.max_context' = {r.max_context}); raise rollout.max_context to at least "
                f"{longest + r.max_new_tokens}")
        every = cfg.trainer.collapse_every
        collapse = bool(every and (it == 1 or it % every == 0))
        metrics, generated, collapse_s = self.batch_metrics(full, collapse)
        metrics.update(draws)
        metrics.update(self.overlong_step(full))
        if self.reward_fn is not None:
            metrics.update(self.reward_metrics())
        if collapse:
            tm["time/collapse_s"] = collapse_s
        return full, metrics, generated

    def rescored(self, batch):
        """`batch` with reward.fn's value and the judge's score on its turn rewards and scores (in
        place; fastpo.rewards), counted into this iteration's reward_fn_totals; unchanged
        without either."""
        if self.reward_fn is not None and len(batch.scores):
            for k, v in self.reward_fn.apply(batch).items():
                self.reward_fn_totals[k] = self.reward_fn_totals.get(k, 0.0) + v
        return batch

    def reward_metrics(self) -> dict:
        """This iteration's reward.fn and judge figures over every process: train/reward_fn_mean
        (per trajectory; with reward.fn), train/judge_score_mean and train/judge_unparsed_rate
        (per judged trajectory), train/judge_too_long and time/judge_s (with a judge)."""
        keys = ["reward_fn_sum", "count"]
        if self.reward_fn.judge is not None:
            keys += ["judged", "judge_score_sum", "judge_unparsed", "judge_too_long", "judge_seconds"]
        tot = dict(zip(keys, all_reduce(self.dist, [self.reward_fn_totals.get(k, 0.0) for k in keys])))
        out = {}
        if self.reward_fn.fn is not None:
            out["train/reward_fn_mean"] = tot["reward_fn_sum"] / max(tot["count"], 1.0)
        if self.reward_fn.judge is not None:
            n = max(tot["judged"], 1.0)
            out.update({"train/judge_score_mean": tot["judge_score_sum"] / n,
                        "train/judge_unparsed_rate": tot["judge_unparsed"] / n,
                        "train/judge_too_long": tot["judge_too_long"],
                        "time/judge_s": tot["judge_seconds"] / max(self.dist.world_size, 1)})
        return out

    def overlong_step(self, full) -> dict:
        """DAPO's overlong shaping on this process's trajectories, in place, after the rollout
        metrics (which stay the game's): each turn's penalty (`overlong_penalty`) added to its
        turn reward and the trajectory's score. The filtering half (algorithm.overlong_filter:
        the turns cut at rollout.max_new_tokens out of the loss) is `overlong_filtered`, after
        the advantages, so that a cut turn's reward, its penalty included, still reaches the
        earlier turns' credit. Returns train/overlong_penalty_mean (per trajectory) and
        train/overlong_filtered_turns (both over every process)."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        if not a.overlong_buffer and not a.overlong_filter:
            return {}
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
        n, total, cut = all_reduce(self.dist, [len(full.responses), total, cut])
        out = {}
        if a.overlong_buffer:
            out["train/overlong_penalty_mean"] = total / n if n else 0.0
        if a.overlong_filter:
            out["train/overlong_filtered_turns"] = cut
        return out

    def dynamic_draws(self, it: int, first):
        """DAPO's dynamic sampling, the drawing half: more rollouts of `rollout.env_groups`
        fresh env groups (`fastpo.seeds.dynamic_draw_seeds`; group ids continuing after the
        earlier draws'; with several processes each rolls out its share of them, as of the
        iteration's own groups) while fewer than `rollout.env_groups` groups of the whole
        batch have rewards that vary, at most `algorithm.dynamic_max_draws` rollouts in all.
        Returns (every trajectory this process drew, in one batch; train/dynamic_draws and
        train/dynamic_varying_groups: the rollouts made and the varying groups found, global),
        or (None, None) when a SIGTERM ended a draw."""
        from fastpo.algorithms.filtering import group_reward_std, varying_groups
        from fastpo.distributed.data_parallel import gather_group_stds, split_groups
        from fastpo.rollout.batch import TrajectoryBatch
        from fastpo.seeds import dynamic_draw_seeds

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
            b = self.parts.sampler.generate(seeds, r.group_size, r.temperature, seed=sampling_seed, **extra)
            if self.stop.dropping():
                return None, None
            b = self.rescored(b)
            if not self.plan.per_group_streams:  # one stream: the rollout numbered its groups from 0
                b = dataclasses.replace(b, group_ids=b.group_ids + draw * r.env_groups)
            batches.append(b)
            release_free_memory()
            found = varying()
        return TrajectoryBatch.concat(batches), {"train/dynamic_draws": float(len(batches)),
                                                 "train/dynamic_varying_groups": float(found)}

    def filter_step(self, full, metrics: dict):
        """Step 2: StarPO-S over every process's env groups; (the kept trajectories, the
        FilterResult). With no group kept (top_p's threshold not reached, or only zero-std
        groups dropped) the full batch is still scored for its metrics, then the update is
        skipped."""
        a = self.cfg.algorithm
        if self.plan.filter_mode == "dynamic":
            filt = global_dynamic_filter(self.dist, full.scores.float(), full.group_ids, self.cfg.rollout.env_groups)
        else:
            filt = global_filter(self.dist, full.scores.float(), full.group_ids, a.filter_ratio, self.plan.filter_mode,
                                 a.filter_strategy, a.filter_top_p_mode, a.filter_eps, a.filter_keep_zero_std)
        kept = filt.indices.numel()
        rollout = full if not filt.kept_groups or kept == len(full.input_ids) else full.select(filt.indices)
        metrics["train/filter_kept_ratio"] = filt.kept_ratio
        metrics["train/in_group_reward_std_kept"] = filt.std_after
        metrics["train/filter_zero_std_groups"] = filt.zero_std_groups
        return rollout, filt

    def advantage_step(self, rollout, batch: TrainBatch, metrics: dict) -> None:
        """Step 4: advantages (and returns) into `batch`, per env group on each process, batch
        statistics over every process; RAGEN's soft reweighting by the group's reward std."""
        batch.advantages, batch.returns, am = self.compute_advantages(rollout, batch.loss_mask, batch.values,
                                                                      batch.old_logprobs, batch.ref_logprobs)
        if self.cfg.algorithm.overlong_filter:
            self.overlong_filtered(rollout, batch)
        metrics.update(self.advantage_metrics(batch.advantages, batch.loss_mask, am))
        if self.cfg.algorithm.soft_advantage_reweight:  # the largest group std over every process
            w, wm = self.soft_weights(rollout)
            batch.advantages = [x * w[i] for i, x in enumerate(batch.advantages)]
            metrics.update(wm)

    @staticmethod
    def overlong_filtered(rollout, batch: TrainBatch) -> None:
        """DAPO's overlong filtering, in place: the tokens of every turn that stopped at the
        length limit leave `batch`'s loss masks (and their advantages are zeroed), after the
        advantages were computed over the whole trajectory (`overlong_step`)."""
        if not rollout.turn_stop_reasons:
            return
        for i, reasons in enumerate(rollout.turn_stop_reasons):
            turn = torch.as_tensor(rollout.turn_index[i])
            batch.loss_mask[i] = alg.truncated_turn_mask(batch.loss_mask[i], turn, reasons)
            batch.advantages[i] = batch.advantages[i] * batch.loss_mask[i]

    def update_step(self, it: int, metrics: dict, tm: dict, batch: TrainBatch) -> None:
        """Step 5, the update phase: `PolicyUpdater.update`, its metrics into `metrics` and its
        time into `tm`; the sampler told the weights changed."""
        self.stop.update_begins()
        t3 = time.perf_counter()
        um, train_tokens = self.parts.updater.update(it, batch)
        self.parts.sampler.weights_changed()  # a separate engine (SGLang) loads them before it next generates
        um.pop("actor/pg_loss_micro", None)
        metrics.update(um)
        tm["time/update_s"] = time.perf_counter() - t3
        metrics["perf/train_tokens_per_s"] = train_tokens / max(tm["time/update_s"], 1e-9)

    def compute_advantages(self, batch, masks, vals, old_lp=None, ref=None) -> tuple[list, Optional[list], dict]:
        """`Advantages.compute` with this run's settings."""
        return self.advantages.compute(batch, masks, vals, old_lp, ref)

    def batch_metrics(self, full, collapse: bool) -> tuple[dict, float, float]:
        """(rollout metrics, generated tokens, collapse seconds) of the global batch: every
        rank's trajectories are gathered to rank 0, which computes `rollout_metrics` (and the
        collapse metrics when `collapse`) on their concatenation, as one process would; the
        result is shared with every rank."""
        from fastpo.rollout.batch import TrajectoryBatch

        pieces = gather_to_main(self.dist, dataclasses.replace(full, tokenizer=None))

        def compute():
            whole = pieces[0] if len(pieces) == 1 else TrajectoryBatch.concat(pieces)
            whole.tokenizer = self.models.tokenizer
            m = rollout_metrics(whole, prefix="train")
            t_c, secs = time.perf_counter(), 0.0
            if collapse:
                m.update(self.parts.sampler.collapse_metrics(whole))
                secs = time.perf_counter() - t_c
            gen = float(whole.metrics.get("generated_tokens",
                                          sum(int(torch.as_tensor(x).sum()) for x in whole.loss_mask)))
            return m, gen, secs

        return on_main(self.dist, compute)

    def token_metrics(self, batch: TrainBatch, recomputed) -> dict:
        """train/logprob_gap_mean|max and train/rollout_entropy over every rank's scored tokens
        (sums in float64); `recomputed`: the trainer's log-probs, or None."""
        masks, samp, ent = batch.loss_mask, batch.sample_logprobs, batch.entropies
        allm = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
        e = torch.cat(ent)[allm].double() if masks else torch.zeros(0, dtype=torch.float64)
        out = {}
        # (a rank without trajectories may not know whether the others recomputed log-probs)
        if all_reduce(self.dist, [float(recomputed is not None)], "max")[0]:
            gap = ((torch.cat(recomputed) - torch.cat(samp))[allm].abs().double() if masks and recomputed is not None
                   else torch.zeros(0, dtype=torch.float64))
            n, total = all_reduce(self.dist, [gap.numel(), float(gap.sum())])
            top = all_reduce(self.dist, [float(gap.max()) if gap.numel() else 0.0], "max")[0]
            out["train/logprob_gap_mean"] = total / n if n else 0.0
            out["train/logprob_gap_max"] = top if n else 0.0
        n, total = all_reduce(self.dist, [e.numel(), float(e.sum())])
        out["train/rollout_entropy"] = total / n if n else 0.0
        return out

    def advantage_metrics(self, adv, masks, local: dict) -> dict:
        """`compute_advantages`' batch metrics over every rank: the mean and sample std (n - 1)
        of the advantages on scored tokens, and the KL-in-reward mean over trajectories."""
        x = torch.cat([a[m] for a, m in zip(adv, masks)]).double() if masks else torch.zeros(0, dtype=torch.float64)
        n, s1, s2 = all_reduce(self.dist, [x.numel(), float(x.sum()), float((x * x).sum())])
        out = dict(local)
        mean = s1 / n if n else 0.0
        out["train/advantage_mean"] = mean
        out["train/advantage_std"] = float(np.sqrt(max(0.0, (s2 - n * mean * mean) / (n - 1)))) if n > 1 else 0.0
        if self.plan.kl_coef > 0 and self.plan.kl_in_reward:
            with_tokens = sum(1 for m in masks if bool(m.any()))
            out["train/kl_reward"] = weighted_means(self.dist, {"kl": local.get("train/kl_reward", 0.0)},
                                                          with_tokens)["kl"]
        return out

    def soft_weights(self, batch) -> tuple[torch.Tensor, dict]:
        """`soft_advantage_weights` of this rank's trajectories with the largest group std of
        the global batch, and train/soft_reweight_min|max|mean over every rank's trajectories."""
        from fastpo.algorithms.filtering import group_reward_std

        scores = batch.scores.float()
        local = max(group_reward_std(scores, batch.group_ids).values(), default=0.0) if len(scores) else 0.0
        top = all_reduce(self.dist, [local], "max")[0]
        w = alg.soft_advantage_weights(scores, batch.group_ids, top=top) if len(scores) else torch.zeros(0)
        n, total = all_reduce(self.dist, [w.numel(), float(w.double().sum())])
        lo = -all_reduce(self.dist, [-float(w.min()) if w.numel() else -np.inf], "max")[0]
        hi = all_reduce(self.dist, [float(w.max()) if w.numel() else -np.inf], "max")[0]
        return w, {"train/soft_reweight_min": lo, "train/soft_reweight_max": hi,
                   "train/soft_reweight_mean": total / n if n else 0.0}

    def per_rank_figures(self, tm: dict, trajectories: int) -> dict:
        """Each rank's phase times (seconds), peak memory (MiB), trajectories trained on (after
        the filter) and the parameters and optimizer state it holds of the trained modules (MiB:
        the whole model replicated, about 1/N of it under FSDP2) as dist/rank<R>/<name>."""
        out = {}
        for r, v in enumerate(per_rank(self.dist, trajectories)):
            out[f"dist/rank{r}/trajectories"] = int(v)
        for key in ("time/rollout_s", "time/old_logprob_s", "time/update_s"):
            for r, v in enumerate(per_rank(self.dist, tm.get(key, 0.0))):
                out[f"dist/rank{r}/{key[5:]}"] = v
        for r, v in enumerate(per_rank(self.dist, peak_memory_mib(self.models.device))):
            out[f"dist/rank{r}/peak_memory_mib"] = v
        held = held_state_mib(self.models.trained(), self.parts.updater.optimizers().values())
        for name, value in zip(("parameter_mib", "optimizer_state_mib"), held):
            for r, v in enumerate(per_rank(self.dist, value)):
                out[f"dist/rank{r}/{name}"] = v
        return out

    def reuse_iteration(self, it: int) -> Optional[dict]:
        """An iteration inside a reuse cycle (rollout.reuse = K > 1): no rollout; the batch the
        cycle's first iteration sampled is trained on again with its old log-probs (those of
        the policy that sampled it), advantages and rollout metrics (logged again, with
        `rollout/reuse_index` 1..K-1), plus this iteration's replayed trajectories. None when
        a SIGTERM dropped it before its update."""
        tm: dict[str, float] = {"time/rollout_s": 0.0, "time/weight_sync_s": 0.0}
        self.parts.sampler.take_weight_sync_seconds()
        self.stop.iteration_begins()
        t1 = time.perf_counter()
        metrics = dict(self.schedule.metrics)
        batch = self.off_policy(it, metrics, TrainBatch.from_rows(self.schedule.current))
        tm["time/old_logprob_s"] = time.perf_counter() - t1
        if self.stop.drop_before_update():
            return None
        self.update_step(it, metrics, tm, batch)
        metrics.update(tm)
        return metrics

    def off_policy(self, it: int, metrics: dict, batch: TrainBatch, fresh: bool = False) -> TrainBatch:
        """Mix this iteration's replayed trajectories into `batch` and apply the importance-
        sampling correction (algorithm.is_correction); `fresh`: the batch was just rolled out
        (the schedule takes it after the last drop point). Returns the batch to train on
        (replayed trajectories appended, `is_weights` set with a correction; with "mis",
        trajectories left with no token dropped); metrics into `metrics`.

        Replayed trajectories keep their sampler log-probs, advantages and returns; their old
        log-probs (the ratio's anchor), values and reference log-probs are the current
        models', so the weights pi_old / pi_sampler correct the policy lag (decoupled PPO)."""
        a, sched = self.cfg.algorithm, self.schedule
        rep = sched.replayed(it, len(batch), fresh) if sched is not None else []
        if sched is not None:
            metrics["rollout/reuse_index"] = sched.reuse_index(it, fresh)
            metrics["replay/size"] = len(sched.pool(fresh))
            metrics["replay/trajectories"] = len(rep)
            if rep:
                metrics["replay/age_mean"] = float(np.mean([it - x["iteration"] for x in rep]))
        if rep:
            old = TrainBatch.from_rows(rep)
            old.old_logprobs, _, r_vals, r_ref = self.parts.scorer.compute_old(old)
            old.values = None if batch.values is None else r_vals
            old.ref_logprobs = None if batch.ref_logprobs is None else r_ref
            old.returns = None if batch.returns is None else old.returns
            # (entropies are the rollout's metric, not trained on)
            batch = TrainBatch.concat([dataclasses.replace(batch, entropies=None), old])
        corr = alg.rollout_correction(_pad(batch.old_logprobs), _pad(batch.sample_logprobs),
                                      _pad(batch.loss_mask, torch.bool), a.is_correction, a.is_level, a.is_cap)
        for k in ("is_ratio_mean", "is_ratio_max", "is_ratio_min", "is_weight_mean", "is_truncated_frac"):
            metrics[f"actor/{k}"] = corr.metrics[k]
        metrics["rollout/mismatch_kl"] = corr.metrics["mismatch_kl"]
        if a.is_correction == "none":
            return batch
        n = [int(x.numel()) for x in batch.input_ids]
        batch.is_weights = [corr.weights[i, : n[i]] for i in range(len(batch))]
        if a.is_correction == "mis":  # dropped tokens leave the loss (and the loss's normalisation)
            batch.loss_mask = [corr.keep[i, : n[i]] for i in range(len(batch))]
            kept = [i for i in range(len(batch)) if bool(batch.loss_mask[i].any())]
            if len(kept) < len(batch):
                batch = batch.select(kept)
        return batch
