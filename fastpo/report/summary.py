"""The end-of-run tables: the summary of the main metrics (first, last, best) and the eval
before and after training, in standard errors, paired by seed where a run's per-trajectory
outcomes (eval/iter_*.json) are there."""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np

from fastpo.report.stats import finite_number, standard_error

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


def print_table(console, table) -> None:
    """Print rich Table `table` on `console`: at the terminal's width on a terminal, and at the
    table's own width elsewhere (a log file or a pipe, which rich renders 80 columns wide), so
    that a log holds each row on one line."""
    from rich.measure import Measurement

    if console.is_terminal:
        console.print(table)
        return
    was = console.width
    wide = Measurement.get(console, console.options.update(width=1000), table).maximum
    console.width = max(was, min(wide, 1000))  # (print's own width cannot pass the console's)
    try:
        console.print(table)
    finally:
        console.width = was


def summary_table(records: list[dict], title: str = "fastpo run summary"):
    """A rich Table: first, last and best value of the main metrics over the run."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("metric", "first", "last", "best", "iteration of best"):
        table.add_column(col)
    for key, label in SUMMARY_KEYS:
        pts = [(r["iteration"], r[key]) for r in records if finite_number(r.get(key))]
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
        with open(os.path.join(run_dir, "eval", f"iter_{int(iteration):06d}.json"), encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def _evaluations(records: list[dict]) -> list[dict]:
    """The records of a run that hold an evaluation (a finite eval/success_rate), in order."""
    return [r for r in records if finite_number(r.get("eval/success_rate"))]


def before_after(records: list[dict], run_dir: Optional[str] = None) -> Optional[dict]:
    """The evaluation before training (iteration 0) and the last one, compared: None without
    an evaluation at iteration 0 or a later one, else {"before": iteration, "after": iteration, "rows": [{"key", "label",
    "before", "after", "before_se", "after_se", "change", "z", "z_paired"}]}.

    z = change / sqrt(before_se^2 + after_se^2): the change in standard errors of the
    difference of two independent means. z_paired (where `run_dir` holds both evaluations'
    per-trajectory outcomes on the same seeds): mean(d) / (std(d, ddof 1) / sqrt(n)) over the
    per-seed differences d = after - before, which takes out what the seeds themselves make
    easy or hard (a map without a short safe path fails before and after). Either is None
    where it cannot be computed (no standard error, both 0, or no outcomes)."""
    evals = _evaluations(records)
    if len(evals) < 2 or evals[0]["iteration"] != 0:  # no "before": see before_after_note
        return None
    a, b = evals[0], evals[-1]
    oa, ob = _eval_outcomes(run_dir, a["iteration"]), _eval_outcomes(run_dir, b["iteration"])
    paired = oa is not None and ob is not None and oa.get("seed") == ob.get("seed") and bool(oa.get("seed")) \
        and oa.get("env") == ob.get("env")
    rows = []
    for key, label, has_se in BEFORE_AFTER_KEYS + _game_keys(a):
        if not (finite_number(a.get(key)) and finite_number(b.get(key))):
            continue
        row = {"key": key, "label": label, "before": float(a[key]), "after": float(b[key]),
               "before_se": None, "after_se": None, "change": float(b[key]) - float(a[key]), "z": None,
               "z_paired": None}
        if has_se and finite_number(a.get(f"{key}_se")) and finite_number(b.get(f"{key}_se")):
            row["before_se"], row["after_se"] = float(a[f"{key}_se"]), float(b[f"{key}_se"])
            se = math.hypot(row["before_se"], row["after_se"])
            row["z"] = row["change"] / se if se > 0 else None
        if has_se and paired:
            row["z_paired"] = _paired_z(oa, ob, key)
        rows.append(row)
    return {"before": a["iteration"], "after": b["iteration"], "rows": rows}


def _game_keys(record: dict) -> list:
    """Before/after rows of each game of a mixture (its `eval/<label>/...` keys in `record`)."""
    labels = [k.split("/")[1] for k in record if k.count("/") == 2 and k.startswith("eval/")
              and k.endswith("/success_rate")]
    return [(f"eval/{g}/{key.split('/', 1)[1]}", f"{label} ({g})", has_se)
            for g in labels for key, label, has_se in BEFORE_AFTER_KEYS[:3]]


def _paired_z(oa: dict, ob: dict, key: str) -> Optional[float]:
    """Paired z of metric `key` (eval/<metric> or eval/<game>/<metric>) between two evaluations'
    per-trajectory outcomes: mean(d) / SE(d) over d = after - before. A mixture's outcomes
    carry `env` and `weight`: a game's rows use its own trajectories, the whole the weighted
    mean sum(weight d) with SE sqrt(sum over games of (its weight)^2 var(d) / n)."""
    parts = key.split("/")
    name, game = parts[-1], (parts[1] if len(parts) == 3 else None)
    if not (isinstance(oa.get(name), list) and isinstance(ob.get(name), list) and len(oa[name]) == len(ob[name])):
        return None
    d = np.asarray(ob[name], dtype=np.float64) - np.asarray(oa[name], dtype=np.float64)
    env = oa.get("env")
    if game is not None or env is None:
        if game is not None:
            if env is None:
                return None
            d = d[np.asarray(env) == game]
        if len(d) < 2:
            return None
        se = standard_error(d)
        return float(d.mean() / se) if se > 0 else None
    w = np.asarray(oa.get("weight") or [1.0 / len(d)] * len(d), dtype=np.float64)
    env = np.asarray(env)
    var = 0.0
    for g in dict.fromkeys(env.tolist()):
        sel = env == g
        if sel.sum() < 2:
            return None
        var += float(w[sel].sum()) ** 2 * standard_error(d[sel]) ** 2
    return float(np.dot(w, d) / math.sqrt(var)) if var > 0 else None


def result_line(records: list[dict], run_dir: Optional[str] = None) -> Optional[str]:
    """One plain line on what a run's last evaluation shows (None without one at iteration >= 1):
    its success against the random policy's on the same seeds (an expectation per seed, taken as
    known: `fastpo.evaluation.policy.success_bounds`; so z = (success - random) / SE(success), "above" or
    "below" beyond 2, "within 2 SE" otherwise), the optimal policy's beside it, and which
    before/after rows (`before_after`) changed by more than 2 standard errors since the
    evaluation before training (paired where the per-seed outcomes are in `run_dir`; a change
    with a standard error of 0, every seed moving alike, is named too). Each z is judged as
    printed, to one decimal, so the words never contradict the figure. A run that learnt only
    the answer format says so here rather than leaving the reader to compare the table's rows."""
    evals = _evaluations(records)
    if not evals or evals[-1].get("iteration", 0) < 1:
        return None
    last = evals[-1]
    succ, se = float(last["eval/success_rate"]), last.get("eval/success_rate_se")
    text = f"result (eval at iteration {last['iteration']}): success {succ:.3f}"
    text += f" +- {se:.3f}" if finite_number(se) else ""
    rnd, opt = last.get("eval/random_success"), last.get("eval/optimal_success")
    refs = f", optimal {float(opt):.3f}" if finite_number(opt) else ""
    if finite_number(rnd):
        rnd = float(rnd)
        if finite_number(se) and se > 0:
            z = round((succ - rnd) / se, 1)
            where = ("above the random policy's {r:.3f} by more than 2 SE" if z > 2 else
                     "below the random policy's {r:.3f} by more than 2 SE" if z < -2 else
                     "within 2 SE of the random policy's {r:.3f}, not shown above random play").format(r=rnd)
            text += f" is {where} (z {z:+.1f}"
        else:  # no standard error to scale by
            where = "above" if succ > rnd else "below" if succ < rnd else "equal to"
            why = "every seed the same" if finite_number(se) else "none recorded"
            text += f" is {where} the random policy's {rnd:.3f} (no SE: {why}"
        text += f"; on the same seeds{refs})"
    else:
        text += f" (no random-policy line in this evaluation{refs})"
    ba = before_after(records, run_dir)
    if ba is not None:
        moved = {"rose": [], "fell": []}
        for row in ba["rows"]:
            paired = row["z_paired"] is not None
            z = row["z_paired"] if paired else row["z"]
            if z is not None:
                z = round(z, 1)
                how = f"{'paired ' if paired else ''}z {z:+.1f}"
            elif row["before_se"] is not None and row["change"] != 0:  # both SEs 0: every seed moved alike
                z, how = math.copysign(math.inf, row["change"]), "SE 0"
            if z is not None and abs(z) > 2:
                moved["rose" if z > 0 else "fell"].append(f"{row['label'].strip()} {row['change']:+.3f} ({how})")
        changes = [f"{k} by more than 2 SE since iteration {ba['before']}: " + ", ".join(v)
                   for k, v in moved.items() if v]
        text += "; " + ("; ".join(changes) if changes else
                        f"nothing changed by more than 2 SE since iteration {ba['before']}")
    return text


def nothing_trained(records: list[dict]) -> Optional[str]:
    """One line when a run's iterations trained nothing: none of its records past iteration 0
    applied an update (`actor/updates`) and at least one skipped one for a non-finite loss or
    gradient (`actor/skipped_updates`). None otherwise (an iteration with an update; a run
    that only skipped for lack of data, which is no failure)."""
    trained = [r for r in records if r.get("iteration", 0) >= 1]
    skipped = sum(r.get("actor/skipped_updates") or 0 for r in trained if finite_number(r.get("actor/skipped_updates")))
    if not trained or skipped == 0 or any((r.get("actor/updates") or 0) > 0 for r in trained
                                          if finite_number(r.get("actor/updates"))):
        return None
    its = trained[0]["iteration"], trained[-1]["iteration"]
    which = f"iteration {its[0]}" if its[0] == its[1] else f"iterations {its[0]}-{its[1]}"
    return (f"nothing was trained: every update of {which} was skipped ({int(skipped)} for a non-finite loss or "
            f"gradient, see the warnings above); look for rewards or settings so large that float32 overflows")


def game_result_lines(records: list[dict]) -> list[str]:
    """One line per game of a mixture run's last evaluation (its `eval/<label>/...` figures):
    success +- SE against that game's random and optimal lines on the same seeds, for the
    console where no before/after table lists them (no evaluation before training). [] for a
    run of one game or without an evaluation."""
    evals = _evaluations(records)
    if not evals:
        return []
    last = evals[-1]
    labels = [k.split("/")[1] for k in last if k.count("/") == 2 and k.startswith("eval/")
              and k.endswith("/success_rate") and finite_number(last[k])]
    lines = []
    for g in labels:
        se = last.get(f"eval/{g}/success_rate_se")
        refs = [f"{name} {float(last[k]):.3f}" for name, k in (("random", f"eval/{g}/random_success"),
                                                               ("optimal", f"eval/{g}/optimal_success"))
                if finite_number(last.get(k))]
        succ = float(last[f"eval/{g}/success_rate"])
        lines.append(f"  {g} (eval at iteration {last['iteration']}): success {succ:.3f}"
                     + (f" +- {float(se):.3f}" if finite_number(se) else "")
                     + (f" ({', '.join(refs)} on the same seeds)" if refs else ""))
    return lines


def before_after_note(records: list[dict]) -> Optional[str]:
    """One line for a run that evaluated but not before training (no iteration-0 record:
    trainer.eval_before_training off, or that evaluation stopped by a signal), where
    `before_after` compares nothing: why there is no before/after table (`result_line` gives
    the last evaluation). None when there is an evaluation at iteration 0, or none at all."""
    evals = _evaluations(records)
    if not evals or evals[0]["iteration"] == 0:
        return None
    return ("no evaluation before training (trainer.eval_before_training is off, or it was stopped), so no "
            "before/after table")


def before_after_table(records: list[dict], title: Optional[str] = None,
                       run_dir: Optional[str] = None):
    """A rich Table of `before_after(records, run_dir)` (None with fewer than two
    evaluations): value +- standard error before and after, the change, and the change in
    standard errors (independent, and paired by seed where the outcomes are in `run_dir`)."""
    from rich.table import Table

    ba = before_after(records, run_dir)
    if ba is None:
        return None
    n = next((r.get("eval/num_seeds") for r in records if finite_number(r.get("eval/num_seeds"))), None)
    if title is None:
        title = "eval before and after training" + (f" ({int(n)} fixed seeds, +- 1 SE)" if n else " (+- 1 SE)")
    caption = ("z: the change over sqrt(SE_before^2 + SE_after^2); paired z: over the standard error of the "
               "per-seed differences; above 2: higher by more than two standard errors. Random and optimal "
               "policy: their success on the same seeds and action horizon")
    def fmt(v, se):
        return f"{v:.3f}" + (f" +- {se:.3f}" if se is not None else "")

    def z(v):
        return f"{v:+.1f}" if v is not None else ""

    shown, lines = {row["key"] for row in ba["rows"]}, []
    for row in ba["rows"]:
        lines.append((row["label"], fmt(row["before"], row["before_se"]), fmt(row["after"], row["after_se"]),
                      f"{row['change']:+.3f}", z(row["z"]), z(row["z_paired"])))
        if row["key"].endswith("success_rate"):  # an env without reference lines: say so, invent none
            for key, label, _ in BEFORE_AFTER_KEYS[1:3]:
                key, label = row["key"].replace("success_rate", key.split("/")[-1]), \
                    label + row["label"][len("success"):]
                if key not in shown:
                    lines.append((label, "not known", "not known", "", "", ""))
    table = Table(title=title, caption=caption)
    # a game's long label is shown whole, never cut to "heldback_nim…" (a narrow or non-terminal
    # console is 80 columns wide): the figures' columns wrap instead
    table.add_column("eval", no_wrap=True, min_width=max(len(line[0]) for line in lines))
    for col in (f"iter {ba['before']}", f"iter {ba['after']}", "change", "z", "paired z"):
        table.add_column(col)
    for line in lines:
        table.add_row(*line)
    return table
