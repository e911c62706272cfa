"""Scoring a batch with the current models on packed micro-batches: old log-probs and entropies,
values, reference log-probs (or the sampler's own, where they are the same quantity).
"""
from __future__ import annotations

from typing import Optional

import torch

from fastpo.kernels import linear_logprob_entropy
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.trainer.batch import TrainBatch
from fastpo.packing import (pack_micro_batch, packing_attention, packing_mask_dtype, plan_micro_batches,
                            shared_prefixes)


class Scoring:
    """`Trainer`'s scoring: packed micro-batches of a batch record (`_micro_batches`) and the
    current models' log-probs, entropies, values and reference log-probs on them (`compute_old`)."""

    def _micro_batches(self, batch: TrainBatch, indices: list[int]):
        """Packed micro-batches of the trajectories `indices` of `batch`; an env group's shared
        prompt is computed once per micro-batch where the attention allows it
        (optim.share_prefix); with a context window each turn attends as the sampler's did."""
        ids, masks = batch.input_ids, batch.loss_mask
        attention = packing_attention(self.model)
        prefix = groups = None
        if attention == "segments" and self.cfg.optim.share_prefix:
            pl, pg = shared_prefixes([ids[i] for i in indices], [masks[i] for i in indices])
            prefix, groups = dict(zip(indices, pl)), dict(zip(indices, pg))
        lengths = [int(ids[i].numel()) for i in indices]
        plan = plan_micro_batches(lengths, self.cfg.optim.micro_token_budget,
                                  None if prefix is None else [prefix[i] for i in indices],
                                  None if groups is None else [groups[i] for i in indices])
        mdtype = packing_mask_dtype(self.model)
        windows = None
        if self.cfg.rollout.context_window != "full":  # each turn attends as the sampler's window did
            if batch.context_turns is None:
                raise RuntimeError(f"trajectories {list(indices)[:5]} carry no context-window labels "
                                   "(TrainBatch.context_turns); they cannot be scored as the sampler saw them")
            windows = {i: batch.window(i) for i in indices}
        for mb in plan:
            yield pack_micro_batch(ids, [indices[j] for j in mb], attention=attention, mask_dtype=mdtype,
                                   device=self.device, prefix_lengths=prefix, prefix_groups=groups, windows=windows)

    @staticmethod
    def _hidden(body: torch.nn.Module, micro) -> torch.Tensor:
        """The last hidden states [L, H] of packed micro-batch `micro` (one row of L tokens)
        through decoder body `body` (the policy's, the reference model's or a separate critic's):
        the forward that computing old log-probs and the update share."""
        return body(**micro.model_inputs(), use_cache=False).last_hidden_state[0]

    def _values(self, micro, rows: torch.Tensor, h_policy: Optional[torch.Tensor]) -> torch.Tensor:
        """The critic's values [M] fp32 from the hidden-state rows `rows` [M]: the policy's
        hidden states `h_policy` for a critic on the shared trunk, else its own body's."""
        hv = h_policy if self.critic_body is None else self._hidden(self.critic_body, micro)
        return self.value_head(hv[rows])

    @torch.no_grad()
    def compute_old(self, batch: TrainBatch, logprobs: bool = True, values: bool = True) -> tuple[list, list, list, list]:
        """Old log-probs, entropies, values and reference log-probs of `batch`'s trajectories
        ([T_i] fp32 each), scored by the current models.

        Log-prob/entropy of token t sit at index t (0 off the loss mask); values likewise.
        `logprobs=False` skips the policy's LM head (log-probs and entropies stay None),
        `values=False` the critic (values None): what the sampler already gave.
        """
        temp = self.cfg.rollout.temperature
        impl = self.cfg.trainer.kernel_impl
        ids, masks = batch.input_ids, batch.loss_mask
        n = len(ids)
        values = values and self.value_head is not None
        old_lp = [torch.zeros(int(x.numel())) for x in ids] if logprobs else None
        ent = [torch.zeros(int(x.numel())) for x in ids] if logprobs else None
        vals = [torch.zeros(int(x.numel())) for x in ids] if values else None
        ref = [torch.zeros(int(x.numel())) for x in ids] if self.ref_model is not None else None
        if not (logprobs or values or ref is not None) or n == 0:
            return old_lp, ent, vals, ref
        policy_body = logprobs or (values and self.critic_body is None)
        self.model.eval()
        for micro in self._micro_batches(batch, list(range(n))):
            scored = micro.scored(masks)  # token t is scored from the hidden state at t - 1
            if scored.count == 0:
                continue
            with self._autocast():
                h = self._hidden(decoder_body(self.model), micro) if policy_body else None
                if logprobs:
                    lp, e = linear_logprob_entropy(h[scored.rows], lm_head_weight(self.model), scored.targets, temp,
                                                   impl=impl)
                    scored.scatter(lp.float(), old_lp)
                    scored.scatter(e.float(), ent)
                if values:
                    scored.scatter(self._values(micro, scored.rows, h).float(), vals)
                if self.ref_model is not None:
                    hr = self._hidden(decoder_body(self.ref_model), micro)
                    rlp, _ = linear_logprob_entropy(hr[scored.rows], lm_head_weight(self.ref_model), scored.targets,
                                                    temp, impl=impl)
                    scored.scatter(rlp.float(), ref)
        return old_lp, ent, vals, ref

    def _old_from_sampler(self, rollout, batch: TrainBatch):
        """(old_lp, ent, vals, ref, recomputed log-probs or None) of `batch`, the record of
        `rollout` (a TrajectoryBatch), with the sampler's log-probs as old_lp; entropies and a
        shared critic's values from the rollout where it recorded them, and one pass over the
        batch for only what is still missing (a separate critic, a reference model, or an
        engine that records no entropies)."""
        ent = [torch.as_tensor(x, dtype=torch.float32) for x in rollout.sample_entropies] or None
        if ent is None and not len(batch):  # no trajectory (a rank the filter left empty): nothing is missing
            ent = []
        vals = None
        if self.value_head is not None and self.critic_body is None and rollout.sample_values:
            vals = [torch.as_tensor(x, dtype=torch.float32) for x in rollout.sample_values]
        lp2, ent2, vals2, ref = self.compute_old(batch, logprobs=ent is None,
                                                 values=self.value_head is not None and vals is None)
        return batch.sample_logprobs, ent if ent is not None else ent2, vals if vals is not None else vals2, ref, lp2
