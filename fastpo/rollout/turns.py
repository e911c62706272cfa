"""One turn of the game for B trajectories: the responses parsed, their actions run in the
batched env, the turn scored (StarPO's per-turn reward with RAGEN's format penalty), and why a
trajectory stops. The multi-turn rollout (fastpo/rollout/multiturn.py) calls it every turn,
and so do the benchmarks' reference loop, DAgger's labels and the tests, so that every loop
plays the same game.

Format penalty: a turn whose answer is missing or holds an invalid action gets
`format_penalty` added to its reward and still counts as a turn. What counts as an answer
is `cfg.format_rule` (parsing.py): "ragen" (default) is RAGEN's rule: the first
think/answer pattern anywhere in the response; without it no action runs; with it the
answer's valid actions run (invalid ones are dropped and penalised). "strict" also
penalises a response that is not exactly the pattern (extra text, a stray tag, a second
block); its valid actions still run when `run_valid_actions_on_format_error` (default True)
and a complete answer block is found. With run_valid_actions_on_format_error=False a
penalised turn executes nothing under either rule.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from fastpo.config.schema import RolloutConfig

from .parsing import parse_response
from .prompts import move_question


@dataclasses.dataclass
class TurnCounters:
    """Action and format tallies over a rollout (for the rate metrics)."""

    pieces: int = 0  # answer pieces (recognised + unrecognised)
    valid: int = 0  # recognised action names
    executed: int = 0
    effective: int = 0  # executed actions that changed the state
    penalised: int = 0  # turns with a format penalty
    turns: int = 0

    def add(self, pieces: int, valid: int, executed: int, effective: int, penalised: bool) -> None:
        """Count one trajectory's turn."""
        self.pieces += int(pieces)
        self.valid += int(valid)
        self.executed += int(executed)
        self.effective += int(effective)
        self.penalised += int(penalised)
        self.turns += 1

    def rates(self) -> dict:
        return {
            "valid_action_rate": self.valid / max(1, self.pieces),
            "effective_action_rate": self.effective / max(1, self.executed),
            "format_penalty_rate": self.penalised / max(1, self.turns),
        }


@dataclasses.dataclass
class EnvTurn:
    """What one turn did to the B trajectories (zeros for those not stepped).

    reward: float32 [B], env reward + format penalty. penalty: float32 [B]. ok: bool [B],
    the answer was well formed with only valid actions. done: bool [B], the env ended.
    executed: int64 [B]. notes: B feedback strings for the next user message.
    valid / invalid: int64 [B], recognised action names / unrecognised answer pieces.
    effective: int64 [B], executed actions that changed the state.
    """

    reward: np.ndarray
    penalty: np.ndarray
    ok: np.ndarray
    done: np.ndarray
    executed: np.ndarray
    notes: list
    valid: np.ndarray = None
    invalid: np.ndarray = None
    effective: np.ndarray = None


def env_turn(env, cfg: RolloutConfig, texts: list, actions_left: np.ndarray, counters: TurnCounters | None = None) -> EnvTurn:
    """Parse B response texts, run their actions in `env` and score the turn.

    texts: B response texts including the generation prime, or None for trajectories that
    take no turn now. actions_left: int64 [B] action budget, decreased in place by the
    executed actions. A turn whose answer is missing or malformed under cfg.format_rule, or
    holds an invalid action (or none), gets cfg.format_penalty; the valid actions of an
    answer that was found still run when cfg.run_valid_actions_on_format_error (under
    "ragen" a response without the pattern has no answer, so nothing runs). Only the first
    max_actions_per_turn answer pieces are read, and actions past actions_left are not run
    (neither is penalised), as RAGEN. Never raises on any text.
    """
    B = len(texts)
    answers = [""] * B
    fmt_ok = np.zeros(B, dtype=bool)
    has_answer = np.zeros(B, dtype=bool)
    stepped = np.array([t is not None for t in texts], dtype=bool)
    for b, text in enumerate(texts):
        if text is None:
            continue
        parsed = parse_response(text, think=cfg.think, rule=cfg.format_rule)
        answers[b] = parsed.answer or ""
        has_answer[b] = parsed.answer is not None
        fmt_ok[b] = parsed.format_ok
    if getattr(env, "free_text", False):
        return _free_text_turn(env, cfg, answers, fmt_ok, has_answer, stepped, actions_left, counters)
    k_turn = cfg.max_actions_per_turn
    pa = env.parse_actions(answers, k_turn)
    acts = pa.actions.copy()
    limit = np.minimum(k_turn, actions_left)
    acts[np.arange(k_turn)[None, :] >= limit[:, None]] = -1
    ok = fmt_ok & pa.all_valid & has_answer & stepped
    run_actions = ok | (has_answer & bool(cfg.run_valid_actions_on_format_error))
    acts[~run_actions] = -1
    res = env.step(acts, active=stepped)
    penalty = np.where(stepped & ~ok, np.float32(cfg.format_penalty), np.float32(0)).astype(np.float32)
    reward = np.where(stepped, res.reward + penalty, 0).astype(np.float32)
    executed = res.num_executed.astype(np.int64)
    actions_left -= executed
    notes = [""] * B
    valid = np.zeros(B, dtype=np.int64)
    invalid = np.zeros(B, dtype=np.int64)
    effective = np.zeros(B, dtype=np.int64)
    for b in np.flatnonzero(stepped):
        valid[b] = int(pa.num_actions[b])
        invalid[b] = len(pa.invalid[b])
        effective[b] = int(res.effective[b].sum())
        if cfg.feedback_invalid and not ok[b]:
            notes[b] = ("Invalid actions: " + ", ".join(pa.invalid[b]) + ".") if pa.invalid[b] else \
                "Your answer was not in the required format."
        if counters is not None:
            counters.add(valid[b] + invalid[b], valid[b], executed[b], effective[b], not ok[b])
    return EnvTurn(reward, penalty, ok, res.done.copy() & stepped, executed, notes, valid, invalid, effective)


def _free_text_turn(env, cfg: RolloutConfig, answers: list, fmt_ok, has_answer, stepped, actions_left,
                    counters: TurnCounters | None) -> EnvTurn:
    """`env_turn` for a free-text game (`env.free_text`, fastpo.envs.batched): each found
    answer goes whole to `env.step_text` (under "strict" a malformed response's answer only
    with cfg.run_valid_actions_on_format_error) and costs one action of the budget. The turn
    is penalised unless the answer was well formed and the game accepted it (its
    info["valid"]). Counts: one answer piece per found answer, valid = accepted."""
    B = len(answers)
    run = stepped & has_answer & (fmt_ok | bool(cfg.run_valid_actions_on_format_error))
    res = env.step_text([answers[b] if run[b] else None for b in range(B)], active=stepped)
    accepted = res.valid[:, 0] & run
    ok = fmt_ok & has_answer & stepped & accepted
    penalty = np.where(stepped & ~ok, np.float32(cfg.format_penalty), np.float32(0)).astype(np.float32)
    reward = np.where(stepped, res.reward + penalty, 0).astype(np.float32)
    executed = res.num_executed.astype(np.int64)
    actions_left -= executed
    valid = accepted.astype(np.int64)
    invalid = (has_answer & stepped & ~accepted).astype(np.int64)
    effective = res.effective[:, 0].astype(np.int64)
    notes = [""] * B
    for b in np.flatnonzero(stepped):
        if cfg.feedback_invalid and not ok[b]:
            notes[b] = "The game did not accept your answer." if has_answer[b] and run[b] else \
                "Your answer was not in the required format."
        if counters is not None:
            counters.add(has_answer[b], valid[b], executed[b], effective[b], not ok[b])
    return EnvTurn(reward, penalty, ok, res.done.copy() & stepped, executed, notes, valid, invalid, effective)


def end_reason(turn_result: EnvTurn, b: int, actions_left: np.ndarray, turn: int, max_turns: int) -> str:
    """Why trajectory b stops after this turn ("env_done", "action_budget", "max_turns"), or ""."""
    if turn_result.done[b]:
        return "env_done"
    if actions_left[b] <= 0:
        return "action_budget"
    if turn == max_turns - 1:
        return "max_turns"
    return ""


def closing_question(cfg: RolloutConfig, action_names) -> str:
    """The closing question of a trajectory's user messages (`prompts.move_question` for its
    action names); "" without rollout.prompt_examples, in think mode or for a free-text game
    (no action names)."""
    if not cfg.prompt_examples or cfg.think or not action_names:
        return ""
    return move_question(action_names, cfg.max_actions_per_turn)


def merged_turn(games: list, texts: list, actions_left: np.ndarray, counters: TurnCounters | None = None) -> EnvTurn:
    """`env_turn` of each game of a mixture on its own trajectories, under its own settings
    (action limits, format penalty), scattered back into one EnvTurn of the B trajectories.

    games: (env, cfg, idx) per game: its batched env (len(idx) instances, instance i playing
    trajectory idx[i]), its RolloutConfig and idx, int64 indices into the B trajectories.
    texts, actions_left (decreased in place), counters: as `env_turn`'s, over all B.
    """
    B = len(texts)
    out = EnvTurn(np.zeros(B, np.float32), np.zeros(B, np.float32), np.zeros(B, bool), np.zeros(B, bool),
                  np.zeros(B, np.int64), [""] * B, np.zeros(B, np.int64), np.zeros(B, np.int64), np.zeros(B, np.int64))
    for env, cfg, idx in games:
        sub = [texts[b] for b in idx]
        if all(t is None for t in sub):
            continue
        left = actions_left[idx]
        res = env_turn(env, cfg, sub, left, counters)
        actions_left[idx] = left
        for f in ("reward", "penalty", "ok", "done", "executed", "valid", "invalid", "effective"):
            getattr(out, f)[idx] = getattr(res, f)
        for b, note in zip(idx, res.notes):
            out.notes[b] = note
    return out
