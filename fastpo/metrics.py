"""What the user sees and keeps: JSONL metrics with EMA copies, TensorBoard/W&B, PNG curves,
the Echo-Trap early warning, sample trajectories and the end-of-run summary table.

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

#: Curves the RAGEN paper plots (Fig. 3-5), drawn to OUT/plots/<name>.png.
PLOT_KEYS: dict[str, str] = {
    "success_rate": "train/success_rate",
    "eval_success_rate": "eval/success_rate",
    "entropy": "train/rollout_entropy",
    "reward_std": "train/in_group_reward_std",
    "response_length": "train/response_length",
    "grad_norm": "actor/grad_norm",
    "score": "train/score_mean",
}


def standard_error(xs) -> float:
    """Standard error of the mean of `xs`: sample std (ddof 1) / sqrt(n); 0.0 for n < 2."""
    x = np.asarray(xs, dtype=np.float64)
    return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


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
                 model_label: Optional[str] = None, warn: Optional[Callable[[str], None]] = None):
        if not 0 < ema_decay < 1:
            raise ValueError(f"ema_decay must be in (0, 1), got {ema_decay}")
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.decay = ema_decay
        # e.g. "random:qwen2.5-0.5b (random weights)": written into every record as "model"
        self.model_label = model_label
        self.ema: dict[str, float] = {}
        self.records: list[dict] = []
        if resume_from is not None and os.path.exists(self.path):
            torn = []
            with open(self.path, errors="replace") as f:
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
            if k.startswith("ema/") or k == "iteration" or not _is_number(v):
                continue
            prev = self.ema.get(k)
            self.ema[k] = float(v) if prev is None else self.decay * prev + (1 - self.decay) * float(v)

    def _rewrite(self) -> None:
        from fastpo.checkpoint import atomic_write_text

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
        if self.model_label is not None:
            rec["model"] = self.model_label
        rec.update(self.log_values(metrics))
        self._update_ema(rec)
        for k in list(rec):
            if k in self.ema:
                rec[f"ema/{k}"] = self.ema[k]
        self.records.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")  # one write: a crash leaves at most a torn last line
        if self._tb is not None:
            for k, v in rec.items():
                if _is_number(v) and k != "iteration":
                    self._tb.add_scalar(k, float(v), iteration)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in rec.items() if _is_number(v)}, step=iteration)
        return rec

    def amend_last(self, values: dict) -> None:
        """Add or change keys of the last record (e.g. a warning decided after its EMA is known)."""
        if not self.records:
            raise ValueError("no record to amend")
        self.records[-1].update(values)
        self._rewrite()
        if self._tb is not None:
            for k, v in values.items():
                if _is_number(v):
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
                if _is_number(v):
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
    the reward does; and, with the collapse metrics (fastpo/collapse.py, RAGEN's head), which
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
            if not _is_number(rec.get(k)):
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
        if any(not _is_number(v) for v in vals.values()):
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


def plot_title(name: str, model_label: Optional[str] = None) -> str:
    """A curve's title: its name, then the model label on a second line (so random weights show)."""
    title = name.replace("_", " ")
    return f"{title}\n{model_label}" if model_label else title


def plot_curves(records: list[dict], out_dir: str, keys: Optional[dict[str, str]] = None,
                model_label: Optional[str] = None) -> list[str]:
    """Draw each curve (raw and EMA) against iteration to `out_dir/<name>.png` with matplotlib (Agg).

    model_label: shown under each title (e.g. "random:qwen2.5-0.5b (random weights)"); when
    None, the records' own "model" key is used if they have one.
    Returns the paths written; a curve with no finite values is skipped.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    if model_label is None:
        model_label = next((r["model"] for r in reversed(records) if isinstance(r.get("model"), str)), None)
    written = []
    for name, key in (keys or PLOT_KEYS).items():
        pts = [(r["iteration"], r[key]) for r in records if _is_number(r.get(key))]
        if not pts:
            continue
        ema = [(r["iteration"], r[f"ema/{key}"]) for r in records if _is_number(r.get(f"ema/{key}"))]
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        ax.plot(*zip(*pts), marker="o", ms=3, lw=1, alpha=0.6, label=key)
        if len(ema) > 1:
            ax.plot(*zip(*ema), lw=2, label="EMA")
        ax.set_xlabel("iteration")
        ax.set_title(plot_title(name, model_label), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    if keys is None and any(_is_number(r.get("collapse/mi_estimate")) for r in records):
        written.append(plot_collapse(records, os.path.join(out_dir, "collapse.png"), model_label))
    if keys is None and any(_is_number(r.get("eval/success_rate")) for r in records):
        written.append(plot_eval(records, os.path.join(out_dir, "eval.png"), model_label))
    return written


def _save_figure(fig, path: str, model_label: Optional[str]) -> str:
    """Title a figure with the model label, write it to `path` (folders created) and close it."""
    import matplotlib.pyplot as plt

    if model_label:
        fig.suptitle(model_label, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_eval(records: list[dict], path: str, model_label: Optional[str] = None) -> str:
    """The evaluations of a run in one figure (matplotlib, Agg), written to `path`: eval
    success with the random and the optimal policy's success on the same seeds as dashed
    lines, the format-valid rate (1 - format-penalty rate) and the score mean; each eval point
    with +-1 standard error bars where logged (`eval/<name>_se`), the train batch's value per
    iteration as a thin line. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    def pts(key):
        return [(r["iteration"], r[key], r.get(f"{key}_se")) for r in records if _is_number(r.get(key))]

    def last(key):
        vals = [r[key] for r in records if _is_number(r.get(key))]
        return vals[-1] if vals else None

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), dpi=100)
    panels = (("success rate", "eval/success_rate", "train/success_rate"),
              ("format-valid rate", "eval/format_valid", "train/format_valid"),
              ("score mean", "eval/score_mean", "train/score_mean"))
    for ax, (title, ekey, tkey) in zip(axes, panels):
        tr = pts(tkey)
        if tr:
            ax.plot([p[0] for p in tr], [p[1] for p in tr], "-", color="0.6", lw=1, label="train batch")
        ev = pts(ekey)
        if ev:
            err = [p[2] if _is_number(p[2]) else 0.0 for p in ev]
            ax.errorbar([p[0] for p in ev], [p[1] for p in ev], yerr=err, fmt="-o", ms=4, capsize=3, color="C0",
                        label="eval (+-1 SE)")
        if ekey == "eval/success_rate":
            for key, label, color in (("eval/optimal_success", "optimal policy", "C2"),
                                      ("eval/random_success", "random policy", "C3")):
                v = last(key)
                if v is not None:
                    ax.axhline(v, ls="--", lw=1.2, color=color, label=f"{label} ({v:.2f})")
        ax.set_xlabel("iteration")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    return _save_figure(fig, path, model_label)


def plot_collapse(records: list[dict], path: str, model_label: Optional[str] = None) -> str:
    """The collapse metrics of a run in one figure (matplotlib, Agg), written to `path`:
    H(Z|X), H(Z) and I(X;Z) per token (nats) with I's bound log N, and beside them train
    success and rollout entropy. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    def pts(key):
        return [(r["iteration"], r[key]) for r in records if _is_number(r.get(key))]

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    for key, label, style in (("collapse/conditional_entropy_est", "H(Z|X): variety for a given state", "-o"),
                              ("collapse/reasoning_entropy_est", "H(Z): variety over the batch", "-s"),
                              ("collapse/mi_estimate", "I(X;Z) = H(Z) - H(Z|X): dependence on the state", "-^"),
                              ("collapse/mi_upper_bound", "log N (I's bound)", ":")):
        if pts(key):
            ax.plot(*zip(*pts(key)), style, ms=3, lw=1.2, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("nats per token")
    ax.set_title("collapse metrics (first turn)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5)
    for key, label in (("train/success_rate", "train success rate"), ("train/rollout_entropy", "rollout entropy (nats)"),
                       ("train/in_group_reward_std", "in-group reward std")):
        if pts(key):
            ax2.plot(*zip(*pts(key)), "-o", ms=3, lw=1.2, label=label)
    ax2.set_xlabel("iteration")
    ax2.set_title("the paper's signals", fontsize=9)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=6.5)
    return _save_figure(fig, path, model_label)


def write_samples(out_dir: str, iteration: int, texts: Iterable[str], header: str = "",
                  model_label: Optional[str] = None) -> str:
    """Write sample trajectories as text to `out_dir/iter_XXXXXX.txt`; returns the path.

    model_label: written as a first line "model: <label>" (e.g. "... (random weights)").
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"iter_{iteration:06d}.txt")
    with open(path, "w") as f:
        if model_label:
            f.write(f"model: {model_label}\n")
        if header:
            f.write(header.rstrip() + "\n\n")
        for i, t in enumerate(texts):
            f.write(f"===== trajectory {i} =====\n{t.rstrip()}\n\n")
    return path


SUMMARY_KEYS = [
    ("train/success_rate", "train success rate"),
    ("eval/success_rate", "eval success rate"),
    ("train/score_mean", "train score mean"),
    ("train/format_valid", "train format-valid rate"),
    ("train/in_group_reward_std", "in-group reward std"),
    ("train/rollout_entropy", "rollout entropy (nats)"),
    ("train/response_length", "response length (tokens)"),
    ("actor/grad_norm", "actor grad norm"),
    ("actor/approx_kl", "approx KL"),
    ("time/iteration_s", "seconds / iteration"),
]


def summary_table(records: list[dict], title: str = "fastpo run summary"):
    """A rich Table: first, last and best value of the main metrics over the run."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("metric", "first", "last", "best", "iteration of best"):
        table.add_column(col)
    for key, label in SUMMARY_KEYS:
        pts = [(r["iteration"], r[key]) for r in records if _is_number(r.get(key))]
        if not pts:
            continue
        lower_better = key.startswith("time/")
        best = (min if lower_better else max)(pts, key=lambda p: p[1])
        table.add_row(label, f"{pts[0][1]:.4g}", f"{pts[-1][1]:.4g}", f"{best[1]:.4g}", str(best[0]))
    return table


#: Rows of the end-of-run before/after table: (metric, label, has a standard error).
BEFORE_AFTER_KEYS = [
    ("eval/success_rate", "success", True),
    ("eval/random_success", " random policy", False),
    ("eval/optimal_success", " optimal policy", False),
    ("eval/format_valid", "format-valid", True),
    ("eval/score_mean", "score mean", True),
]


def _eval_outcomes(run_dir: Optional[str], iteration: int) -> Optional[dict]:
    """The per-trajectory outcomes of a run's evaluation (`run_dir/eval/iter_XXXXXX.json`,
    written by the trainer), or None when absent or unreadable."""
    if not run_dir:
        return None
    try:
        with open(os.path.join(run_dir, "eval", f"iter_{int(iteration):06d}.json")) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def before_after(records: list[dict], run_dir: Optional[str] = None) -> Optional[dict]:
    """The first and the last evaluation of a run, compared: None with fewer than two
    evaluations, else {"before": iteration, "after": iteration, "rows": [{"key", "label",
    "before", "after", "before_se", "after_se", "change", "z", "z_paired"}]}.

    z = change / sqrt(before_se^2 + after_se^2): the change in standard errors of the
    difference of two independent means. z_paired (where `run_dir` holds both evaluations'
    per-trajectory outcomes on the same seeds): mean(d) / (std(d, ddof 1) / sqrt(n)) over the
    per-seed differences d = after - before, which takes out what the seeds themselves make
    easy or hard (a map without a short safe path fails before and after). Either is None
    where it cannot be computed (no standard error, both 0, or no outcomes)."""
    evals = [r for r in records if _is_number(r.get("eval/success_rate"))]
    if len(evals) < 2:
        return None
    a, b = evals[0], evals[-1]
    oa, ob = _eval_outcomes(run_dir, a["iteration"]), _eval_outcomes(run_dir, b["iteration"])
    paired = oa is not None and ob is not None and oa.get("seed") == ob.get("seed") and bool(oa.get("seed"))
    rows = []
    for key, label, has_se in BEFORE_AFTER_KEYS:
        if not (_is_number(a.get(key)) and _is_number(b.get(key))):
            continue
        row = {"key": key, "label": label, "before": float(a[key]), "after": float(b[key]),
               "before_se": None, "after_se": None, "change": float(b[key]) - float(a[key]), "z": None,
               "z_paired": None}
        if has_se and _is_number(a.get(f"{key}_se")) and _is_number(b.get(f"{key}_se")):
            row["before_se"], row["after_se"] = float(a[f"{key}_se"]), float(b[f"{key}_se"])
            se = math.hypot(row["before_se"], row["after_se"])
            row["z"] = row["change"] / se if se > 0 else None
        name = key.split("/", 1)[1]
        if has_se and paired and isinstance(oa.get(name), list) and isinstance(ob.get(name), list) \
                and len(oa[name]) == len(ob[name]) > 1:
            d = np.asarray(ob[name], dtype=np.float64) - np.asarray(oa[name], dtype=np.float64)
            se = standard_error(d)
            row["z_paired"] = float(d.mean() / se) if se > 0 else None
        rows.append(row)
    return {"before": a["iteration"], "after": b["iteration"], "rows": rows}


def before_after_table(records: list[dict], title: Optional[str] = None,
                       run_dir: Optional[str] = None):
    """A rich Table of `before_after(records, run_dir)` (None with fewer than two
    evaluations): value +- standard error before and after, the change, and the change in
    standard errors (independent, and paired by seed where the outcomes are in `run_dir`)."""
    from rich.table import Table

    ba = before_after(records, run_dir)
    if ba is None:
        return None
    n = next((r.get("eval/num_seeds") for r in records if _is_number(r.get("eval/num_seeds"))), None)
    if title is None:
        title = "eval before and after training" + (f" ({int(n)} fixed seeds, +- 1 SE)" if n else " (+- 1 SE)")
    caption = ("z: the change over sqrt(SE_before^2 + SE_after^2); paired z: over the standard error of the "
               "per-seed differences; above 2: higher by more than two standard errors. Random and optimal "
               "policy: their success on the same seeds and action horizon")
    table = Table(title=title, caption=caption)
    for col in ("eval", f"iter {ba['before']}", f"iter {ba['after']}", "change", "z", "paired z"):
        table.add_column(col)

    def fmt(v, se):
        return f"{v:.3f}" + (f" +- {se:.3f}" if se is not None else "")

    def z(v):
        return f"{v:+.1f}" if v is not None else ""

    shown = {row["key"] for row in ba["rows"]}
    for row in ba["rows"]:
        table.add_row(row["label"], fmt(row["before"], row["before_se"]), fmt(row["after"], row["after_se"]),
                      f"{row['change']:+.3f}", z(row["z"]), z(row["z_paired"]))
        if row["key"] == "eval/success_rate":  # an env without reference lines: say so, invent none
            for key, label, _ in BEFORE_AFTER_KEYS[1:3]:
                if key not in shown:
                    table.add_row(label, "not known", "not known", "", "", "")
    return table


def rollout_metrics(batch, prefix: str = "train") -> dict:
    """Scalars describing a TrajectoryBatch: success rate, score mean/std, in-group reward std,
    response length (model tokens per trajectory), tokens per trajectory, turns, format-penalty
    rate and the engine's own rates (valid / effective actions, truncation)."""
    from fastpo.algorithms.filtering import group_reward_std

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
    fp = batch.format_penalty
    turns = batch.num_turns.clamp_min(1).float()
    out[f"{prefix}/format_penalty_rate"] = float(((fp != 0).float().sum(dim=1) / turns).mean())
    out[f"{prefix}/format_valid"] = 1.0 - out[f"{prefix}/format_penalty_rate"]
    mine = {"success_rate", "score", "num_turns", "truncated_rate", "format_penalty_rate", "format_valid"}
    for k, v in (batch.metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in mine:
            # the engine's response_length is per turn; ours (above) is per trajectory
            out[f"{prefix}/{'response_length_per_turn' if k == 'response_length' else k}"] = float(v)
    return out
