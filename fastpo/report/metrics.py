"""What the user sees and keeps: JSONL metrics with EMA copies, TensorBoard/W&B, the Echo-Trap
early warning, sample trajectories and the rollout's figures; the PNG curves
(fastpo.report.plots) and the end-of-run tables (fastpo.report.summary) are their own modules.

Metric names follow the field's conventions; units are in the name where they are not obvious
(`time/rollout_s` seconds, `perf/train_tokens_per_s`). Every logged scalar `k` also gets an
exponentially smoothed copy `ema/k` (x_ema <- d * x_ema + (1 - d) * x, d = `ema_decay`,
started at the first value), as the RAGEN paper's curves are smoothed.
"""
from __future__ import annotations

import json
import logging
import math
import os

import numpy as np
import torch
from typing import Any, Callable, Iterable, Optional

from fastpo.algorithms.filtering import group_reward_std
# The plots (fastpo.report.plots), the end-of-run tables (fastpo.report.summary) and the numeric helpers
# (fastpo.report.stats) live in their own modules: import their names from there.
from fastpo.report.stats import finite_number
from fastpo.run.folder import atomic_write_text

#: fastpo's warnings to the user (a run's conditions, skipped updates, missing bounds): a library
#: user silences them with logging.getLogger("fastpo").setLevel(logging.ERROR), or routes them
#: by adding a handler to this logger.
logger = logging.getLogger("fastpo")


def warn_user(text: str, console: Any = None) -> None:
    """One warning line: through the "fastpo" logger (nothing when it is set above WARNING);
    printed on `console` (a rich Console, "warning: " first, never wrapped) while that logger
    has no handler of its own, else handed to its handlers."""
    if not logger.isEnabledFor(logging.WARNING):
        return
    if console is not None and not logger.handlers:
        console.print(f"warning: {text}", style="yellow", markup=False, soft_wrap=True)
    else:
        logger.warning(text)



class MetricsLogger:
    """Appends one JSON object per iteration to `OUT/metrics.jsonl`, with EMA copies.

    `resume_from` (an iteration number) keeps the file's records up to that iteration,
    drops later ones (they belong to the interrupted run) and replays them to rebuild the
    EMA state, so a resumed run writes exactly what an uninterrupted one would have. A line
    that is not JSON (the half-written last line of a crash or a full disk) is dropped there,
    and `warn` (default: `warn_user`, the "fastpo" logger) gets one line saying so.
    TensorBoard (`tensorboard=True`, torch.utils.tensorboard) and Weights & Biases
    (`wandb=True`, offline unless WANDB_MODE says otherwise) mirror the scalars.
    """

    def __init__(self, out_dir: str, ema_decay: float = 0.9, tensorboard: bool = False, wandb: bool = False,
                 resume_from: Optional[int] = None, run_name: str = "fastpo", config: Optional[dict] = None,
                 model_label: Optional[str] = None, warn: Optional[Callable[[str], None]] = None,
                 start_label: Optional[str] = None):
        if not 0 < ema_decay < 1:
            raise ValueError(f"ema_decay must be in (0, 1), got {ema_decay}")
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.decay = ema_decay
        # e.g. "random:qwen2.5-0.5b (random weights)": written into every record as "model"; the
        # records of iteration 0 (the evaluation before training) get `start_label` where given
        self.model_label = model_label
        self.start_label = start_label
        self.ema: dict[str, float] = {}
        self.records: list[dict] = []
        if resume_from is not None and os.path.exists(self.path):
            torn = []
            with open(self.path, errors="replace", encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        rec = json.loads(line)
                        if not isinstance(rec, dict):
                            raise ValueError(type(rec).__name__)
                    except ValueError:
                        torn.append(n)
                        continue
                    if rec.get("iteration", 0) <= resume_from:
                        self.records.append(rec)
                        self._update_ema(rec)
            if torn:
                say = warn or warn_user
                say(f"{self.path}: dropped {'the half-written line' if len(torn) == 1 else 'unreadable lines'} "
                    f"{', '.join(map(str, torn[:5]))}{' ...' if len(torn) > 5 else ''} (an interrupted write)")
            self._rewrite()
        elif os.path.exists(self.path):
            os.remove(self.path)
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        if wandb:
            import wandb as _wandb  # optional dependency

            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = _wandb.init(project="fastpo", name=run_name, dir=out_dir, config=config or {},
                                      resume="allow")

    def _update_ema(self, rec: dict) -> None:
        for k, v in rec.items():
            if k.startswith("ema/") or k == "iteration" or not finite_number(v):
                continue
            prev = self.ema.get(k)
            self.ema[k] = float(v) if prev is None else self.decay * prev + (1 - self.decay) * float(v)

    def _rewrite(self) -> None:
        atomic_write_text(self.path, "".join(json.dumps(rec) + "\n" for rec in self.records))

    @staticmethod
    def log_values(metrics: dict) -> dict:
        """What a record keeps of `metrics`: numbers (bools as 0/1, non-finite as null) and strings."""
        out: dict[str, Any] = {}
        for k, v in metrics.items():
            if isinstance(v, bool):
                v = int(v)
            if isinstance(v, (int, float)):
                out[k] = v if math.isfinite(float(v)) else None
            elif isinstance(v, str):
                out[k] = v
        return out

    def log(self, iteration: int, metrics: dict) -> dict:
        """Record one iteration's scalars (non-finite values are kept as null); returns the record with EMA copies."""
        rec: dict[str, Any] = {"iteration": int(iteration)}
        label = self.start_label if iteration == 0 and self.start_label is not None else self.model_label
        if label is not None:
            rec["model"] = label
        rec.update(self.log_values(metrics))
        self._update_ema(rec)
        for k in list(rec):
            if k in self.ema:
                rec[f"ema/{k}"] = self.ema[k]
        self.records.append(rec)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")  # one write: a crash leaves at most a torn last line
        if self._tb is not None:
            for k, v in rec.items():
                if finite_number(v) and k != "iteration":
                    self._tb.add_scalar(k, float(v), iteration)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in rec.items() if finite_number(v)}, step=iteration)
        return rec

    def amend_last(self, values: dict) -> None:
        """Add or change keys of the last record (e.g. a warning decided after its EMA is known)."""
        if not self.records:
            raise ValueError("no record to amend")
        self.records[-1].update(values)
        self._rewrite()
        if self._tb is not None:
            for k, v in values.items():
                if finite_number(v):
                    self._tb.add_scalar(k, float(v), self.records[-1]["iteration"])

    def extend_last(self, metrics: dict) -> dict:
        """Add keys the last record lacked (an evaluation finished after it was logged), with
        their EMA copies, as `log` would have written them; returns the record."""
        if not self.records:
            raise ValueError("no record to extend")
        rec = self.records[-1]
        new = {k: v for k, v in self.log_values(metrics).items() if k not in rec}
        self._update_ema(new)
        rec.update(new)
        rec.update({f"ema/{k}": self.ema[k] for k in new if k in self.ema})
        self._rewrite()
        if self._tb is not None:
            for k, v in new.items():
                if finite_number(v):
                    self._tb.add_scalar(k, float(v), rec["iteration"])
            self._tb.flush()
        return rec

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class EchoTrapDetector:
    """Early warning of the "Echo Trap" (RAGEN Sec. 4.1): the policy collapses onto repetitive
    reasoning, which shows first as in-group reward std and rollout entropy falling, before
    the reward does; and, with the collapse metrics (fastpo/trainer/collapse.py, RAGEN's head), which
    collapse it is: *entropy collapse* (H(Z|X), the reasoning's variety for a given state,
    fell) or *template collapse* (I(X;Z), how much the reasoning depends on the state, fell).

    The early values are the means over the first `window` iterations (for the collapse
    metrics, measured every `trainer.collapse_every` iterations, over those measured within
    them, at least the first). From then on, at each iteration the warning is raised when,
    while the EMA of success has not risen above its early value, any of these has fallen to
    at most (1 - drop) x its early value: the EMA of in-group reward std AND of entropy
    (the paper's sign); I(X;Z) per token (template collapse); H(Z|X) per token (entropy
    collapse). The collapse metrics are compared at their latest measurement (each is over
    the whole batch, not smoothed). `update` returns the warning text, naming what it sees,
    or None; the state is rebuilt by replaying records, so resume reproduces it.
    """

    STD_KEY = "train/in_group_reward_std"
    ENT_KEY = "train/rollout_entropy"
    SUCCESS_KEY = "train/success_rate"
    MI_KEY = "collapse/mi_estimate"
    HZX_KEY = "collapse/conditional_entropy_est"
    BOUND_KEY = "collapse/mi_upper_bound"

    def __init__(self, drop: float = 0.5, window: int = 5):
        if not 0 < drop < 1:
            raise ValueError(f"echo-trap drop must be in (0, 1), got {drop}")
        if window < 1:
            raise ValueError(f"echo-trap window must be >= 1, got {window}")
        self.drop, self.window = drop, window
        self.early: list[dict] = []
        self.early_collapse: dict[str, list] = {self.MI_KEY: [], self.HZX_KEY: []}
        self.latest: dict[str, float] = {}
        self.first_iteration: Optional[int] = None
        self.warned = False

    def _collapse_values(self, rec: dict) -> None:
        it = rec.get("iteration")
        if self.first_iteration is None and isinstance(it, int):
            self.first_iteration = it
        for k in (self.MI_KEY, self.HZX_KEY, self.BOUND_KEY):
            if not finite_number(rec.get(k)):
                continue
            self.latest[k] = float(rec[k])
            if k == self.BOUND_KEY:
                continue
            early = self.early_collapse[k]
            within = isinstance(it, int) and self.first_iteration is not None and it < self.first_iteration + self.window
            if not early or within:
                early.append(float(rec[k]))

    def update(self, rec: dict) -> Optional[str]:
        """Feed one logged record (with its `ema/` copies); returns a warning string or None."""
        self._collapse_values(rec)
        vals = {k: rec.get(k) for k in (self.STD_KEY, self.ENT_KEY, self.SUCCESS_KEY)}
        if any(not finite_number(v) for v in vals.values()):
            return None
        if len(self.early) < self.window:
            self.early.append(vals)
            return None
        base = {k: sum(e[k] for e in self.early) / len(self.early) for k in vals}
        cur = {k: rec.get(f"ema/{k}", vals[k]) for k in vals}
        limit = 1.0 - self.drop
        if cur[self.SUCCESS_KEY] > base[self.SUCCESS_KEY] + 1e-9:
            return None  # learning, not a trap

        def fell(now, early) -> bool:
            return early > 0 and now <= limit * early

        echo = fell(cur[self.STD_KEY], base[self.STD_KEY]) and fell(cur[self.ENT_KEY], base[self.ENT_KEY])
        seen, early_c = {}, {}
        for k in (self.MI_KEY, self.HZX_KEY):
            if k in self.latest and self.early_collapse[k]:
                seen[k] = self.latest[k]
                early_c[k] = sum(self.early_collapse[k]) / len(self.early_collapse[k])
        template = self.MI_KEY in seen and fell(seen[self.MI_KEY], early_c[self.MI_KEY])
        entropy = self.HZX_KEY in seen and fell(seen[self.HZX_KEY], early_c[self.HZX_KEY])
        if not (echo or template or entropy):
            return None
        parts = []
        if template:
            bound = self.latest.get(self.BOUND_KEY)
            parts.append(f"template collapse: I(X;Z) {seen[self.MI_KEY]:.3g} nats/token (early {early_c[self.MI_KEY]:.3g}"
                         + (f", at most {bound:.3g}" if bound is not None else "")
                         + f") fell by >= {self.drop:.0%}: the reasoning no longer depends on the state")
        if entropy:
            parts.append(f"entropy collapse: H(Z|X) {seen[self.HZX_KEY]:.3g} nats/token (early "
                         f"{early_c[self.HZX_KEY]:.3g}) fell by >= {self.drop:.0%}: the reasoning for a given state "
                         "no longer varies")
        if echo:
            parts.append(f"in-group reward std {cur[self.STD_KEY]:.3g} (early {base[self.STD_KEY]:.3g}) and entropy "
                         f"{cur[self.ENT_KEY]:.3g} (early {base[self.ENT_KEY]:.3g}) fell by >= {self.drop:.0%}")
            if not seen:
                parts.append("which collapse is unknown: no collapse metrics (trainer.collapse_every=0)")
            elif not (template or entropy):
                parts.append(f"the collapse metrics show neither entropy nor template collapse (H(Z|X) "
                             f"{seen.get(self.HZX_KEY, float('nan')):.3g}, I(X;Z) {seen.get(self.MI_KEY, float('nan')):.3g} "
                             "nats/token, less than that below their early values)")
        return (f"Echo Trap warning: {'; '.join(parts)}; while success "
                f"{cur[self.SUCCESS_KEY]:.3g} did not rise (early {base[self.SUCCESS_KEY]:.3g}). "
                "Consider StarPO-S filtering (algorithm.filter_mode=top), a higher entropy_coef or a lower lr.")



def write_samples(out_dir: str, iteration: int, texts: Iterable[str], header: str = "",
                  model_label: Optional[str] = None) -> str:
    """Write sample trajectories as text to `out_dir/iter_XXXXXX.txt`; returns the path.

    model_label: written as a first line "model: <label>" (e.g. "... (random weights)").
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"iter_{iteration:06d}.txt")
    with open(path, "w", encoding="utf-8") as f:
        if model_label:
            f.write(f"model: {model_label}\n")
        if header:
            f.write(header.rstrip() + "\n\n")
        for i, t in enumerate(texts):
            f.write(f"===== trajectory {i} =====\n{t.rstrip()}\n\n")
    return path



def rollout_metrics(batch, prefix: str = "train") -> dict:
    """Scalars describing a TrajectoryBatch: success rate, score mean/std, in-group reward std,
    response length (model tokens per trajectory), tokens per trajectory, turns, format-penalty
    rate and the engine's own rates (valid / effective actions, truncation). The figures of one
    batch (the evaluation's, gathered on rank 0); a training iteration's are `rollout_sums`'."""
    scores = batch.scores.float()
    out = {
        f"{prefix}/success_rate": float(batch.success.float().mean()),
        f"{prefix}/score_mean": float(scores.mean()),
        f"{prefix}/score_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        f"{prefix}/in_group_reward_std": float(np.mean(list(group_reward_std(scores, batch.group_ids).values()))),
        f"{prefix}/response_length": float(np.mean([int(torch.as_tensor(m).sum()) for m in batch.loss_mask])),
        f"{prefix}/tokens_per_trajectory": float(np.mean([len(x) for x in batch.input_ids])),
        f"{prefix}/num_turns": float(batch.num_turns.float().mean()),
        f"{prefix}/num_actions": float(batch.num_actions.float().mean()),
        f"{prefix}/truncated_rate": float(batch.truncated.float().mean()),
    }
    per_turn_ok = batch.format_valid()
    out[f"{prefix}/format_valid"] = float(per_turn_ok.mean())
    out[f"{prefix}/format_penalty_rate"] = 1.0 - out[f"{prefix}/format_valid"]
    mine = {"success_rate", "score", "num_turns", "truncated_rate", "format_penalty_rate", "format_valid"}
    for k, v in (batch.metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in mine:
            # the engine's response_length is per turn; ours (above) is per trajectory
            out[f"{prefix}/{'response_length_per_turn' if k == 'response_length' else k}"] = float(v)
    labels = list(dict.fromkeys(getattr(batch, "env_labels", None) or []))
    if len(labels) > 1 or (batch.info or {}).get("envs"):  # a mixture: each game's own figures
        for label in (batch.info or {}).get("envs") or labels:
            sel = torch.tensor([x == label for x in batch.env_labels], dtype=torch.bool)
            n = int(sel.sum())
            out[f"{prefix}/{label}/share"] = n / max(1, len(batch))
            if n:
                out[f"{prefix}/{label}/success_rate"] = float(batch.success[sel].float().mean())
                out[f"{prefix}/{label}/score_mean"] = float(scores[sel].mean())
                out[f"{prefix}/{label}/format_valid"] = float(per_turn_ok[sel].mean())
                out[f"{prefix}/{label}/num_turns"] = float(batch.num_turns[sel].float().mean())
    return out


#: The engine's batch metrics that `rollout_sums` recomputes from the per-trajectory counts
#: (`fastpo.rollout.trajectory_batch.count_rates`) where the batch holds them.
COUNTED_RATES = ("valid_action_rate", "effective_action_rate", "response_length", "num_actions")


def rollout_sums(batch, sums, prefix: str = "train") -> None:
    """`rollout_metrics`' figures of this process's share `batch` (a TrajectoryBatch) of a
    rollout, recorded into `sums` (a fastpo.trainer.metric_sums.MetricSums) so that their
    reduction over the processes gives the whole batch's: per-trajectory means as (sum,
    trajectories), the in-group reward std as (sum over env groups, groups; a group is whole on
    one process), the score std from the sums of scores and their squares, a game of a
    mixture's figures over its trajectories. The engine's action and turn rates come from the
    per-trajectory counts (valid / all answer pieces, effective / executed actions, model
    tokens per turn: `count_rates`), exact however the batch is split; its token counts are
    summed, its seconds and peak KV bytes the largest process's, its tokens per second the
    processes' rates added, any other figure of it weighted by trajectories. Every process
    records the same keys (a game absent from every share is left out)."""

    # torch: fastpo.rollout loads it, and the commands import this module before any model
    from fastpo.rollout.trajectory_batch import MAX_METRICS, SUMMED_METRICS

    p, n = prefix, len(batch)
    scores = batch.scores.float()
    sums.mean(f"{p}/success_rate", batch.success.float().sum(), n)
    sums.mean(f"{p}/score_mean", scores.double().sum(), n)
    sums.std(f"{p}/score_std", scores)
    stds = group_reward_std(scores, batch.group_ids) if n else {}
    sums.mean(f"{p}/in_group_reward_std", sum(stds.values()), len(stds))
    sums.mean(f"{p}/response_length", sum(int(torch.as_tensor(m).sum()) for m in batch.loss_mask), n)
    sums.mean(f"{p}/tokens_per_trajectory", sum(len(x) for x in batch.input_ids), n)
    sums.mean(f"{p}/num_turns", batch.num_turns.sum(), n)
    sums.mean(f"{p}/num_actions", batch.num_actions.sum(), n)
    sums.mean(f"{p}/truncated_rate", batch.truncated.sum(), n)
    ok = batch.format_valid().double()
    sums.mean(f"{p}/format_valid", ok.sum(), n)
    sums.mean(f"{p}/format_penalty_rate", (1.0 - ok).sum(), n)
    counted = all(x is not None for x in (batch.valid_actions, batch.invalid_actions, batch.effective_actions))
    mine = {"success_rate", "score", "num_turns", "truncated_rate", "format_penalty_rate", "format_valid"}
    for k, v in (batch.metrics or {}).items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or k in mine or k == "num_actions":
            continue
        key = f"{p}/{'response_length_per_turn' if k == 'response_length' else k}"
        if k in SUMMED_METRICS or k == "tokens_per_s":
            sums.total(key, v)
        elif k in MAX_METRICS:
            sums.max(key, v)
        elif not (counted and k in COUNTED_RATES):
            sums.mean(key, float(v) * n, n)
    if counted:
        valid, invalid = int(batch.valid_actions.sum()), int(batch.invalid_actions.sum())
        executed, turns = int(batch.num_actions.sum()), int(batch.num_turns.sum())
        sums.mean(f"{p}/valid_action_rate", valid, valid + invalid)
        sums.mean(f"{p}/effective_action_rate", int(batch.effective_actions.sum()), executed)
        sums.mean(f"{p}/response_length_per_turn", sum(int(torch.as_tensor(m).sum()) for m in batch.loss_mask),
                  turns)
    labels = (batch.info or {}).get("envs") or list(dict.fromkeys(getattr(batch, "env_labels", None) or []))
    if len(labels) > 1 or (batch.info or {}).get("envs"):  # a mixture: each game's own figures
        fv = batch.format_valid()
        for label in labels:
            sel = torch.tensor([x == label for x in batch.env_labels], dtype=torch.bool)
            k = int(sel.sum())
            sums.mean(f"{p}/{label}/share", k, n)
            sums.mean(f"{p}/{label}/success_rate", batch.success[sel].float().sum(), k, optional=True)
            sums.mean(f"{p}/{label}/score_mean", scores[sel].double().sum(), k, optional=True)
            sums.mean(f"{p}/{label}/format_valid", fv[sel].double().sum(), k, optional=True)
            sums.mean(f"{p}/{label}/num_turns", batch.num_turns[sel].sum(), k, optional=True)
