"""DAgger's labels: the expert's answer in each state a model's trajectories reached
(`label_trajectories`), and the training conversations made of them
(`labelled_conversations`, TRL's chat format; `"weight": 0` marks context, OpenAI's
fine-tuning format).

The labels come from replaying each trajectory: a fresh copy of the game is reset from the
trajectory's seed and stepped with the model's own answers through the rollout's own turn
function (`fastpo.rollout.turns.env_turn`), and the game's expert (the batched env's
`expert_answers`, as for the SFT data) is asked before each step. A game whose `reset(seed)`
and `step` are deterministic (the built-in games' slips and a user game's random draws
included: both are seeded by the seed) reaches the states the rollout reached; a replay that
renders another state than the one the model was shown is refused (EnvError). An expert that
answers with moves (the built-in games) labels a state with its first moves, up to the turn's
action cap and the actions left (FrozenLake's one move; Sokoban's shortest solution from the
state, or no label where it has none, e.g. a box pushed into a corner; the Bandit's better
arm); one that answers with text (a user game's `expert()`) with that text.
"""
from __future__ import annotations

import json
import re
from typing import Optional

import numpy as np

from fastpo.config.fields import ConfigError
from fastpo.envs import EnvError
from fastpo.rollout.turns import env_turn
from fastpo.sft.experts import expert_answer_text


def state_labels(env, indices: list, actions_left: np.ndarray, per_turn: int) -> dict:
    """{b: the expert's answer in instance b's current state} for `indices` of batched `env`:
    its first moves (a list of names: at most `per_turn`, capped by the actions left, at least
    one), or its text answer (a str), or None where it has no moves. actions_left: int [B].
    Raises EnvError (a user game's expert failing)."""
    out = {}
    for b, answer in zip(indices, env.expert_answers(indices, actions_left)):
        if isinstance(answer, str):
            out[b] = answer
        else:
            out[b] = list(answer[:max(1, min(per_turn, int(actions_left[b])))]) if answer else None
    return out


def label_trajectories(batch, rollout, actions_per_turn: int = 0) -> list[list]:
    """The expert's answer in each state a rollout's trajectories were given (DAgger's labels).

    batch: a TrajectoryBatch of `rollout` (a fastpo.rollout.MultiTurnRollout of one game; any
    group size). Each trajectory is replayed on a fresh copy of the game reset from its seed:
    before turn k the expert (`state_labels`) is asked, then the turn is stepped with the
    trajectory's own response text through `env_turn`, exactly as the rollout stepped it.
    actions_per_turn: the expert's moves per answer on Sokoban (0: rollout.max_actions_per_turn;
    capped by it), as `sft.actions_per_turn`.

    Returns, per trajectory, one entry per answered turn: the label as the model would write
    it (the rollout's prime and `expert_answer_text`, e.g. "<answer>Right</answer>"),
    or None where the expert has no answer. Raises EnvError when a replayed state is not the one
    the rollout showed (a game whose reset or step is not a function of the seed and the
    answers), ConfigError when a label does not fit rollout.max_new_tokens.
    """
    if rollout.mixed:
        raise ValueError("label_trajectories takes the rollout of one game, not a mixture")
    cfg, chat, tok = rollout.cfg, rollout.chat, rollout.tokenizer
    B = len(batch)
    per_turn = min(actions_per_turn or cfg.max_actions_per_turn, cfg.max_actions_per_turn)
    texts = batch.response_texts
    labels: list[list] = [[] for _ in range(B)]
    env = rollout.make_env(B)
    try:
        shown = env.reset(np.asarray(batch.seeds.tolist(), dtype=np.int64))
        left = np.full(B, cfg.max_actions_per_traj, dtype=np.int64)
        for k in range(max((len(t) for t in texts), default=0)):
            going = [b for b in range(B) if k < len(texts[b])]
            shown = shown if k == 0 else env.render()
            for b in going:  # the replay must be where the rollout was
                if shown[b] not in batch.user_messages[b][k]:
                    raise EnvError(f"environment {rollout.env_name!r}: replaying the trajectory of seed "
                                   f"{int(batch.seeds[b])} with its own answers gave another state at turn {k + 1} "
                                   f"than the rollout showed ({shown[b]!r:.80}); DAgger's labels need a game whose "
                                   f"reset(seed) and step(answer) depend on the seed and the answers alone")
            for b, answer in state_labels(env, going, left, per_turn).items():
                labels[b].append(None if answer is None else _fitted_label(answer, chat, tok, cfg.max_new_tokens,
                                                                           rollout.env_name))
            env_turn(env, cfg, [texts[b][k] if k < len(texts[b]) else None for b in range(B)], left)
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()
    return labels


def _fitted_label(answer, chat, tok, max_new_tokens: int, env_name: str) -> str:
    """`answer` (move names or text) as assistant content; moves past rollout.max_new_tokens
    dropped (at least one kept), as the SFT expert drops them. ConfigError when even that
    does not fit."""
    def size(a) -> int:
        return len(tok(expert_answer_text(a, chat.think), add_special_tokens=False)["input_ids"])

    if isinstance(answer, list):
        while len(answer) > 1 and size(answer) > max_new_tokens:
            answer = answer[:-1]
    if size(answer) > max_new_tokens:
        raise ConfigError(f"config key 'rollout.max_new_tokens' = {max_new_tokens}: the expert's answer "
                          f"{expert_answer_text(answer, chat.think)!r:.120} of {env_name!r} takes {size(answer)} "
                          f"tokens")
    return chat.prime + expert_answer_text(answer, chat.think)


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_content(text: str) -> Optional[str]:
    """The first `<answer>` block's content of a response, its "||"-separated moves stripped
    ("Up ||Left " -> "Up || Left"); None without a complete block."""
    m = _ANSWER.search(text or "")
    return None if m is None else " || ".join(p.strip() for p in m.group(1).split("||"))


def labelled_conversations(batch, labels: list, system: str, history: str = "own", per_trajectory: int = 0,
                           rng: Optional[np.random.Generator] = None) -> tuple[list, int, int]:
    """DAgger's training conversations from a rollout `batch` and its `labels`
    (`label_trajectories`; None: a turn without a label, never a target).

    history "own": one conversation per labelled turn k: `system`, then turns 0..k-1 with
    the trajectory's own answers as context ({"role": "assistant", "content": answer,
    "weight": 0}), then turn k's user message with its label as the one target; with
    `per_trajectory` > 0, that many of a trajectory's labelled turns, drawn with `rng` (a
    numpy Generator). history "expert": one conversation per trajectory, every answer replaced
    by its label (cut before its first unlabelled turn).

    Returns ({"messages": [...]} rows in TRL's chat format, answered turns whose answer
    (`answer_content`) was the label's, labelled turns)."""
    rows, agree, total = [], 0, 0
    for b in range(len(batch)):
        answers = [t.strip() for t in batch.response_texts[b]]
        users = batch.user_messages[b][:len(answers)]
        lab = labels[b]
        marked = [k for k, x in enumerate(lab) if x is not None]
        for k in marked:
            got = answer_content(answers[k])
            agree += int(got is not None and got == answer_content(lab[k]))
        total += len(marked)
        if history == "expert":
            msgs = [{"role": "system", "content": system}]
            for user, label in zip(users, lab):
                if label is None:
                    break
                msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": label}]
            if len(msgs) > 1:
                rows.append({"messages": msgs})
            continue
        turns = marked
        if 0 < per_trajectory < len(marked):
            turns = [marked[i] for i in sorted(rng.choice(len(marked), per_trajectory, replace=False).tolist())]
        for k in turns:
            msgs = [{"role": "system", "content": system}]
            for j in range(k):
                msgs += [{"role": "user", "content": users[j]},
                         {"role": "assistant", "content": answers[j], "weight": 0}]
            msgs += [{"role": "user", "content": users[k]}, {"role": "assistant", "content": lab[k]}]
            rows.append({"messages": msgs})
    return rows, agree, total


def expert_conversations(batch, system: str) -> list:
    """The expert's own trajectories (`fastpo.sft.experts.expert_rollout`) as conversations: its
    answers are its labels."""
    labels = [[t.strip() for t in texts] for texts in batch.response_texts]
    return labelled_conversations(batch, labels, system, history="expert")[0]


def jsonl(rows: list) -> str:
    """Rows as JSONL text, one JSON object a line (what `sft.data` reads)."""
    return "".join(json.dumps(r) + "\n" for r in rows)

