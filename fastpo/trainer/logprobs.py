"""Scoring a batch with the current models on packed micro-batches: old log-probs and entropies,
values, reference log-probs (or the sampler's own, where they are the same quantity), and their
batch figures (`token_sums`).
"""
from __future__ import annotations

import torch

from fastpo.config.schema import TrainConfig
from fastpo.kernels import linear_logprob_entropy
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.packing import (pack_micro_batch, packing_attention, packing_mask_dtype, plan_micro_batches,
                            shared_prefixes)
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.metric_sums import MetricSums
from fastpo.trainer.models import Models, hidden_states
from fastpo.trainer.plan import RunPlan


class LogProbComputer:
    """A batch record scored by the current models: its packed micro-batches (`micro_batches`,
    which the update trains on too) and the log-probs, entropies, values and reference
    log-probs on them (`compute_old`, `old_logprobs`)."""

    def __init__(self, cfg: TrainConfig, models: Models, plan: RunPlan):
        self.cfg, self.models, self.plan = cfg, models, plan
        # > 0: share prompts that only begin alike, at least this many tokens (`shared_prefixes`'
        # min_common; SFT sets it: its trajectories share the instructions, not whole prompts)
        self.min_common_prefix = 0

    def micro_batches(self, batch: TrainBatch, indices: list[int]):
        """Packed micro-batches of the trajectories `indices` of `batch` (at most
        `optim.micro_token_budget` tokens each); an env group's shared prompt is computed once
        per micro-batch where the attention allows it (optim.share_prefix); with a context
        window each turn attends as the sampler's did."""
        ids, masks = batch.input_ids, batch.loss_mask
        model = self.models.policy
        attention = packing_attention(model)
        prefix = groups = None
        if attention == "segments" and self.cfg.optim.share_prefix:
            pl, pg = shared_prefixes([ids[i] for i in indices], [masks[i] for i in indices],
                                     min_common=self.min_common_prefix)
            prefix, groups = dict(zip(indices, pl)), dict(zip(indices, pg))
        lengths = [int(ids[i].numel()) for i in indices]
        plan = plan_micro_batches(lengths, self.cfg.optim.micro_token_budget,
                                  None if prefix is None else [prefix[i] for i in indices],
                                  None if groups is None else [groups[i] for i in indices])
        mdtype = packing_mask_dtype(model)
        windows = None
        if self.cfg.rollout.context_window != "full":  # each turn attends as the sampler's window did
            if batch.context_turns is None:
                raise RuntimeError(f"trajectories {list(indices)[:5]} carry no context-window labels "
                                   "(TrainBatch.context_turns); they cannot be scored as the sampler saw them")
            windows = {i: batch.window(i) for i in indices}
        for mb in plan:
            yield pack_micro_batch(ids, [indices[j] for j in mb], attention=attention, mask_dtype=mdtype,
                                   device=self.models.device, prefix_lengths=prefix, prefix_groups=groups,
                                   windows=windows)

    @torch.no_grad()
    def compute_old(self, batch: TrainBatch, logprobs: bool = True, values: bool = True) -> tuple[list, list, list, list]:
        """Old log-probs, entropies, values and reference log-probs of `batch`'s trajectories
        ([T_i] fp32 each), scored by the current models.

        Log-prob/entropy of token t sit at index t (0 off the loss mask); values likewise.
        `logprobs=False` skips the policy's LM head (log-probs and entropies stay None),
        `values=False` the critic (values None): what the sampler already gave.
        """
        m = self.models
        temp = self.cfg.rollout.temperature
        impl = self.cfg.trainer.kernel_impl
        ids, masks = batch.input_ids, batch.loss_mask
        n = len(ids)
        values = values and m.value_head is not None
        old_lp = [torch.zeros(int(x.numel())) for x in ids] if logprobs else None
        ent = [torch.zeros(int(x.numel())) for x in ids] if logprobs else None
        vals = [torch.zeros(int(x.numel())) for x in ids] if values else None
        ref = [torch.zeros(int(x.numel())) for x in ids] if m.reference is not None else None
        if not (logprobs or values or ref is not None) or n == 0:
            return old_lp, ent, vals, ref
        policy_body = logprobs or (values and m.critic_body is None)
        m.policy.eval()
        for micro in self.micro_batches(batch, list(range(n))):
            scored = micro.scored(masks)  # token t is scored from the hidden state at t - 1
            if scored.count == 0:
                continue
            with m.autocast():
                h = hidden_states(decoder_body(m.policy), micro) if policy_body else None
                if logprobs:
                    lp, e = linear_logprob_entropy(h[scored.rows], lm_head_weight(m.policy), scored.targets, temp,
                                                   impl=impl)
                    scored.scatter(lp.float(), old_lp)
                    scored.scatter(e.float(), ent)
                if values:
                    scored.scatter(m.values(micro, scored.rows, h).float(), vals)
                if m.reference is not None:
                    hr = hidden_states(decoder_body(m.reference), micro)
                    rlp, _ = linear_logprob_entropy(hr[scored.rows], lm_head_weight(m.reference), scored.targets,
                                                    temp, impl=impl)
                    scored.scatter(rlp.float(), ref)
        return old_lp, ent, vals, ref

    def old_logprobs(self, rollout, batch: TrainBatch):
        """Step 3 of an iteration: old log-probs, entropies, values and reference log-probs
        into `batch`, from the sampler where they are the same quantity (`RunPlan.
        old_logprob_source`, fastpo.trainer.old_logprob); returns the recomputed log-probs (None when
        none were)."""
        if self.plan.old_logprob_source == "sampler":
            batch.old_logprobs, batch.entropies, batch.values, batch.ref_logprobs, recomputed = \
                self.old_from_sampler(rollout, batch)
            return recomputed
        batch.old_logprobs, batch.entropies, batch.values, batch.ref_logprobs = self.compute_old(batch)
        return batch.old_logprobs

    def old_from_sampler(self, rollout, batch: TrainBatch):
        """(old_lp, ent, vals, ref, recomputed log-probs or None) of `batch`, the record of
        `rollout` (a TrajectoryBatch), with the sampler's log-probs as old_lp; entropies and a
        shared critic's values from the rollout where it recorded them, and one pass over the
        batch for only what is still missing (a separate critic, a reference model, or an
        engine that records no entropies)."""
        m = self.models
        ent = [torch.as_tensor(x, dtype=torch.float32) for x in rollout.sample_entropies] or None
        if ent is None and not len(batch):  # no trajectory (a rank the filter left empty): nothing is missing
            ent = []
        vals = None
        if m.value_head is not None and m.critic_body is None and rollout.sample_values:
            vals = [torch.as_tensor(x, dtype=torch.float32) for x in rollout.sample_values]
        lp2, ent2, vals2, ref = self.compute_old(batch, logprobs=ent is None,
                                                 values=m.value_head is not None and vals is None)
        return batch.sample_logprobs, ent if ent is not None else ent2, vals if vals is not None else vals2, ref, lp2


def token_sums(batch: TrainBatch, recomputed, sums: MetricSums) -> None:
    """train/rollout_entropy (nats per scored token) and, where the trainer recomputed the
    log-probs (`recomputed`, else None), train/logprob_gap_mean|max (|its log-prob - the
    sampler's|, nats, per scored token) of this process's `batch`, into `sums` (float64 sums;
    reduced over the processes with the iteration's other figures); train/old_logprob_from_sampler
    (1.0 when the old log-probs are the sampler's)."""
    masks, samp, ent = batch.loss_mask, batch.sample_logprobs, batch.entropies
    sums.value("train/old_logprob_from_sampler", float(batch.old_logprobs is samp))
    allm = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    e = torch.cat(ent)[allm].double() if masks else torch.zeros(0, dtype=torch.float64)
    if recomputed is not None:
        gap = ((torch.cat(recomputed) - torch.cat(samp))[allm].abs().double() if masks
               else torch.zeros(0, dtype=torch.float64))
        sums.mean("train/logprob_gap_mean", gap.sum(), gap.numel())
        sums.max("train/logprob_gap_max", gap.max() if gap.numel() else None)
    sums.mean("train/rollout_entropy", e.sum(), e.numel())
