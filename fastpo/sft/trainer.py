"""Supervised fine-tuning on expert trajectories or conversations (`SFTTrainer`): the RAGEN
paper's SFT baseline (arXiv 2504.20073, appendix: SFT on expert trajectories against StarPO-S).

Training runs on the StarPO trainer's parts and run loop; an iteration is one optimizer step
through `PolicyUpdater.step`: token-in-token-out, the mean negative log-likelihood over the
answer tokens of a mini-batch of `sft.batch_size` trajectories (token-mean, as TRL's
SFTTrainer), packed into the trainer's padding-free micro-batches, AdamW at optim.actor_lr
with optim.grad_clip. The run folder, checkpoints (exact resume), metrics, plots, Ctrl-C /
SIGTERM safety and the before/after evaluation with the random and optimal lines are the
trainer's; the expert's own success on the eval seeds is logged beside them
(`eval/expert_success`), and in answer-only mode the imitation metric
(`eval/first_action_accuracy`, fastpo.sft.experts.first_action_accuracy).
"""
from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

from fastpo.config.schema import TrainConfig, eval_seeds
from fastpo.envs import has_expert
from fastpo.kernels import decoder_body, linear_logprob_entropy, lm_head_weight
from fastpo.report.stats import standard_error
from fastpo.sft.config import handoff_command
from fastpo.sft.data import SFTData, check_chat_file, load_sft_data
from fastpo.sft.experts import expert_rollout, first_action_accuracy
from fastpo.trainer.loop import RunTrainer
from fastpo.trainer.metric_sums import MetricSums
from fastpo.trainer.models import hidden_states
from fastpo.trainer.plan import SUPERVISED
from fastpo.trainer.setup import check_prompts_fit, open_run

# sft.common_prefix: the shortest shared lead worth a segment of its own (a chat header alone is
# about 10 tokens; the instructions of a built-in game 300-400)
MIN_COMMON_PREFIX = 16
_SALT_SFT_ORDER = 5_000_011  # (seed, epoch, salt) -> the order of the expert trajectories in that epoch


def batch_indices(seed: int, iteration: int, batch_size: int, n: int) -> list[int]:
    """The expert trajectories (indices in [0, n)) of SFT step `iteration` (1-based): the
    trajectories in order of a per-epoch shuffle, `batch_size` at a time across epochs, a
    pure function of its arguments (so a resume continues the order); an index repeated
    across an epoch boundary is taken once."""
    out: list[int] = []
    perms: dict = {}
    for q in range((iteration - 1) * batch_size, iteration * batch_size):
        epoch = q // n
        if epoch not in perms:
            g = torch.Generator().manual_seed(int(np.random.default_rng([seed, epoch, _SALT_SFT_ORDER]).integers(2**62)))
            perms[epoch] = torch.randperm(n, generator=g).tolist()
        i = perms[epoch][q % n]
        if i not in out:
            out.append(i)
    return out


class SFTTrainer(RunTrainer):
    """Supervised fine-tuning on the trainer's parts (`fastpo.trainer.setup.open_run` with the
    supervised plan: no critic, reference model or filter) and its run loop (`RunLoop`: run
    folder, checkpoints, exact resume, signals, evaluation, metrics): iteration i is one AdamW
    step (`PolicyUpdater.step`) on the mean answer-token NLL of `batch_indices(seed, i,
    sft.batch_size, n)`'s trajectories.

    cfg: the TrainConfig (model, env, rollout format and limits, optim, trainer: run folder,
    evaluation, checkpoints; sft: the data, `load_config(..., sections=("sft",))`; its
    algorithm section is not read). data: the run's `SFTData` when the caller read it before
    any model loaded (`load_sft_data`), else it is read at set-up. Other arguments:
    `fastpo.trainer.loop.RunTrainer`. ValueError for a cfg without an sft section. Metrics per iteration: sft/loss (mean NLL per
    answer token, nats), sft/answer_entropy (mean entropy of the model's next-token
    distribution on the answer tokens, nats), sft/answer_tokens, sft/trajectories, sft/epoch,
    actor/grad_norm, actor/updates, actor/skipped_updates, perf/train_tokens_per_s (all
    tokens of the packed trajectories per second of the step), time/update_s;
    train/success_rate and train/score_mean are the expert trajectories' of the step.
    """

    # an SFT run resumed by `fastpo train` would continue as StarPO
    resume_command = "fastpo sft --resume"
    # (from a data file: no success or score)
    progress_fields = (("success", "train/success_rate", ".2f"), ("score", "train/score_mean", ".3f"),
                       ("loss", "sft/loss", ".3f"))

    def __init__(self, cfg: TrainConfig, data: Optional[SFTData] = None, **kw):
        if cfg.sft is None:
            raise ValueError("SFTTrainer needs a TrainConfig with an sft section: load_config(..., sections=('sft',))")
        super().__init__(cfg, **kw)
        self.sft = cfg.sft
        self.prepared = data  # `load_sft_data`'s, when the caller read it before any model loaded
        self.data = self.batch = self.ids = self.masks = None
        self._expert_eval: Optional[dict] = None
        self._expert_on_eval = None

    def check_prompts_fit(self) -> Any:
        """As the StarPO trainer's, with the tokenizer the prepared data was read with."""
        return check_prompts_fit(self.cfg, self.prepared.tokenizer if self.prepared is not None else None)

    def setup(self) -> None:
        """The run opened on the supervised plan, then its data: the prepared `SFTData`, else
        `load_sft_data` now (the expert's trajectories or the conversations of `sft.data`), as
        one batch record."""
        data = self.prepared
        if data is not None:
            self.sft.data_sha256 = data.digest or self.sft.data_sha256
        elif self.sft.data:  # the file's digest before config.yaml keeps it (a changed file: refused now)
            self.sft.data_sha256 = check_chat_file(self.sft.data, self.sft.data_sha256)
        open_run(self, SUPERVISED)
        if self.sft.common_prefix:
            self.parts.logprobs.min_common_prefix = MIN_COMMON_PREFIX
        if data is None:
            data = load_sft_data(self.cfg, self.tokenizer)
            for line in data.describe():
                self.console.print(line, soft_wrap=True)
            if data.warning():
                self.warn(data.warning())
        self.data = data.expert
        self.batch = data.batch
        self.ids, self.masks = self.batch.input_ids, self.batch.loss_mask

    def expert_eval(self) -> dict:
        """{"eval/expert_success", "eval/expert_success_se"}: the expert's success on the eval
        seeds under this run's rollout settings (one trajectory per seed); its trajectories are
        kept for `first_action_accuracy`."""
        if self._expert_eval is None:
            b = expert_rollout(self.tokenizer, self.cfg.env.name, self.cfg.env.options,
                               self.cfg.rollout.rollout_config(), eval_seeds(self.cfg), self.sft.actions_per_turn)
            self._expert_on_eval = b
            s = b.success.double().numpy()
            self._expert_eval = {"eval/expert_success": float(s.mean()),
                                 "eval/expert_success_se": float(standard_error(s))}
        return self._expert_eval

    def evaluate(self, it: int) -> dict:
        """The policy's evaluation (`Sampler.evaluate`), with the expert's success on the same
        seeds and, in answer-only mode, the first-action accuracy (`first_action_accuracy`)."""
        res = super().evaluate(it)
        if not res or not has_expert(self.cfg.env.name):  # stopped (dropped), or a game without an expert
            return res
        res.update(self.expert_eval())
        if not self.cfg.rollout.think:  # in think mode an answer opens with reasoning, not an action
            acc, n = first_action_accuracy(self.model, self._expert_on_eval)
            res.update({"eval/first_action_accuracy": acc, "eval/first_action_turns": n})
        return res

    def iteration(self, it: int) -> dict:
        """One AdamW step on the mean answer-token NLL of this step's trajectories; its metrics."""
        t0 = time.perf_counter()
        idx = batch_indices(self.cfg.trainer.seed, it, self.sft.batch_size, len(self.ids))
        n_ans = sum(int(self.masks[i].sum()) for i in idx)
        updater = self.parts.updater
        sums = MetricSums()
        self.stop.update_begins()
        self.model.train()
        stepped, tokens = updater.step(self.batch, idx, self._nll_loss(n_ans), sums)
        if not stepped:
            self.warn(f"iteration {it}: non-finite loss or gradient; SFT step skipped (weights unchanged)")
        updater.finish()  # gradients freed, eval mode, the step's memory back to the system
        dt = time.perf_counter() - t0
        sums.mean("sft/loss", 0.0, 0)  # (a skipped step: 0.0)
        sums.mean("sft/answer_entropy", 0.0, 0)
        m = sums.reduce(self.dist)  # the step's NLL and entropy per answer token, gradient norm
        if self.data is not None:
            m.update({"train/success_rate": float(self.data.success[idx].float().mean()),
                      "train/score_mean": float(self.data.scores[idx].mean())})
        m.update({
            "sft/answer_tokens": n_ans,
            "sft/trajectories": len(idx), "sft/epoch": (it * self.sft.batch_size) / len(self.ids),
            "actor/updates": int(stepped), "actor/skipped_updates": int(not stepped),
            "perf/train_tokens_per_s": tokens / max(dt, 1e-9), "time/update_s": dt,
        })
        return m

    def _nll_loss(self, n_ans: int):
        """The `MicroLoss` of a step of `n_ans` answer tokens: their summed NLL / n_ans (the
        step's token mean once accumulated); its figures sft/loss and sft/answer_entropy, the NLL
        and entropy per answer token (nats)."""
        m = self.parts.models

        def loss(micro, scored):
            with m.autocast():
                h = hidden_states(decoder_body(m.policy), micro)
                lp, ent = linear_logprob_entropy(h[scored.rows], lm_head_weight(m.policy), scored.targets,
                                                 impl=self.cfg.trainer.kernel_impl)
                total = -lp.sum() / max(n_ans, 1)
            figures = MetricSums()
            figures.mean("sft/loss", -lp.detach().sum(), lp.numel())
            figures.mean("sft/answer_entropy", ent.detach().sum(), lp.numel())
            return total, figures

        return loss

    def finish(self, records: list[dict]) -> None:
        """The imitation and expert lines of the last evaluation (labelled with its iteration), and
        the StarPO command that continues from this model once every step has run; a run
        stopped before its last step says how to resume instead (rank 0, after the report)."""
        ev = [r for r in records if "eval/success_rate" in r]
        if ev:
            for line in _result_lines(ev[-1]):
                self.console.print(line, markup=False)
        done = max((r.get("iteration", 0) for r in records), default=0)
        if done >= self.cfg.trainer.iterations:
            self.console.print("StarPO from this model: " + handoff_command(self.cfg), markup=False, soft_wrap=True)
        elif done >= 1:  # stopped: the model is not the one the run was asked for
            self.console.print(f"stopped after step {done} of {self.cfg.trainer.iterations}: finish it with "
                               f"`{self.resume_command} {self.out}`, then StarPO from the finished model: "
                               f"`{handoff_command(self.cfg)}`", markup=False, soft_wrap=True)


def _result_lines(last: dict) -> list[str]:
    """What an SFT run's last evaluation record `last` says of the imitation and the expert,
    labelled with its iteration ("before training" for iteration 0)."""
    it = int(last.get("iteration", 0))
    when = "before training (iteration 0)" if it == 0 else f"at iteration {it}"
    lines = []
    if "eval/first_action_accuracy" in last:
        lines.append(f"imitation {when}: the model's most likely first answer token is the expert's action in "
                     f"{last['eval/first_action_accuracy']:.3f} of {last['eval/first_action_turns']} expert "
                     f"turns on the eval seeds (teacher-forced)")
    if "eval/expert_success" in last:
        lines.append(f"expert (the solver, rendered as above) on the eval seeds: "
                     f"{last['eval/expert_success']:.3f} +- {last['eval/expert_success_se']:.3f}")
    return lines  # success against the random policy: the report's result line

