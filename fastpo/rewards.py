"""Reward functions: a user's `module:function` that scores each finished trajectory, added to
the game's reward or replacing it (`reward.fn`, `reward.mode`), for rewards a game does not
give (a rubric, a length budget, a verifier of your own).

    # mygrader.py
    def grade(t):                       # t: a fastpo.rewards.Trajectory
        return 1.0 if "please" in t.responses[-1] else 0.0    # or one float per turn

    fastpo train --env mymod:Game reward.fn=mygrader:grade reward.mode=add

A float goes on the trajectory's last turn; a list gives each turn its own. With mode "add"
it is added to the game's turn rewards; with "replace" it replaces them (the format penalty
stays). The trajectory score (the sum of its turn rewards) follows, so every estimator,
filter and metric sees the result. Applied to the training rollouts; the evaluation reports
the game's own success. A function that raises (or calls `sys.exit`) or returns something
else than a finite float within float32's range (or a list of one per turn) stops the run with
one line naming the function, the env and the instance's seed (`fastpo.envs.EnvError`, as a
failing game; the `fastpo` command exits 1).
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import os
import sys
from typing import Callable

import torch

from fastpo.config.fields import FLOAT32_MAX
from fastpo.envs.errors import EnvError, user_code_failure

REWARD_MODES = ("add", "replace")


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """What a reward function reads of one finished trajectory.

    env: the game's name; seed: the instance's seed; user_messages: the user messages in order
    (the first, with the task, then one per continued turn); responses: the model's answer of
    each turn (text); env_rewards: the game's reward of each turn (format penalty excluded);
    format_penalty: each turn's format penalty (<= 0); success: the game's verdict;
    stop_reason: why it ended ("env_done", "max_turns", "action_budget", "context");
    final_observation: the game's state after the last turn (what the model was not shown;
    "" when the rollout did not record it).
    """

    env: str
    seed: int
    user_messages: list
    responses: list
    env_rewards: list
    format_penalty: list
    success: bool
    stop_reason: str
    final_observation: str = ""


def trajectory_of(batch, i: int, env: str) -> Trajectory:
    """Trajectory i of TrajectoryBatch `batch` as a reward function (or the judge) reads it; `env`:
    its game's name when the batch does not record each trajectory's (env_labels)."""
    n = int(batch.num_turns[i])
    env_r = (batch.turn_rewards[i, :n] - batch.format_penalty[i, :n]).tolist()
    labels = getattr(batch, "env_labels", None)  # a mixture: the game each trajectory played
    finals = getattr(batch, "final_observations", None)
    return Trajectory(env=labels[i] if labels else env, seed=int(batch.seeds[i]),
                      user_messages=list(batch.user_messages[i]) if batch.user_messages else [],
                      responses=list(batch.response_texts[i][:n]), env_rewards=env_r,
                      format_penalty=batch.format_penalty[i, :n].tolist(), success=bool(batch.success[i]),
                      stop_reason=str(batch.stop_reason[i]), final_observation=str(finals[i]) if finals else "")


def load_reward_fn(spec: str) -> Callable:
    """The callable named by "module.path:function" (the current folder importable, as for
    games). Raises ValueError with one line naming `spec` when it does not import or is not
    callable."""
    module, _, attr = spec.partition(":")
    if not module.strip() or not attr.strip():
        raise ValueError(f"reward function {spec!r}: the form is 'module.path:function'")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module.strip())
    except Exception as e:
        first = (str(e).strip().splitlines() or ["(no message)"])[0][:300]
        raise ValueError(f"reward function {spec!r}: importing {module.strip()!r} failed: {type(e).__name__}: "
                         f"{first}") from None
    for part in attr.strip().split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward function {spec!r}: module {module.strip()!r} has no {attr.strip()!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {spec!r}: {attr.strip()!r} is a {type(obj).__name__}, not a function")
    return obj


class RewardFunction:
    """`reward.fn` and the LLM judge (fastpo.judge) bound to a run: `apply(batch)` rescores a
    TrajectoryBatch in place. spec: "module:function" or None; judge: a fastpo.judge.Judge or
    None (at least one of the two)."""

    def __init__(self, spec: str | None, mode: str, env: str, judge=None):
        if mode not in REWARD_MODES:
            raise ValueError(f"reward mode {mode!r}: choose one of {REWARD_MODES}")
        self.spec, self.mode, self.env, self.judge = spec, mode, env, judge
        self.fn = load_reward_fn(spec) if spec is not None else None

    def apply(self, batch) -> dict:
        """Score each trajectory of `batch` (a fastpo.rollout.trajectory_batch.TrajectoryBatch): reward.fn's
        values plus the judge's score on the last turn, put on the turn rewards (mode add or
        replace) and the score. Returns sums over this batch: "reward_fn_sum" (the function's
        values over turns and trajectories), "count" (trajectories), and with a judge "judged"
        (trajectories with a turn, the ones judged), "judge_score_sum", "judge_unparsed",
        "judge_too_long", "judge_seconds" (the trainer averages over every process). Raises
        EnvError naming the function, the env and the seed."""
        n_traj = len(batch.scores)
        trajs = [self._trajectory(batch, i) for i in range(n_traj)]
        values = [self._values(t) if self.fn is not None else [0.0] * len(t.responses) for t in trajs]
        out = {"reward_fn_sum": float(sum(sum(v) for v in values)), "count": float(n_traj)}
        if self.judge is not None:
            judged = [i for i, t in enumerate(trajs) if t.responses]  # (no turn: no answer to judge)
            verdicts = self.judge.grade([trajs[i] for i in judged])
            for i, score in zip(judged, verdicts.scores):
                values[i][-1] += score
            out.update(judged=float(len(judged)), judge_score_sum=float(sum(verdicts.scores)),
                       judge_unparsed=float(len(judged) - sum(verdicts.parsed)),
                       judge_too_long=float(verdicts.too_long), judge_seconds=verdicts.seconds)
        for i, vals in enumerate(values):
            n = len(vals)
            pen = batch.format_penalty[i, :n]
            new = torch.tensor(vals, dtype=batch.turn_rewards.dtype)
            if self.mode == "add":
                batch.turn_rewards[i, :n] += new
            else:
                batch.turn_rewards[i, :n] = new + pen
            batch.scores[i] = batch.turn_rewards[i].sum().to(batch.scores.dtype)
        return out

    def _trajectory(self, batch, i: int) -> Trajectory:
        return trajectory_of(batch, i, self.env)

    def _values(self, traj: Trajectory) -> list:
        n = len(traj.responses)
        where = f"reward function {self.spec!r} on env {traj.env!r}, seed {traj.seed}"
        try:
            out = self.fn(traj)
        except BaseException as e:  # sys.exit in it must not end the run silently
            said = user_code_failure(e)
            if said is None:  # a Ctrl-C: the trainer's to handle
                raise
            raise EnvError(f"{where} {said}") from None
        if isinstance(out, (list, tuple)):
            if len(out) != n:
                raise EnvError(f"{where} returned {len(out)} values for {n} turns; return one float, or one per turn")
            values = list(out)
        else:
            values = [0.0] * (n - 1) + [out] if n else []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise EnvError(f"{where} returned {out!r}; return a finite float, or a list of one per turn")
            if abs(v) > FLOAT32_MAX:  # rewards are float32 tensors: it would be inf there, every update skipped
                raise EnvError(f"{where} returned {v!r}, beyond float32's range (+-{FLOAT32_MAX:.4g}) in which "
                               f"rewards are kept; scale it down")
        return [float(v) for v in values]
