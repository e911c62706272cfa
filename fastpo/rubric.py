"""The LLM judge's text side (fastpo.judge): the rubric's checks and placeholders, and the
verdict read from a judge's reply. No model here, so the config's checks can use it before
anything loads."""
from __future__ import annotations

import os
import re

JUDGE_SCALES = ("yes_no", "number")
PLACEHOLDERS = ("{answer}", "{task}", "{transcript}", "{env}", "{final}")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
# a number as a judge writes one: 7, 7.5, .5, 1,000, 1e3 (thousands separators dropped)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


def check_rubric(text: str) -> str:
    """`text` when it is a usable rubric; raises ValueError (one line) for a rubric without
    `{answer}` or `{transcript}` (the judge would not see what it grades)."""
    if "{answer}" not in text and "{transcript}" not in text:
        raise ValueError("the rubric has no place for the answer: put {answer} (the last response) or {transcript} "
                         "(every turn) in it")
    return text


def read_rubric(path: str) -> str:
    """The rubric in the UTF-8 file `path` (`check_rubric`ed). Raises ValueError (one line) for a
    missing or unreadable file and for a rubric `check_rubric` refuses."""
    path = os.path.expanduser(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the rubric file {path!r}: {type(e).__name__}: {e}") from None
    return check_rubric(text)


def rubric_of(reward_cfg) -> str | None:
    """The rubric text of a run's `reward` section: judge_rubric, or judge_rubric_file's text;
    None without a judge."""
    r = reward_cfg
    if r.judge_rubric_file is not None:
        return read_rubric(r.judge_rubric_file)
    return None if r.judge_rubric is None else check_rubric(r.judge_rubric)


def render_rubric(rubric: str, traj) -> str:
    """The judge's user message for `traj` (a fastpo.rewards.Trajectory): `rubric` with its
    placeholders filled in (module docstring); other braces untouched."""
    turns = []
    for i, resp in enumerate(traj.responses):
        if i < len(traj.user_messages):
            turns.append(f"User: {traj.user_messages[i]}")
        turns.append(f"Assistant: {resp}")
    fill = {"{answer}": traj.responses[-1] if traj.responses else "",
            "{task}": traj.user_messages[0] if traj.user_messages else "",
            "{transcript}": "\n".join(turns), "{env}": traj.env,
            "{final}": getattr(traj, "final_observation", "")}
    # one pass, so that a filled-in text holding "{answer}" is not filled again
    return re.sub("|".join(re.escape(p) for p in PLACEHOLDERS), lambda m: fill[m.group(0)], rubric)


def parse_verdict(reply: str, scale: str, lo: float = 0.0, hi: float = 10.0) -> float | None:
    """The score in [0, 1] that `reply` gives under `scale` ("yes_no" or "number" in
    [lo, hi]; module docstring), or None when it gives none."""
    if scale == "yes_no":
        m = _YES_NO.search(reply)
        return None if m is None else float(m.group(1).lower() == "yes")
    m = _NUMBER.search(reply)
    if m is None:
        return None
    x = float(m.group(0).replace(",", "")) + 0.0  # (+ 0.0: no -0.0)
    return (x - lo) / (hi - lo) + 0.0 if lo <= x <= hi else None
