"""One StarPO iteration as named steps: rollout, filter, old log-probs, advantages, off-policy
data (reuse, replay, importance-sampling correction), update.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional

import numpy as np
import torch

from fastpo import algorithms as alg
from fastpo import distributed as fdist
from fastpo import fsdp as ffsdp
from fastpo.memory import release_free_memory
from fastpo.metrics import rollout_metrics
from fastpo.registry import estimator
from fastpo.seeds import rollout_sampling_seed
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.lifecycle import _Drop
from fastpo.trainer.setup import NothingToTrain


def _pad(rows: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-trajectory 1-D tensors -> [B, T] right-padded with zeros (False)."""
    out = torch.zeros(len(rows), max((int(x.numel()) for x in rows), default=0), dtype=dtype)
    for i, x in enumerate(rows):
        out[i, : x.numel()] = x.to(dtype)
    return out


class Iteration:
    """`Trainer`'s iteration: the named steps on one batch record (`iteration`), advantages
    (`compute_advantages`), reuse and replay (`_off_policy`) and the batch-wide metrics."""

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
        spec = estimator(a.adv_estimator)
        B = len(masks)
        ctx = self.dist
        if B == 0:  # a process whose env groups the filter all dropped (data parallel): it
            # still joins the batch statistics, in the order the other ranks compute them
            if not spec.batch_statistics:
                return [], None, {}
            empty, none = torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.bool)
            if not spec.needs_critic:
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
        inputs = alg.AdvantageInputs(M, batch.group_ids, gamma=a.gamma, lam=a.lam, whiten_advantages=a.whiten_advantages,
                                     batch_mean=functools.partial(fdist.masked_mean, ctx),
                                     batch_whiten=functools.partial(fdist.masked_whiten, ctx))
        if spec.token_level:  # token rewards
            turn = None
            if a.reward_position == "turn":
                turn = torch.full((B, T), -1, dtype=torch.long)
                for i, t in enumerate(batch.turn_index):
                    t = torch.as_tensor(t)
                    turn[i, : t.numel()] = t
            # turn_rewards already hold each turn's env reward plus its format penalty
            turn_rewards = batch.turn_rewards.float() if a.reward_position == "turn" else None
            R = alg.place_rewards(M, batch.scores.float(), a.reward_position, turn, turn_rewards)
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

    def iteration(self, it: int) -> dict:
        """One StarPO iteration as named steps on one batch record; returns its metrics. Until
        its update begins, a SIGTERM drops it (raises _Drop; nothing has changed). Raises
        NothingToTrain when no trajectory had room for a response. One process and N run the
        same steps (fastpo.distributed: one process is a world of one)."""
        if self.schedule is not None and not self.schedule.needs_rollout(it):
            return self._reuse_iteration(it)
        tm: dict[str, float] = {}
        self.weight_sync_seconds = 0.0
        self.stop_state.weights_touched = False
        items = None
        # FSDP2: whole parameters on every rank from the rollout to the advantages (generation,
        # old log-probs and collapse metrics run different forward counts on each rank)
        with self._droppable(), ffsdp.gathered(self._fsdp_root):
            full, metrics, generated = self._rollout_step(it, tm)
            rollout, filt = self._filter_step(full, metrics)
            t1 = time.perf_counter()
            batch = TrainBatch.from_rollout(rollout, it)
            recomputed = self._old_logprob_step(rollout, batch)
            tm["time/old_logprob_s"] = time.perf_counter() - t1
            metrics["train/old_logprob_from_sampler"] = float(batch.old_logprobs is batch.sample_logprobs)
            metrics.update(self._token_metrics(batch, recomputed))
            if not filt.kept_groups:
                a = self.cfg.algorithm
                self._warn(f"iteration {it}: the {a.filter_strategy} filter kept no env group "
                           f"({filt.zero_std_groups} of {len(filt.group_std)} without reward spread); update skipped")
                metrics.update({"actor/updates": 0, "actor/skipped_updates": 0, **tm})
                return metrics
            t2 = time.perf_counter()
            self._advantage_step(rollout, batch, metrics)
            tm["time/advantage_s"] = time.perf_counter() - t2
            if self.schedule is not None or self.cfg.algorithm.is_correction != "none":
                rollout_m = dict(metrics)  # what the iterations reusing this batch log again
                if self.schedule is not None:
                    items = batch.rows()
                batch = self._off_policy(it, metrics, batch, fresh=True)
            if self._sync_stop() and self.stop_state.term:
                raise _Drop  # every rank drops this iteration before its update (see _request_stop)
        if items is not None:  # past the droppable part: a dropped iteration leaves the schedule as it was
            self.schedule.start(it, items, rollout_m)
        self._train(it, metrics, tm, batch)
        if self.dist.initialized:  # each rank's own figures (a data-parallel job's report)
            metrics.update(self._per_rank_figures(tm, len(batch)))
        metrics["perf/rollout_tokens_per_s"] = generated / max(tm["time/rollout_s"], 1e-9)
        metrics.update(tm)
        return metrics

    def _rollout_step(self, it: int, tm: dict):
        """Step 1: roll out this process's env groups; (the TrajectoryBatch, the rollout metrics
        of the whole batch, generated tokens). Times into `tm`."""
        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        ctx = self.dist
        # this process's whole env groups, their seeds and ids as in one process
        group_ids, seeds = fdist.rank_seeds(cfg.trainer.seed, it, r.env_groups, ctx.world_size, ctx.rank)
        # each group its own sampling stream (rollout.sampling_streams: "group", and "auto" in a
        # process group), else one stream for the whole batch ("batch", "auto" alone)
        per_group = ctx.initialized or r.sampling_streams == "group"
        extra = {"group_ids": group_ids} if per_group else {}  # (subclasses override _generate)
        full = self._generate(seeds, r.group_size, r.temperature, seed=rollout_sampling_seed(cfg.trainer.seed, it),
                              **extra)
        release_free_memory()  # the engine's freed KV buffers and temporaries, back to the system
        tm["time/rollout_s"] = time.perf_counter() - t0 - self.weight_sync_seconds
        tm["time/weight_sync_s"] = self.weight_sync_seconds
        turns = int(fdist.all_reduce(ctx, [int(full.num_turns.sum())])[0])
        longest = int(fdist.all_reduce(ctx, [max(int(x.numel()) for x in full.input_ids)], "max")[0])
        if not turns:
            raise NothingToTrain(
                f"iteration {it}: no trajectory had room for a response (prompts of up to {longest} tokens, "
                f"config key 'rollout.max_context' = {r.max_context}); raise rollout.max_context to at least "
                f"{longest + r.max_new_tokens}")
        every = cfg.trainer.collapse_every
        collapse = bool(every and (it == 1 or it % every == 0))
        metrics, generated, collapse_s = self._rollout_metrics(full, collapse)
        if collapse:
            tm["time/collapse_s"] = collapse_s
        return full, metrics, generated

    def _filter_step(self, full, metrics: dict):
        """Step 2: StarPO-S over every process's env groups; (the kept trajectories, the
        FilterResult). With no group kept (top_p's threshold not reached, or only zero-std
        groups dropped) the full batch is still scored for its metrics, then the update is
        skipped."""
        a, r = self.cfg.algorithm, self.cfg.rollout
        # one trajectory per group: no in-group std to filter by (said once at start)
        mode = a.filter_mode if r.group_size > 1 else "none"
        filt = fdist.global_filter(self.dist, full.scores.float(), full.group_ids, a.filter_ratio, mode,
                                   a.filter_strategy, a.filter_top_p_mode, a.filter_eps, a.filter_keep_zero_std)
        kept = filt.indices.numel()
        rollout = full if not filt.kept_groups or kept == len(full.input_ids) else full.select(filt.indices)
        metrics["train/filter_kept_ratio"] = filt.kept_ratio
        metrics["train/in_group_reward_std_kept"] = filt.std_after
        metrics["train/filter_zero_std_groups"] = filt.zero_std_groups
        return rollout, filt

    def _old_logprob_step(self, rollout, batch: TrainBatch):
        """Step 3: old log-probs, entropies, values and reference log-probs into `batch`, from
        the sampler where they are the same quantity (fastpo.old_logprob); returns the
        recomputed log-probs (None when none were)."""
        if getattr(self, "old_logprob_source", "recompute") == "sampler":
            batch.old_logprobs, batch.entropies, batch.values, batch.ref_logprobs, recomputed = \
                self._old_from_sampler(rollout, batch)
            return recomputed
        batch.old_logprobs, batch.entropies, batch.values, batch.ref_logprobs = self.compute_old(batch)
        return batch.old_logprobs

    def _advantage_step(self, rollout, batch: TrainBatch, metrics: dict) -> None:
        """Step 4: advantages (and returns) into `batch`, per env group on each process, batch
        statistics over every process; RAGEN's soft reweighting by the group's reward std."""
        a = self.cfg.algorithm
        batch.advantages, batch.returns, am = self.compute_advantages(rollout, batch.loss_mask, batch.values,
                                                                      batch.old_logprobs, batch.ref_logprobs)
        metrics.update(self._advantage_metrics(batch.advantages, batch.loss_mask, am))
        if a.soft_advantage_reweight:  # the largest group std over every process
            w, wm = self._soft_weights(rollout)
            batch.advantages = [x * w[i] for i, x in enumerate(batch.advantages)]
            metrics.update(wm)

    def _rollout_metrics(self, full, collapse: bool) -> tuple[dict, float, float]:
        """(rollout metrics, generated tokens, collapse seconds) of the global batch: every
        rank's trajectories are gathered to rank 0, which computes `rollout_metrics` (and the
        collapse metrics when `collapse`) on their concatenation, as one process would; the
        result is shared with every rank."""
        from fastpo.rollout.batch import TrajectoryBatch

        parts = fdist.gather_to_main(self.dist, dataclasses.replace(full, tokenizer=None))

        def compute():
            whole = parts[0] if len(parts) == 1 else TrajectoryBatch.concat(parts)
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

    def _token_metrics(self, batch: TrainBatch, recomputed) -> dict:
        """train/logprob_gap_mean|max and train/rollout_entropy over every rank's scored tokens
        (sums in float64); `recomputed`: the trainer's log-probs, or None."""
        masks, samp, ent = batch.loss_mask, batch.sample_logprobs, batch.entropies
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

    def _advantage_metrics(self, adv, masks, local: dict) -> dict:
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

    def _soft_weights(self, batch) -> tuple[torch.Tensor, dict]:
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

    def _reuse_iteration(self, it: int) -> dict:
        """An iteration inside a reuse cycle (rollout.reuse = K > 1): no rollout; the batch the
        cycle's first iteration sampled is trained on again with its old log-probs (those of
        the policy that sampled it), advantages and rollout metrics (logged again, with
        `rollout/reuse_index` 1..K-1), plus this iteration's replayed trajectories."""
        tm: dict[str, float] = {"time/rollout_s": 0.0, "time/weight_sync_s": 0.0}
        self.weight_sync_seconds = 0.0
        self.stop_state.weights_touched = False
        with self._droppable():
            t1 = time.perf_counter()
            metrics = dict(self.schedule.metrics)
            batch = self._off_policy(it, metrics, TrainBatch.from_rows(self.schedule.current))
            tm["time/old_logprob_s"] = time.perf_counter() - t1
        self._train(it, metrics, tm, batch)
        metrics.update(tm)
        return metrics

    def _off_policy(self, it: int, metrics: dict, batch: TrainBatch, fresh: bool = False) -> TrainBatch:
        """Mix this iteration's replayed trajectories into `batch` and apply the importance-
        sampling correction (algorithm.is_correction); `fresh`: the batch was just rolled out
        (the schedule takes it after the droppable part). Returns the batch to train on
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
            old.old_logprobs, _, r_vals, r_ref = self.compute_old(old)
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
