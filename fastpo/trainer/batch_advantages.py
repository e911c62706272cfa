"""Step 5 of a StarPO iteration: the advantages (and returns) of the batch in training, with their
batch metrics (`Advantages.estimate`); DAPO's overlong filtering and RAGEN's soft reweighting.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from fastpo import algorithms as alg
from fastpo.algorithms.filtering import group_reward_std
from fastpo.distributed.collectives import all_reduce, masked_whiten
from fastpo.distributed.context import DistContext, SINGLE
from fastpo.registry import estimator
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.metric_sums import MetricSums


class Advantages:
    """Per-trajectory advantages (and returns) of a batch under `cfg`'s algorithm and `plan`
    (the KL on the reward or not); data parallel: batch statistics over every rank of `dist`.
    `estimate(rollout, batch)` is the iteration's step; `compute(...)` the estimator alone,
    which needs no model: `Advantages(cfg, fastpo.distributed.context.SINGLE, rl_plan(cfg,
    False)).compute(...)` works on hand-made batches."""

    def __init__(self, cfg, dist: DistContext, plan):
        self.cfg, self.dist, self.plan = cfg, dist, plan

    def estimate(self, rollout, batch: TrainBatch, sums: MetricSums) -> None:
        """The advantages (and returns) of `batch` (the record of `rollout`, a TrajectoryBatch)
        into it, per env group on each process with batch statistics over every process; then
        DAPO's overlong filtering (algorithm.overlong_filter: the turns cut at the length limit
        leave the loss, after their reward reached the earlier turns) and RAGEN's soft
        reweighting by the group's reward std (algorithm.soft_advantage_reweight). Records into
        `sums`: `compute`'s figures, train/advantage_mean|std (per scored token, the sample std)
        and train/soft_reweight_min|max|mean (per trajectory)."""
        batch.advantages, batch.returns, _ = self.compute(rollout, batch.loss_mask, batch.values,
                                                          batch.old_logprobs, batch.ref_logprobs, sums)
        if self.cfg.algorithm.overlong_filter:
            overlong_filtered(rollout, batch)
        masks = batch.loss_mask
        x = torch.cat([a[m] for a, m in zip(batch.advantages, masks)]) if masks else torch.zeros(0)
        sums.mean("train/advantage_mean", x.double().sum(), x.numel())
        sums.std("train/advantage_std", x)
        if self.cfg.algorithm.soft_advantage_reweight:  # the largest group std over every process
            w = self.soft_weights(rollout)
            batch.advantages = [x * w[i] for i, x in enumerate(batch.advantages)]
            sums.min("train/soft_reweight_min", w.min() if w.numel() else None)
            sums.max("train/soft_reweight_max", w.max() if w.numel() else None)
            sums.mean("train/soft_reweight_mean", w.double().sum(), w.numel())

    def compute(self, batch, masks, vals, old_lp=None, ref=None,
                sums: Optional[MetricSums] = None) -> tuple[list, Optional[list], dict]:
        """Per-trajectory advantages (and returns for PPO), [T_i] fp32 each, zero off the loss mask,
        and the figures of these trajectories: critic/return_mean and critic/value_mean (per
        scored token; estimators with a critic) and train/kl_reward (with the KL on the reward:
        the mean over trajectories of each one's mean token KL, verl's critic/kl), also recorded
        into `sums` where given (the iteration's, reduced over every process).

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
        own = MetricSums()  # these trajectories' figures
        B = len(masks)
        if B == 0:  # a process whose env groups the filter all dropped (data parallel)
            adv, returns = self._empty_advantages(spec)
        else:
            adv, returns = self._advantages(spec, batch, masks, vals, old_lp, ref, own)
        if sums is not None:
            sums.merge(own)
        return adv, returns, own.reduce(SINGLE)

    def _advantages(self, spec, batch, masks, vals, old_lp, ref, own: MetricSums) -> tuple[list, Optional[list]]:
        """`compute` on B >= 1 trajectories."""
        a = self.cfg.algorithm
        B = len(masks)
        T = max(int(mask.numel()) for mask in masks)
        M = torch.zeros(B, T, dtype=torch.bool)
        for i, mask in enumerate(masks):
            M[i, : mask.numel()] = mask
        KL = None
        if self.plan.kl_coef > 0 and self.plan.kl_in_reward:
            if ref is not None:
                KL = self._token_kl(M, old_lp, ref, own)
            else:
                own.mean("train/kl_reward", 0.0, 0)
        ctx = self.dist
        inputs = alg.AdvantageInputs(M, batch.group_ids, gamma=a.gamma, lam=a.lam, whiten_advantages=a.whiten_advantages,
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
        returns = None
        if out.returns is not None:
            returns = [out.returns[i, : masks[i].numel()] for i in range(B)]
            own.mean("critic/return_mean", out.returns[M].double().sum(), int(M.sum()))
            own.mean("critic/value_mean", inputs.values[M].double().sum(), int(M.sum()))
        return [adv[i, : masks[i].numel()] for i in range(B)], returns

    def _empty_advantages(self, spec) -> tuple[list, Optional[list]]:
        """No trajectory on this process: it still joins the batch statistics, in the order the
        other ranks compute them (its figures: none; the reduction counts nothing here)."""
        ctx, a = self.dist, self.cfg.algorithm
        if not spec.batch_statistics:
            return [], None
        empty, none = torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.bool)
        if not spec.needs_critic:
            masked_whiten(ctx, empty, none, unbiased=True)
            return [], None
        if a.whiten_advantages:
            masked_whiten(ctx, empty, none)
        return [], []

    def _token_kl(self, M: torch.Tensor, old_lp: list, ref: list, own: MetricSums) -> torch.Tensor:
        """Each model token's KL to the reference [B, T]; train/kl_reward into `own` (verl's
        critic/kl: the mean over trajectories with a model token of each one's mean token KL)."""
        a = self.cfg.algorithm
        B, T = M.shape
        LP, REF = torch.zeros(B, T), torch.zeros(B, T)
        for i in range(B):
            LP[i, : old_lp[i].numel()] = old_lp[i]
            REF[i, : ref[i].numel()] = ref[i]
        _, KL = alg.apply_kl_penalty(torch.zeros(B, T), LP, REF, M, a.kl_coef, a.kl_estimator)
        n = M.sum(1)
        own.mean("train/kl_reward", (KL.sum(1)[n > 0] / n[n > 0]).double().sum(), int((n > 0).sum()))
        return KL

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

    def soft_weights(self, batch) -> torch.Tensor:
        """`soft_advantage_weights` [B] of this rank's trajectories, with the largest group std
        of the global batch (one collective)."""
        scores = batch.scores.float()
        local = max(group_reward_std(scores, batch.group_ids).values(), default=0.0) if len(scores) else 0.0
        top = all_reduce(self.dist, [local], "max")[0]
        return alg.soft_advantage_weights(scores, batch.group_ids, top=top) if len(scores) else torch.zeros(0)


def overlong_filtered(rollout, batch: TrainBatch) -> None:
    """DAPO's overlong filtering, in place: the tokens of every turn that stopped at the length
    limit leave `batch`'s loss masks (and their advantages are zeroed), after the advantages
    were computed over the whole trajectory (the shaping half: `fastpo.trainer.sampler.overlong_shaping`)."""
    if not rollout.turn_stop_reasons:
        return
    for i, reasons in enumerate(rollout.turn_stop_reasons):
        turn = torch.as_tensor(rollout.turn_index[i])
        batch.loss_mask[i] = alg.truncated_turn_mask(batch.loss_mask[i], turn, reasons)
        batch.advantages[i] = batch.advantages[i] * batch.loss_mask[i]
