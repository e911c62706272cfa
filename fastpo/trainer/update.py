"""The update: PPO epochs over shuffled mini-batches, micro-batch losses accumulated into one
gradient per mini-batch (the fused policy loss, the clipped value loss), the optimizer step.
"""
from __future__ import annotations

import time

import torch

from fastpo import algorithms as alg
from fastpo import distributed as fdist
from fastpo import fsdp as ffsdp
from fastpo.config import TrainConfig
from fastpo.kernels import PolicyLossSettings, linear_policy_loss
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.memory import release_free_memory
from fastpo.packing import pack_micro_batch, packing_attention, packing_mask_dtype
from fastpo.registry import loss_denominator_of
from fastpo.trainer.batch import TrainBatch
from fastpo.seeds import mini_batch_generator_seed


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
    return loss_denominator_of(loss_agg, *fdist.scored_counts(masks, indices))


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


class Update:
    """`Trainer`'s update: mini-batches (`epoch_mini_batches`), the micro-batch loss, gradient
    accumulation and the optimizer step (`update`), the update phase's metrics (`_train`)."""

    def epoch_mini_batches(self, masks: list, generator: torch.Generator):
        """One PPO epoch's mini-batches: shuffled trajectory indices, the last one smaller when
        n % mini_batch_size != 0. Yields (indices, scored tokens, loss denominator): the
        denominator of `algorithm.loss_agg` (`loss_denominator`). Data parallel: the shuffle
        is of the global batch (the ranks' trajectories in rank order), each rank gets its
        trajectories of each mini-batch (maybe none) and the global denominator, so the
        mini-batches are those of one process whatever the world size."""
        size = self.cfg.optim.mini_batch_size
        counts = [int(x) for x in fdist.per_rank(self.dist, len(masks))]
        offset, total = sum(counts[: self.dist.rank]), sum(counts)
        perm = torch.randperm(total, generator=generator).tolist()
        for start in range(0, total, size):
            mini = [i - offset for i in perm[start:start + size] if offset <= i < offset + len(masks)]
            n_tok = sum(int(masks[i][1:].sum()) for i in mini)
            yield mini, n_tok, fdist.global_loss_denominator(self.dist, self.cfg.algorithm.loss_agg, masks, mini)

    def update(self, it: int, batch: TrainBatch) -> tuple[dict, int]:
        """PPO epochs over shuffled mini-batches of `batch` (its old log-probs, advantages,
        values, returns, reference log-probs and importance-sampling weights, those it has),
        each a gradient accumulated over its packed micro-batches (`_micro_batch_loss`) and one
        optimizer step (`_optimizer_step`). Returns (averaged update metrics, trained tokens);
        data parallel: both over every rank."""
        cfg, o = self.cfg, self.cfg.optim
        g = torch.Generator().manual_seed(mini_batch_generator_seed(cfg.trainer.seed, it))
        masks = batch.loss_mask
        per_traj = {"old_lp": batch.old_logprobs, "adv": batch.advantages, "vals": batch.values,
                    "returns": batch.returns, "ref": batch.ref_logprobs, "is_weights": batch.is_weights}
        metrics = _MetricMeans()
        skipped = steps = train_tokens = 0
        self.model.train()
        for _epoch in range(o.ppo_epochs):
            for mini, _n_tok, denom in self.epoch_mini_batches(masks, g):
                value_denom = fdist.global_loss_denominator(self.dist, cfg.algorithm.value_loss_agg, masks, mini)
                self._zero_grad()
                finite = True
                if self._fsdp_root is not None:
                    finite, n = self._fsdp_accumulate(batch, mini, per_traj, denom, value_denom, metrics)
                    train_tokens += n
                for micro in (self._micro_batches(batch, mini) if self._fsdp_root is None else ()):
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
                # every rank steps, or none; the gradient is the sum over ranks (one process: as it is)
                finite = fdist.all_reduce(self.dist, [0.0 if finite else 1.0], "max")[0] == 0.0
                if finite and self._fsdp_root is None:  # (FSDP2 reduce-scattered them in the backward)
                    fdist.all_reduce_gradients(self.dist, self._trained_parameters())
                if finite and self._optimizer_step(metrics):
                    steps += 1
                    continue
                skipped += 1
                self._warn(f"iteration {it}: non-finite loss or gradient; update skipped (weights unchanged)")
                self._zero_grad()
        # the gradients are not read again before the next update's first zero_grad: freed now,
        # not held (the policy's size again) through the evaluation and the next rollout
        self._zero_grad()
        self.model.eval()
        release_free_memory()  # what the update freed (fastpo.memory), back to the system
        # means over every rank's micro-batches (and steps)
        metrics = _MetricMeans.merged(fdist.all_gather_object(self.dist, (metrics.sums, metrics.counts)))
        train_tokens = int(fdist.all_reduce(self.dist, [train_tokens])[0])
        res = metrics.means()
        res["actor/updates"] = steps
        res["actor/skipped_updates"] = skipped
        return res, train_tokens

    def _fsdp_accumulate(self, batch: TrainBatch, mini, per_traj: dict, denom: float, value_denom: float,
                         metrics: "_MetricMeans") -> tuple[bool, int]:
        """FSDP2: accumulate this rank's gradient of mini-batch `mini` (its trajectories on this
        rank), each micro-batch's loss computed inside the FSDP root's forward, then empty
        micro-batches up to the largest rank's count (`fdist.micro_batch_count`: every
        forward and backward runs FSDP's all-gathers and reduce-scatters, so every rank runs
        as many). A non-finite loss is still backpropagated (the same collectives on every
        rank); the step is then skipped on every rank. Returns (finite, trained tokens)."""
        real = [(m, sc) for m in self._micro_batches(batch, mini) for sc in (m.scored(batch.loss_mask),) if sc.count]
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
        micro = pack_micro_batch([torch.zeros(2, dtype=torch.long)], [0], attention=packing_attention(self.model),
                                 mask_dtype=packing_mask_dtype(self.model), device=self.device)
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
        release_free_memory()  # the mini-batch's freed activations, before the step's temporaries
        clip = self.cfg.optim.grad_clip
        gn = torch.nn.utils.clip_grad_norm_([p for grp in self.actor_opt.param_groups for p in grp["params"]], clip)
        cgn = None
        if self.critic_opt is not None:
            cgn = torch.nn.utils.clip_grad_norm_([p for grp in self.critic_opt.param_groups for p in grp["params"]],
                                                 clip)
        if self._fsdp_root is not None:  # sharded gradients: the norms are DTensors of the global norm
            gn, cgn = ffsdp.full_value(gn), None if cgn is None else ffsdp.full_value(cgn)
        if not (bool(torch.isfinite(gn)) and (cgn is None or bool(torch.isfinite(cgn)))):
            return False
        self.actor_opt.step()
        if self.critic_opt is not None:
            self.critic_opt.step()
            metrics.add("critic/grad_norm", cgn)
        metrics.add("actor/grad_norm", gn)
        return True

    def _train(self, it: int, metrics: dict, tm: dict, batch: TrainBatch) -> None:
        """The update phase of an iteration: `update`, then its metrics into `metrics` and its time into `tm`."""
        self.stop_state.weights_touched = True
        t3 = time.perf_counter()
        um, train_tokens = self.update(it, batch)
        self._weights_stale = True  # a separate engine (SGLang) loads them before it next generates
        um.pop("actor/pg_loss_micro", None)
        metrics.update(um)
        tm["time/update_s"] = time.perf_counter() - t3
        metrics["perf/train_tokens_per_s"] = train_tokens / max(tm["time/update_s"], 1e-9)
