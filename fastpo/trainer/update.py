"""The update: the optimizers and one optimizer step on a loss accumulated over packed
micro-batches (`PolicyUpdater.step`, the seam SFT trains through too), and PPO's epochs over
shuffled mini-batches with the fused policy loss and the clipped value loss (`ppo_update`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from fastpo import algorithms as alg
from fastpo.distributed.collectives import all_reduce, per_rank
from fastpo.distributed.context import DistContext
from fastpo.distributed.data_parallel import global_loss_denominator, micro_batch_count, scored_counts
from fastpo.distributed.sharding import all_reduce_gradients
import fastpo.trainer.fsdp as ffsdp
from fastpo.config.schema import TrainConfig
from fastpo.kernels import PolicyLossSettings, linear_policy_loss, policy_loss
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.memory import release_free_memory
from fastpo.packing import pack_micro_batch, packing_attention, packing_mask_dtype
from fastpo.registry import loss_aggregation, loss_denominator_of
from fastpo.seeds import clip_cov_seed, mini_batch_generator_seed
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.metric_sums import MetricSums
from fastpo.trainer.models import Models, hidden_states
from fastpo.trainer.plan import RunPlan
from fastpo.trainer.logprobs import LogProbComputer


def policy_loss_settings(cfg: TrainConfig) -> PolicyLossSettings:
    """The fused policy loss's settings for `cfg` (built once per run): the algorithm's policy
    loss with its clip, entropy, KL and aggregation settings at the rollout temperature; no KL
    term in the loss when the KL is on the reward (`TrainConfig.kl_in_reward`,
    `RunPlan.kl_in_reward`); the dual clip only for a loss that takes it (`PolicyLoss.dual_clip`);
    the registered losses' own settings as the config has them (`AlgorithmConfig.loss_settings`);
    a token choice's draw seeded by trainer.seed here (`PolicyUpdater.ppo_loss` reseeds it per
    micro-batch with `fastpo.seeds.clip_cov_seed`)."""
    a = cfg.algorithm
    return PolicyLossSettings(clip_low=a.clip_low, clip_high=a.clip_high,
                              dual_clip=a.dual_clip if policy_loss(a.policy_loss).dual_clip else None,
                              entropy_coef=a.entropy_coef, kl_coef=0.0 if cfg.kl_in_reward else a.kl_coef,
                              kl_estimator=a.kl_estimator, temperature=cfg.rollout.temperature,
                              loss_agg=loss_aggregation(cfg.loss_agg).kernel_mode, ratio_level=a.ratio_level,
                              loss=a.policy_loss, cov_seed=cfg.trainer.seed, options=a.loss_settings)


def loss_denominator(loss_agg: str, masks: list, indices: list[int], norm: int = 1) -> float:
    """The normaliser of a mini-batch's loss under `loss_agg` (fastpo.kernels.aggregation_weights'
    `denominator`), so that micro-batch losses accumulate to the mini-batch's: its scored tokens
    for "token-mean", else its trajectories with a scored token (times `norm` for
    "seq-mean-token-sum-norm"); at least 1."""
    return loss_denominator_of(loss_agg, *scored_counts(masks, indices), norm)


def epoch_mini_batches(cfg: TrainConfig, dist: DistContext, masks: list, generator: torch.Generator):
    """One PPO epoch's mini-batches of `optim.mini_batch_size` trajectories: shuffled trajectory
    indices (`generator`), the last one smaller when n % mini_batch_size != 0. Yields (indices,
    scored tokens, loss denominator): the denominator of the run's policy-loss aggregation
    (`TrainConfig.loss_agg`, `loss_denominator`). Data parallel: the shuffle is of the global batch (the ranks'
    trajectories in rank order), each rank gets its trajectories of each mini-batch (maybe
    none) and the global denominator, so the mini-batches are those of one process whatever
    the world size."""
    size = cfg.optim.mini_batch_size
    counts = [int(x) for x in per_rank(dist, len(masks))]
    offset, total = sum(counts[: dist.rank]), sum(counts)
    perm = torch.randperm(total, generator=generator).tolist()
    for start in range(0, total, size):
        mini = [i - offset for i in perm[start:start + size] if offset <= i < offset + len(masks)]
        n_tok = sum(int(masks[i][1:].sum()) for i in mini)
        yield mini, n_tok, global_loss_denominator(dist, cfg.loss_agg, masks, mini, cfg.loss_norm)


#: A micro-batch's loss for `PolicyUpdater.step`: (micro, scored) -> (the loss to backpropagate,
#: its figures as a MetricSums, added to the update's once the step they belong to is taken).
#: `micro` is a packed micro-batch (fastpo.packing), `scored` its scored tokens
#: (`micro.scored(loss_mask)`).
MicroLoss = Callable[[Any, Any], "tuple[torch.Tensor, MetricSums]"]

#: The fused policy loss's figures (`fastpo.kernels.policy_metrics`) that are not per-token
#: means: the extremes of the ratio, and the loss term aggregated with the loss's weights (a
#: micro-batch's share of its mini-batch's term).
RATIO_EXTREMES = {"ratio_max": "max", "ratio_min": "min"}
AGGREGATED = ("pg_loss",)


class PolicyUpdater:
    """The trained modules' optimizers (AdamW: the policy with a shared critic's value head,
    and a separate critic's own), and one optimizer step on a loss accumulated over packed
    micro-batches (`step`): the seam both the StarPO update (`ppo_update`) and SFT train through.

    `warn(text)`: the run's user warnings. Data parallel: gradients summed over the ranks
    before clipping (FSDP2: reduce-scattered in the backward)."""

    def __init__(self, cfg: TrainConfig, dist: DistContext, models: Models, logprobs: LogProbComputer, plan: RunPlan,
                 warn: Callable[[str], None]):
        self.cfg, self.dist, self.models, self.logprobs, self.plan, self.warn = cfg, dist, models, logprobs, plan, warn
        o = cfg.optim
        head, body = models.value_head, models.critic_body
        actor_params = [p for p in models.policy.parameters() if p.requires_grad]
        groups = [{"params": actor_params, "lr": o.actor_lr}]
        if head is not None and body is None:
            groups.append({"params": list(head.parameters()), "lr": o.critic_lr})
        self.actor_opt = torch.optim.AdamW(groups, lr=o.actor_lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.critic_opt = None
        if body is not None:
            self.critic_opt = torch.optim.AdamW(list(body.parameters()) + list(head.parameters()),
                                                lr=o.critic_lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.loss_settings = policy_loss_settings(cfg)
        self.loss_calls = 0  # policy-loss calls in the current update (Clip-Cov's draw per call)

    def optimizers(self) -> dict:
        """The optimizers by checkpoint name: "actor", and "critic" for a separate critic."""
        return {"actor": self.actor_opt, **({"critic": self.critic_opt} if self.critic_opt is not None else {})}

    def trained_parameters(self) -> list:
        """Every parameter the optimizers step, in one fixed order (the same on every rank)."""
        return [p for o in self.optimizers().values() for grp in o.param_groups for p in grp["params"]]

    def zero_grad(self) -> None:
        for o in self.optimizers().values():
            o.zero_grad(set_to_none=True)

    def step(self, batch: TrainBatch, indices: list[int], loss_fn: MicroLoss, sums: MetricSums) -> tuple[bool, int]:
        """One optimizer step on the trajectories `indices` of `batch`: the gradient of
        `loss_fn` accumulated over their packed micro-batches (each loss normalised by the
        caller so that the sum is the mini-batch's), summed over the ranks, clipped
        (optim.grad_clip), then AdamW. A non-finite loss or gradient norm skips the step on
        every rank (weights unchanged, gradients cleared). The step's figures (its micro-batches'
        and the gradient norms) go into `sums` when it is taken. Returns (stepped, trained
        tokens)."""
        self.zero_grad()
        mine = MetricSums()
        if self.models.fsdp_root is not None:
            finite, tokens = self._fsdp_accumulate(batch, indices, loss_fn, mine)
        else:
            finite, tokens = self._accumulate(batch, indices, loss_fn, mine)
        # every rank steps, or none; the gradient is the sum over ranks (one process: as it is)
        finite = all_reduce(self.dist, [0.0 if finite else 1.0], "max")[0] == 0.0
        if finite and self.models.fsdp_root is None:  # (FSDP2 reduce-scattered them in the backward)
            all_reduce_gradients(self.dist, self.trained_parameters())
        if finite and self.optimizer_step(mine):
            sums.merge(mine)
            return True, tokens
        self.zero_grad()
        return False, tokens

    def _accumulate(self, batch: TrainBatch, indices: list[int], loss_fn: MicroLoss,
                    sums: MetricSums) -> tuple[bool, int]:
        """The gradient of `loss_fn` over the micro-batches of `indices`, stopping at the first
        non-finite loss; (finite, trained tokens)."""
        tokens = 0
        for micro in self.logprobs.micro_batches(batch, indices):
            scored = micro.scored(batch.loss_mask)
            if scored.count == 0:
                continue
            tokens += micro.trajectory_tokens
            total, figures = loss_fn(micro, scored)
            if not torch.isfinite(total.detach()):
                return False, tokens
            total.backward()
            sums.merge(figures)
        return True, tokens

    def _fsdp_accumulate(self, batch: TrainBatch, indices: list[int], loss_fn: MicroLoss,
                         sums: MetricSums) -> tuple[bool, int]:
        """FSDP2: accumulate this rank's gradient of its trajectories `indices`, each
        micro-batch's loss computed inside the FSDP root's forward, then empty micro-batches up
        to the largest rank's count (`micro_batch_count`: every forward and backward runs
        FSDP's all-gathers and reduce-scatters, so every rank runs as many). A non-finite loss
        is still backpropagated (the same collectives on every rank); the step is then skipped
        on every rank. Returns (finite, trained tokens)."""
        root = self.models.fsdp_root
        real = [(m, sc) for m in self.logprobs.micro_batches(batch, indices) for sc in (m.scored(batch.loss_mask),)
                if sc.count]
        finite, tokens = True, 0
        for k in range(micro_batch_count(self.dist, len(real))):
            if k >= len(real):
                root(self._empty_micro_loss).backward()
                continue
            micro, scored = real[k]
            tokens += micro.trajectory_tokens
            total, figures = root(loss_fn, micro, scored)
            if torch.isfinite(total.detach()):
                sums.merge(figures)
            else:
                finite = False
            total.backward()
        return finite, tokens

    def _empty_micro_loss(self) -> torch.Tensor:
        """0 from a 2-token dummy row through every sharded module (the policy's body and LM
        head, the critic): the forward and backward of a micro-batch this rank does not have,
        with zero gradients."""
        m = self.models
        micro = pack_micro_batch([torch.zeros(2, dtype=torch.long)], [0], attention=packing_attention(m.policy),
                                 mask_dtype=packing_mask_dtype(m.policy), device=m.device)
        with m.autocast():
            h = hidden_states(decoder_body(m.policy), micro)
            total = h.float().sum() * 0 + lm_head_weight(m.policy).float().sum() * 0
            if m.value_head is not None:
                total = total + m.values(micro, torch.zeros(1, dtype=torch.long, device=h.device), h).sum() * 0
        return total

    def optimizer_step(self, sums: MetricSums) -> bool:
        """Clip the accumulated gradients (optim.grad_clip) and step the optimizers; False,
        without a step, when a gradient norm is not finite. The gradient norms (before clipping,
        of the whole gradient: the same on every rank) into `sums` as actor/ and critic/grad_norm."""
        release_free_memory()  # the mini-batch's freed activations, before the step's temporaries
        clip = self.cfg.optim.grad_clip
        gn = torch.nn.utils.clip_grad_norm_([p for grp in self.actor_opt.param_groups for p in grp["params"]], clip)
        cgn = None
        if self.critic_opt is not None:
            cgn = torch.nn.utils.clip_grad_norm_([p for grp in self.critic_opt.param_groups for p in grp["params"]],
                                                 clip)
        if self.models.fsdp_root is not None:  # sharded gradients: the norms are DTensors of the global norm
            gn, cgn = ffsdp.full_value(gn), None if cgn is None else ffsdp.full_value(cgn)
        if not (bool(torch.isfinite(gn)) and (cgn is None or bool(torch.isfinite(cgn)))):
            return False
        self.actor_opt.step()
        if self.critic_opt is not None:
            self.critic_opt.step()
            sums.value("critic/grad_norm", cgn)
        sums.value("actor/grad_norm", gn)
        return True

    def finish(self) -> None:
        """After an update: the gradients, not read again before the next update's first
        zero_grad, freed (not held, the policy's size again, through the evaluation and the
        next rollout); the policy back in eval mode; freed memory back to the system."""
        self.zero_grad()
        self.models.policy.eval()
        release_free_memory()  # what the update freed (fastpo.memory), back to the system

    # ------------------------------------------------------------------------------- PPO

    def epoch_mini_batches(self, masks: list, generator: torch.Generator):
        """One PPO epoch's mini-batches of this run (`epoch_mini_batches`)."""
        return epoch_mini_batches(self.cfg, self.dist, masks, generator)

    def update(self, it: int, batch: TrainBatch) -> MetricSums:
        """PPO epochs over shuffled mini-batches of `batch` (its old log-probs, advantages,
        values, returns, reference log-probs and importance-sampling weights, those it has),
        each one `step` of the fused policy loss plus the clipped value loss (`ppo_loss`).
        Returns this process's figures of the taken steps; reduced over the processes: each
        per-token one (actor/entropy, approx_kl, clipfrac*,
        ratio_mean, kl, a loss's own fractions; critic/value_loss, value_clipfrac, value_mean,
        value_error) the mean over every token of every step, actor/ratio_max and _min the
        extremes over them, actor/pg_loss the policy-gradient term aggregated as the loss
        aggregates it over all of them (each step's term weighted by its mini-batch's tokens, or
        trajectories: the mean over the steps when they are of one size), the gradient norms the
        mean over the steps, actor/updates and actor/skipped_updates the steps taken and skipped,
        perf/train_tokens_per_s the processes' rates added."""
        cfg, t0 = self.cfg, time.perf_counter()
        g = torch.Generator().manual_seed(mini_batch_generator_seed(cfg.trainer.seed, it))
        masks = batch.loss_mask
        per_traj = {"old_lp": batch.old_logprobs, "adv": batch.advantages, "vals": batch.values,
                    "returns": batch.returns, "ref": batch.ref_logprobs, "is_weights": batch.is_weights}
        sums = MetricSums()
        skipped = steps = train_tokens = self.loss_calls = 0
        self.models.policy.train()
        for _epoch in range(cfg.optim.ppo_epochs):
            for mini, _n_tok, denom in self.epoch_mini_batches(masks, g):
                value_denom = global_loss_denominator(self.dist, cfg.algorithm.value_loss_agg, masks, mini,
                                                      cfg.loss_norm)
                stepped, n = self.step(batch, mini, self.ppo_loss(per_traj, denom, value_denom, it), sums)
                train_tokens += n
                if stepped:
                    steps += 1
                    continue
                skipped += 1
                self.warn(f"iteration {it}: non-finite loss or gradient; update skipped (weights unchanged)")
        self.finish()
        sums.value("actor/updates", steps)
        sums.value("actor/skipped_updates", skipped)
        sums.total("perf/train_tokens_per_s", train_tokens / max(time.perf_counter() - t0, 1e-9))
        return sums

    def ppo_loss(self, per_traj: dict, denom: float, value_denom: float, iteration: int = 0) -> MicroLoss:
        """The `MicroLoss` of one PPO mini-batch: the fused policy loss plus the critic's value
        loss (times value_coef when the critic shares the policy's optimizer), both normalised
        by their mini-batch denominators so that the accumulated gradient is the mini-batch's.
        Its figures: the policy loss's as actor/* (per-token means weighted by the micro-batch's
        tokens, `RATIO_EXTREMES`, `AGGREGATED` as its term in the loss's unit), the value loss's
        as critic/* (per-token means). A loss with a token choice (`PolicyLoss.select`: Clip-Cov's random one) draws
        afresh in each call (`clip_cov_seed` of `iteration` and the call's index)."""
        a, m = self.cfg.algorithm, self.models

        def loss(micro, scored):
            take = {k: None if v is None else scored.take(v) for k, v in per_traj.items()}
            settings = self.loss_settings
            if policy_loss(settings.loss).select is not None:
                settings = dataclasses.replace(settings, cov_seed=clip_cov_seed(self.cfg.trainer.seed, iteration,
                                                                                  self.loss_calls))
            self.loss_calls += 1
            ref = None if self.plan.kl_in_reward else take["ref"]  # the KL is then in the advantages
            figures = MetricSums()
            with m.autocast():
                h = hidden_states(decoder_body(m.policy), micro)
                out = linear_policy_loss(h[scored.rows], lm_head_weight(m.policy), scored.targets, take["old_lp"],
                                         take["adv"], torch.ones_like(take["old_lp"], dtype=torch.bool), ref,
                                         settings=settings, seq_ids=scored.seq, denominator=denom,
                                         is_weights=take["is_weights"], impl=self.cfg.trainer.kernel_impl)
                total = out.loss
                if m.value_head is not None:
                    v = m.values(micro, scored.rows, h)
                    vloss, vm = alg.clipped_value_loss(v, take["vals"], take["returns"],
                                                       torch.ones_like(v, dtype=torch.bool), clip=a.value_clip,
                                                       mode=loss_aggregation(a.value_loss_agg).kernel_mode,
                                                       seq_ids=scored.seq,
                                                       denominator=value_denom)
                    for k, val in vm.items():  # token means over the micro-batch's tokens
                        figures.mean(f"critic/{k}", val * v.numel(), v.numel())
                    # a separate critic has its own optimizer: no coefficient needed
                    total = total + (a.value_coef * vloss if m.critic_body is None else vloss)
            n = take["old_lp"].numel()  # the micro-batch's scored tokens (the kernel's means are over them)
            # its size in the loss's unit (tokens, or trajectories): its share of the mini-batch's `denom`
            units = loss_denominator_of(self.cfg.loss_agg, n, int(torch.unique(scored.seq).numel()), self.cfg.loss_norm)
            for k, val in out.metrics.items():
                if k in RATIO_EXTREMES:
                    getattr(figures, RATIO_EXTREMES[k])(f"actor/{k}", val)
                elif k in AGGREGATED:  # the term before the division by `denom`, over the micro-batch's units
                    figures.mean(f"actor/{k}", val * denom, units, optional=True)
                else:
                    figures.mean(f"actor/{k}", val * n, n)
            return total, figures

        return loss
