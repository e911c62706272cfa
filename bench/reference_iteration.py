"""A reference-style (RAGEN / verl-like) StarPO iteration, the baseline of `bench/part_e2e.py`.

`ReferenceTrainer` is fastpo's `Trainer` with the three costly phases replaced by the way the
reference implementation does them; everything else (model, config, seeds, env seeds per
iteration, sampling settings, StarPO-S filtering, GAE / GRPO advantages, optimizer, gradient
clipping, loss formula) is inherited unchanged, so the two differ only in the mechanics
that fastpo claims to speed up:

- rollout: `ReferenceRollout` (bench/reference_rollout.py) (each turn the whole chat history is
  re-rendered with the chat template, re-tokenized, left-padded and re-prefilled by
  `model.generate`; the training sequence is the final conversation re-tokenized), with the
  environments stepped one instance at a time in plain Python (`PlainPythonEnv`, built on
  `fastpo.envs_native.python_reference`) instead of the Numba-batched kernels;
- old log-probs (and values): right-padded micro-batches of `micro_batch_size` trajectories
  (the paper's micro-batch 4), the full HF forward with its [B, T, V] logits materialized,
  log-softmax over the vocabulary on the response span (from the first model token on, as
  verl slices its logits) for log-prob and entropy;
- update: the same padded micro-batches, materialized logits, and the clipped policy loss of
  `fastpo.kernels.torch_reference` (`policy_loss_terms` / `aggregation_weights`, the specification
  the fused kernels are tested against) with gradient accumulation.

Weight sync: in both iterations the generator is the trained module itself (fastpo's native
engine and HF `generate`), so no weights are copied; neither side is charged for a sync.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Optional

import numpy as np
import torch

from fastpo import algorithms as alg
from fastpo.envs_native import make_native_env
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.registry import loss_aggregation
from fastpo.seeds import mini_batch_generator_seed
from fastpo.trainer import Trainer
from fastpo.trainer.metric_sums import MetricSums
from fastpo.trainer.sampler import Sampler
from fastpo.trainer.logprobs import LogProbComputer
from fastpo.trainer.update import PolicyUpdater


class PlainPythonEnv:
    """B environment instances stepped one by one in plain Python (the reference's env loop).

    Implements the slice of the `BatchedTextEnv` API that the rollout loops use: reset(seeds),
    render(), instructions(), action_names(i), parse_actions(answers, max_actions),
    step(actions, active) and the `done` / `success` arrays. Levels are drawn by the batched
    env from the same seeds and copied into `fastpo.envs_native.python_reference` objects (which
    continue the same random streams), so both iterations play the same games; from then on
    parsing, dynamics and rendering are plain Python. Raises ValueError for an unknown env.
    """

    def __init__(self, name: str, batch_size: int, **config):
        self._levels = make_native_env(name, batch_size, **config)  # level generation + instructions only
        self.name = name
        self.batch_size = int(batch_size)
        self.refs: list = []
        self.done = np.ones(self.batch_size, dtype=np.bool_)
        self.success = np.zeros(self.batch_size, dtype=np.bool_)
        self.truncated = np.zeros(self.batch_size, dtype=np.bool_)

    def reset(self, seeds) -> list[str]:
        """Reset from B seeds; returns the B observation texts."""
        from fastpo.envs_native.python_reference import reference_envs

        self._levels.reset(seeds)
        self.refs = reference_envs(self._levels)
        self.done[:] = False
        self.success[:] = False
        return self.render()

    def render(self) -> list[str]:
        """The B current observation texts."""
        return [r.render() for r in self.refs]

    def instructions(self) -> list[str]:
        """The B game descriptions (as the batched env words them)."""
        return self._levels.instructions()

    def action_names(self, i: int) -> list[str]:
        """Action names of instance i in id order."""
        return self._levels.action_names(i)

    def parse_actions(self, answers, max_actions: int):
        """Parse B answer texts with `reference.parse_answer`; returns a `ParsedActions`."""
        from fastpo.envs_native._core import ParsedActions
        from fastpo.envs_native.python_reference import parse_answer

        B = self.batch_size
        acts = np.full((B, max_actions), -1, dtype=np.int64)
        num = np.zeros(B, dtype=np.int64)
        invalid = []
        for b, (ref, text) in enumerate(zip(self.refs, answers)):
            a, bad = parse_answer(text, ref.names, max_actions)
            acts[b, : len(a)] = a
            num[b] = len(a)
            invalid.append(bad)
        all_valid = np.array([num[b] > 0 and not invalid[b] for b in range(B)], dtype=np.bool_)
        return ParsedActions(acts, num, invalid, all_valid)

    def step(self, actions, active=None):
        """Run each active instance's actions (-1 = none) until its episode ends; a `StepResult`."""
        from fastpo.envs_native._core import StepResult

        acts = np.asarray(actions)
        B, A = acts.shape
        act = np.ones(B, dtype=np.bool_) if active is None else np.asarray(active, dtype=np.bool_)
        reward = np.zeros(B, dtype=np.float32)
        executed = np.zeros(B, dtype=np.int32)
        valid = np.zeros((B, A), dtype=np.bool_)
        effective = np.zeros((B, A), dtype=np.bool_)
        for b, ref in enumerate(self.refs):
            if not act[b]:
                continue
            for j in range(A):
                a = int(acts[b, j])
                if ref.done or a < 0 or a >= len(ref.names):
                    continue
                before = ref.render()
                reward[b] += ref.step(a)
                executed[b] += 1
                valid[b, j] = True
                effective[b, j] = ref.render() != before
            self.done[b], self.success[b] = ref.done, ref.success
        return StepResult(reward, self.done.copy(), self.success.copy(), executed, valid, effective)


@contextlib.contextmanager
def plain_python_envs():
    """Within the block, `fastpo.envs_native.make_native_env` builds `PlainPythonEnv`s.

    `ReferenceRollout` builds its environment with `make_native_env` at call time; this swaps the
    factory for the duration of one reference rollout (single-threaded use only).
    """
    import fastpo.envs_native as envs

    original = envs.make_native_env
    envs.make_native_env = lambda name, batch_size, **config: PlainPythonEnv(name, batch_size, **config)
    try:
        yield
    finally:
        envs.make_native_env = original


def logprob_entropy_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """Log-prob of `targets` and entropy from materialized logits (the reference's way).

    logits [N, V] (any float dtype, computed in fp32), targets [N] int64. Returns
    (logprob [N], entropy [N]) fp32 in nats, differentiable.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


class ReferenceTrainer(Trainer):
    """fastpo's Trainer with a reference-style rollout, old log-prob pass and update (module doc):
    its sampler, log-prob computer and updater replaced by `ReferenceSampler`, `ReferenceLogProbComputer` and
    `ReferenceUpdater` after `setup()`, old log-probs always recomputed.

    `micro_batch_size`: trajectories per padded micro-batch (the paper's 4). Same
    constructor otherwise; call `setup()` then `iteration(it)`, which returns the same
    metrics (including `time/*_s` per phase) as `Trainer.iteration`.
    """

    def __init__(self, cfg, resume: bool = False, console=None, stop_after: Optional[int] = None,
                 micro_batch_size: int = 4):
        super().__init__(cfg, resume=resume, console=console)
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        self.micro_batch_size = micro_batch_size

    def setup(self) -> None:
        from reference_rollout import ReferenceRollout

        super().setup()
        p, cfg = self.parts, self.cfg
        # the reference recomputes the old log-probs (RAGEN / verl's default)
        p.plan = dataclasses.replace(p.plan, old_logprob_source="recompute")
        tok = self.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        padded = _Padded(self.micro_batch_size, pad_id, self.device)
        ref_rollout = ReferenceRollout(self.model, tok, cfg.env.name, dict(cfg.env.options),
                                       cfg.rollout.rollout_config())
        rewards = p.sampler.rewards
        p.sampler = ReferenceSampler(cfg, self.dist, p.models, p.sampler.engine, p.sampler.rollout, p.plan, self.out,
                                     self.warn, p.sampler.stopping, ref_rollout=ref_rollout)
        p.sampler.rewards = rewards
        p.logprobs = ReferenceLogProbComputer(cfg, p.models, p.plan, padded)
        updater = ReferenceUpdater(cfg, self.dist, p.models, p.logprobs, p.plan, self.warn, padded)
        updater.actor_opt, updater.critic_opt = p.updater.actor_opt, p.updater.critic_opt  # the same optimizers
        p.updater = updater


class ReferenceSampler(Sampler):
    """Training batches from `ReferenceRollout` (HF `generate`, chat re-rendered each turn) with
    the environments stepped in plain Python; the evaluation stays fastpo's."""

    def __init__(self, *args, ref_rollout):
        super().__init__(*args)
        self.ref_rollout = ref_rollout

    def generate(self, seeds, group_size, temperature, seed, group_ids=None):
        self.models.policy.eval()
        with torch.no_grad(), self.models.autocast(), plain_python_envs():
            return self.ref_rollout.generate(seeds, group_size, temperature=temperature, seed=seed)


class _Padded:
    """Right-padded micro-batches of `micro_batch_size` trajectories (the reference's)."""

    def __init__(self, micro_batch_size: int, pad_id: int, device):
        self.micro_batch_size, self.pad_id, self.device = micro_batch_size, pad_id, device

    def __call__(self, ids, masks, indices):
        """(indices, input_ids [k, T], attention_mask [k, T], scored [k, T-1]) per micro-batch."""
        from fastpo.packing import pad_micro_batch

        for s in range(0, len(indices), self.micro_batch_size):
            sel = indices[s:s + self.micro_batch_size]
            x, att = pad_micro_batch(ids, sel, pad_id=self.pad_id, device=self.device)
            sc = torch.zeros(x.shape, dtype=torch.bool, device=self.device)
            for j, i in enumerate(sel):
                sc[j, : masks[i].numel()] = masks[i].to(self.device)
            yield sel, x, att, sc[:, 1:]


def _forward(model, x, att):
    """Hidden states [k, T, H] and the full materialized logits [k, T, V] (as HF's forward)."""
    h = decoder_body(model)(input_ids=x, attention_mask=att, use_cache=False).last_hidden_state
    return h, torch.nn.functional.linear(h, lm_head_weight(model))


class ReferenceLogProbComputer(LogProbComputer):
    """Old log-probs and values the reference way: padded micro-batches, materialized logits."""

    def __init__(self, cfg, models, plan, padded: _Padded):
        super().__init__(cfg, models, plan)
        self.padded = padded

    @torch.no_grad()
    def compute_old(self, batch, logprobs: bool = True, values: bool = True):
        """`LogProbComputer.compute_old` on the batch record, the reference way (padded micro-batches,
        materialized logits); every column is computed."""
        ids, masks = batch.input_ids, batch.loss_mask
        m = self.models
        if m.reference is not None:
            raise NotImplementedError("ReferenceTrainer covers the StarPO-S setting (kl_coef = 0)")
        temp = self.cfg.rollout.temperature
        old_lp = [torch.zeros(int(x.numel())) for x in ids]
        ent = [torch.zeros(int(x.numel())) for x in ids]
        vals = [torch.zeros(int(x.numel())) for x in ids] if m.value_head is not None else None
        m.policy.eval()
        for sel, x, att, sc in self.padded(ids, masks, list(range(len(ids)))):
            cols = torch.nonzero(sc.any(0)).flatten()
            if cols.numel() == 0:
                continue
            s0 = int(cols[0])  # the response span starts here (after the shared prompt)
            with m.autocast():
                h, logits = _forward(m.policy, x, att)
                # log-softmax over the response span, as verl slices its [B, T, V] logits
                lp = torch.zeros(sc.shape, device=m.device)
                e = torch.zeros(sc.shape, device=m.device)
                lp[:, s0:], e[:, s0:] = logprob_entropy_from_logits(logits[:, s0:-1], x[:, s0 + 1:], temp)
                v = None
                if m.value_head is not None:
                    hv = h if m.critic_body is None else m.critic_body(
                        input_ids=x, attention_mask=att, use_cache=False).last_hidden_state
                    v = m.value_head(hv[:, :-1])
            for j, i in enumerate(sel):
                n = int(ids[i].numel())
                old_lp[i][1:] = torch.where(sc[j, : n - 1], lp[j, : n - 1], 0.0).cpu()
                ent[i][1:] = torch.where(sc[j, : n - 1], e[j, : n - 1], 0.0).cpu()
                if v is not None:
                    vals[i][1:] = torch.where(sc[j, : n - 1], v[j, : n - 1], 0.0).cpu()
        return old_lp, ent, vals, None


class ReferenceUpdater(PolicyUpdater):
    """PPO's update the reference way: padded micro-batches, materialized logits, the loss of
    `fastpo.kernels.torch_reference` (the specification), gradient accumulation."""

    def __init__(self, cfg, dist, models, logprobs, plan, warn, padded: _Padded):
        super().__init__(cfg, dist, models, logprobs, plan, warn)
        self.padded = padded

    def update(self, it, batch) -> MetricSums:
        """`PolicyUpdater.update` on the batch record, the reference way; its figures (actor/pg_loss,
        grad_norm, updates, skipped_updates; perf/train_tokens_per_s counts the padded tokens)."""
        t0 = time.perf_counter()
        from fastpo.kernels.torch_reference import aggregation_weights, policy_loss_terms

        if batch.is_weights is not None:
            raise NotImplementedError("ReferenceTrainer covers the StarPO-S setting (no importance weights)")
        ids, masks, old_lp, adv = batch.input_ids, batch.loss_mask, batch.old_logprobs, batch.advantages
        vals, returns = batch.values, batch.returns

        cfg, a, o = self.cfg, self.cfg.algorithm, self.cfg.optim
        m = self.models
        g = torch.Generator().manual_seed(mini_batch_generator_seed(cfg.trainer.seed, it))
        temp = cfg.rollout.temperature

        def shifted(per_traj, sel, T):  # [k, T-1]: the value for token t+1 at position t
            out = torch.zeros(len(sel), T - 1, device=m.device)
            for j, i in enumerate(sel):
                out[j, : per_traj[i].numel() - 1] = per_traj[i][1:].to(m.device)
            return out

        steps = skipped = train_tokens = 0
        losses, grad_norms = [], []
        m.policy.train()
        for _epoch in range(o.ppo_epochs):
            for mb, n_tok, denom in self.epoch_mini_batches(masks, g):  # the trainer's schedule
                self.actor_opt.zero_grad(set_to_none=True)
                if self.critic_opt is not None:
                    self.critic_opt.zero_grad(set_to_none=True)
                finite = True
                for sel, x, att, sc in self.padded(ids, masks, mb):
                    T = x.shape[1]
                    train_tokens += x.numel()
                    cols = torch.nonzero(sc.any(0)).flatten()
                    if cols.numel() == 0:
                        continue
                    s0 = int(cols[0])  # the response span
                    old = shifted(old_lp, sel, T)[:, s0:]
                    A = shifted(adv, sel, T)[:, s0:]
                    seq = torch.arange(len(sel), device=m.device)[:, None].expand(-1, T - 1 - s0)
                    with m.autocast():
                        h, logits = _forward(m.policy, x, att)
                        lp, e = logprob_entropy_from_logits(logits[:, s0:-1], x[:, s0 + 1:], temp)
                        f = sc[:, s0:].reshape(-1)
                        zero = torch.zeros((), device=m.device)
                        terms = policy_loss_terms(lp.reshape(-1), e.reshape(-1), torch.where(f, old.reshape(-1), zero),
                                                  torch.where(f, A.reshape(-1), zero), None,
                                                  clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
                                                  entropy_coef=a.entropy_coef)
                        w = aggregation_weights(f, loss_aggregation(cfg.loss_agg).kernel_mode, seq.reshape(-1), denom)
                        loss = torch.where(f, terms["loss"] * w, zero).sum()
                        total = loss
                        if m.value_head is not None:
                            hv = h if m.critic_body is None else m.critic_body(
                                input_ids=x, attention_mask=att, use_cache=False).last_hidden_state
                            fv = sc.reshape(-1)
                            v = m.value_head(hv[:, :-1]).reshape(-1)[fv]
                            vl, _ = alg.clipped_value_loss(v, shifted(vals, sel, T).reshape(-1)[fv],
                                                           shifted(returns, sel, T).reshape(-1)[fv],
                                                           torch.ones_like(v, dtype=torch.bool), clip=a.value_clip)
                            vloss = vl * (int(f.sum()) / max(1, n_tok))
                            total = total + (a.value_coef * vloss if m.critic_body is None else vloss)
                    if not torch.isfinite(total.detach()):
                        finite = False
                        break
                    total.backward()
                    losses.append(float(loss.detach()))
                if finite:
                    gn = torch.nn.utils.clip_grad_norm_([p for grp in self.actor_opt.param_groups for p in grp["params"]],
                                                        o.grad_clip)
                    if self.critic_opt is not None:
                        torch.nn.utils.clip_grad_norm_([p for grp in self.critic_opt.param_groups for p in grp["params"]],
                                                       o.grad_clip)
                    finite = bool(torch.isfinite(gn))
                if not finite:
                    skipped += 1
                    self.actor_opt.zero_grad(set_to_none=True)
                    continue
                self.actor_opt.step()
                if self.critic_opt is not None:
                    self.critic_opt.step()
                grad_norms.append(float(gn))
                steps += 1
        m.policy.eval()
        sums = MetricSums()
        sums.value("actor/pg_loss", float(np.mean(losses)) if losses else 0.0)
        sums.value("actor/grad_norm", float(np.mean(grad_norms)) if grad_norms else 0.0)
        sums.value("actor/updates", steps)
        sums.value("actor/skipped_updates", skipped)
        sums.total("perf/train_tokens_per_s", train_tokens / max(time.perf_counter() - t0, 1e-9))
        return sums
