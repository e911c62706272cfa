"""The run's PNG curves (matplotlib, Agg): every curve raw and EMA-smoothed (`plot_curves`),
eval success beside the random and optimal policy (`plot_eval`), the collapse metrics
(`plot_collapse`); each titled with the model's label, so random weights show."""
from __future__ import annotations

import os
from typing import Optional

from fastpo.report.stats import finite_number

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
        pts = [(r["iteration"], r[key]) for r in records if finite_number(r.get(key))]
        if not pts:
            continue
        ema = [(r["iteration"], r[f"ema/{key}"]) for r in records if finite_number(r.get(f"ema/{key}"))]
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
    if keys is None and any(finite_number(r.get("collapse/mi_estimate")) for r in records):
        written.append(plot_collapse(records, os.path.join(out_dir, "collapse.png"), model_label))
    if keys is None and any(finite_number(r.get("eval/success_rate")) for r in records):
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
        return [(r["iteration"], r[key], r.get(f"{key}_se")) for r in records if finite_number(r.get(key))]

    def last(key):
        vals = [r[key] for r in records if finite_number(r.get(key))]
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
            err = [p[2] if finite_number(p[2]) else 0.0 for p in ev]
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
        return [(r["iteration"], r[key]) for r in records if finite_number(r.get(key))]

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
