"""The expert's trajectories, rendered as a rollout renders a model's (`expert_rollout`), and
the imitation metric (`first_action_accuracy`).

`expert_rollout` runs the ordinary `MultiTurnRollout` (the same system prompt, game rules,
chat template, answer format and between-turn observation tokens) with an `ExpertEngine` in
place of the sampling engine. Each turn the engine writes the expert's answer as token ids
(the tokenizer's ids of "Down || Right</answer>" after the "<answer>" prime; in think mode
"Expert plan: Down, Right.</think> <answer>Down || Right</answer>" after "<think>"), and the
rollout parses it, steps the env and appends the next observation exactly as it does for a
model's answer. So an SFT sequence is token for token what a rollout whose model sampled those
answers holds, with the loss mask on the answer tokens only.

The expert is the game's own, asked through the batched env (`expert_answers`), whatever the
game: a built-in game's `expert(i, actions_left)` (fastpo.envs_native: Sokoban's shortest
solution, Bandit's better arm, FrozenLake's optimal move) answers with moves, which the engine
plays one at a time on its own copy of the env (closed loop), asking again once the moves it
committed to are played; a plain-Python game's `expert()` (fastpo.envs.interface) answers with
text, played as written. FrozenLake is stochastic: its expert commits to one move, chosen at
the cell the expert actually reached (its copy of the env draws the same slips as the
rollout's: both are seeded by the env seed); with one move per answer (FrozenLake's own count,
`expert_moves_per_turn`) every cell it acts on is shown to the model.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from fastpo.config.fields import ConfigError
from fastpo.envs import EnvError, has_expert, make_env
from fastpo.rollout import MultiTurnRollout
from fastpo.rollout.engine import STOP_CONTEXT, STOP_EOT, STOP_STRING, TurnOutput


class ExpertEngine:
    """A rollout engine (NativeEngine's session interface) whose answers are the expert's.

    Built for one `MultiTurnRollout.generate(seeds, group_size=1)` call: it keeps its own
    copy of the env, reset from the same `seeds`, stepped with the actions it answers, so
    its state is the rollout's. Per turn and session it returns the answer's token ids
    (`TurnOutput`, log-probs 0, stop reason "stop_string" when rollout.stop_at_answer_close,
    else the template's end-of-turn id is appended and the reason is "eot"). An expert's moves
    that would pass rollout.max_new_tokens are cut to fewer (ConfigError when not even one
    fits); a text answer (a user game's `expert()`) is played as written (the longest one past
    the cap is kept in `too_long`: (tokens, seed, answer), for `expert_rollout` to refuse); one
    that would pass rollout.max_context ends the session ("context", no tokens), as a sampling
    engine would. ConfigError at construction for a game without an expert.
    """

    device = torch.device("cpu")

    def __init__(self, rollout, seeds: list[int], actions_per_turn: int = 0):
        self.ro, self.cfg, self.tok, self.chat = rollout, rollout.cfg, rollout.tokenizer, rollout.chat
        self.seeds = list(seeds)
        self.env = make_env(rollout.env_name, len(self.seeds), rollout.env_config)
        if not self.env.has_expert():
            raise ConfigError(no_expert_message(rollout.env_name))
        per_turn = actions_per_turn or self.env.expert_moves_per_turn or self.cfg.max_actions_per_turn
        self.per_turn = min(per_turn, self.cfg.max_actions_per_turn)
        self.too_long: Optional[tuple] = None  # (tokens, seed, answer) of the longest answer past max_new_tokens
        self.answered_text = False  # whether the expert answered with text (a user game's expert())
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"prefilled_tokens": 0, "generated_tokens": 0, "forward_passes": 0, "seconds": 0.0,
                      "peak_kv_bytes": 0, "peak_kv_token_bytes": 0}

    def start(self, prompts: list, group_size: int = 1) -> None:
        if group_size != 1 or len(prompts) != len(self.seeds):
            raise ValueError(f"ExpertEngine serves {len(self.seeds)} env groups of one trajectory, "
                             f"got {len(prompts)} x {group_size}")
        self.env.reset(np.asarray(self.seeds, dtype=np.int64))
        self.plans: dict = {}  # the moves the expert committed to and has not played yet, per instance
        self.left = np.full(len(self.seeds), self.cfg.max_actions_per_traj, dtype=np.int64)
        self.length = {b: len(p) for b, p in enumerate(prompts)}
        self.stats["prefilled_tokens"] += sum(self.length.values())

    def finish(self) -> None:
        self.length = {}

    def session_length(self, session: int) -> int:
        return self.length[session]

    def _text(self, names: list | str) -> str:
        return expert_answer_text(names, self.chat.think)

    def _ids(self, names: list | str) -> list:
        ids = self.tok(self._text(names), add_special_tokens=False)["input_ids"]
        if not self.cfg.stop_at_answer_close:  # the model ends its turn itself
            ids = ids + [self.chat.eot_token_ids[0]]
        return ids

    def _fit(self, params, b: int) -> int:
        """The most moves of instance b whose answer fits max_new_tokens (longest names)."""
        longest = max(self.env.action_names(b), key=lambda n: len(self._ids([n])))
        k = self.per_turn
        while k > 0 and len(self._ids([longest] * k)) > params.max_new_tokens:
            k -= 1
        if k == 0:
            need = len(self._ids([longest]))
            raise ConfigError(f"config key 'rollout.max_new_tokens' = {params.max_new_tokens}: the expert's answer "
                              f"with one action ({self._text([longest])!r}) takes {need} tokens; raise "
                              f"rollout.max_new_tokens to at least {need}")
        return k

    def generate(self, sessions: list, append: list | None, params, generator=None) -> list:
        t0 = time.perf_counter()
        append = append if append is not None else [[] for _ in sessions]
        going = [b for b in sessions if not self.env.done[b] and self.left[b] > 0]
        need = [b for b in going if not self.plans.get(b)]
        asked = dict(zip(need, self.env.expert_answers(need, self.left)))
        if not going:  # (the rollout asks only sessions still playing)
            answers = {b: [] for b in sessions}
        elif any(isinstance(a, str) for a in asked.values()):
            answers = self._play_texts(sessions, params, asked)
        else:
            self.plans.update(asked)
            answers = self._play_moves(sessions, params)
        outs = []
        for b, extra in zip(sessions, append):
            ids = self._ids(answers[b])
            if self.length[b] + len(extra) + len(ids) > params.max_context:
                outs.append(TurnOutput([], [], STOP_CONTEXT))
                continue
            self.length[b] += len(extra) + len(ids)
            self.stats["prefilled_tokens"] += len(extra)
            self.stats["generated_tokens"] += len(ids)
            outs.append(TurnOutput(ids, [0.0] * len(ids), STOP_STRING if self.cfg.stop_at_answer_close else STOP_EOT))
        self.stats["seconds"] += time.perf_counter() - t0
        return outs

    def _play_texts(self, sessions: list, params, texts: dict) -> dict:
        """The expert's text answers `texts` ({instance: answer}, a user game's `expert()`),
        played on the shadow copy as the rollout plays them: the free text once, or the first
        moves up to the turn's cap."""
        B = len(self.seeds)
        self.answered_text = True
        going = list(texts)
        for b, text in texts.items():  # the longest one past the cap is said once all are known
            n = len(self._ids(text))
            if n > params.max_new_tokens and (self.too_long is None or n > self.too_long[0]):
                self.too_long = (n, self.seeds[b], text)
        active = np.zeros(B, dtype=bool)
        active[going] = True
        if getattr(self.env, "free_text", False):
            res = self.env.step_text([texts.get(b) for b in range(B)], active=active)
        else:
            parsed = self.env.parse_actions([texts.get(b, "") for b in range(B)], self.cfg.max_actions_per_turn)
            acts = parsed.actions.copy()
            for b in going:  # the moves past the trajectory's action budget are not played
                acts[b, int(self.left[b]):] = -1
            res = self.env.step(acts, active=active)
        for b in going:
            self.left[b] -= int(res.num_executed[b])
        return {b: texts.get(b, "") for b in sessions}

    def _play_moves(self, sessions: list, params) -> dict:
        """The expert's moves for each session, closed loop on the shadow copy: one at a time,
        each from the state the previous one reached, the expert asked again once the moves it
        committed to are played; at most the turn's cap (`per_turn`, what fits max_new_tokens,
        the actions left)."""
        B = len(self.seeds)
        budget = {b: min(self._fit(params, b), int(self.left[b])) for b in sessions}
        chosen: dict = {b: [] for b in sessions}
        going = [b for b in sessions if budget[b] > 0 and not self.env.done[b]]
        while going:
            acts = np.full((B, 1), -1, dtype=np.int64)
            for b in going:
                if not self.plans.get(b):
                    self.plans[b] = list(self.env.expert_answers([b], self.left)[0])
                plan = self.plans[b]
                # a state the expert has no moves for (an unsolvable level, which generation never makes): any move
                acts[b, 0] = self.env.action_names(b).index(plan.pop(0)) if plan else 0
            active = np.zeros(B, dtype=bool)
            active[going] = True
            res = self.env.step(acts, active=active)
            for b in going:
                chosen[b].append(int(acts[b, 0]))
                self.left[b] -= int(res.num_executed[b])
            going = [b for b in going if len(chosen[b]) < budget[b] and not self.env.done[b] and self.left[b] > 0]
        return {b: [self.env.action_names(b)[a] for a in chosen[b]] for b in sessions}


def expert_answer_text(answer: list | str, think: bool) -> str:
    """The expert's answer as the model writes it after the rollout's prime ("<answer>", or
    "<think>" in think mode): from move names (`answer` a list: "Down || Right</answer>"), or a
    user game's expert answer text (a str, taken as the `<answer>` content). In think mode the
    reasoning is a fixed template naming the moves: "Expert plan: Down, Right.</think>
    <answer>Down || Right</answer>"."""
    acts, plan = (answer, answer) if isinstance(answer, str) else (" || ".join(answer), ", ".join(answer))
    if think:
        return f"Expert plan: {plan}.</think> <answer>{acts}</answer>"
    return f"{acts}</answer>"


def no_expert_message(env_name: str) -> str:
    """What a game without an expert lacks for `fastpo sft` (one line)."""
    return (f"environment {env_name!r} has no expert for SFT: give its class a method expert() that returns the "
            f"answer for the current state (docs/custom_environments.md), or train on conversations with "
            f"sft.data=FILE.jsonl")


def check_expert(env_name: str) -> None:
    """ConfigError (one line, before any model loads) when `env_name` has no expert."""
    if not has_expert(env_name):
        raise ConfigError(no_expert_message(env_name))


def expert_rollout(tokenizer, env_name: str, env_options: dict, rollout_cfg, seeds: list[int],
                   actions_per_turn: int = 0):
    """The expert's trajectories on `seeds` (one each), rendered by `MultiTurnRollout`.

    rollout_cfg: a RolloutConfig (the prompt, format, turn and action limits of the run).
    actions_per_turn: the expert's moves per answer (`sft.actions_per_turn`; 0 = the game's own
    count, else rollout.max_actions_per_turn).
    Returns a TrajectoryBatch (input_ids, loss_mask True on the answer tokens, rewards,
    success, ...). Raises ValueError for bad seeds, ConfigError (a ValueError) for a game
    without an expert, a max_new_tokens too small for one action or for a text expert's
    longest answer (naming it, its seed and the value needed), EnvError for a user game or
    expert() that fails (naming the call and the seed) or answers what the game refuses,
    RuntimeError when an expert's moves are not read back as well formed (a bug).
    """
    ro = MultiTurnRollout(None, tokenizer, env_name, dict(env_options), rollout_cfg)
    ro.engine = ExpertEngine(ro, seeds, actions_per_turn)
    batch = ro.generate(list(seeds), 1)
    if ro.engine.too_long is not None:
        n, seed, text = ro.engine.too_long
        raise ConfigError(f"config key 'rollout.max_new_tokens' = {rollout_cfg.max_new_tokens}: the longest answer "
                          f"the expert() of {env_name!r} gives, {ro.engine._text(text)!r:.120} (seed {seed}), takes "
                          f"{n} tokens; raise rollout.max_new_tokens to at least {n} (the model must be able to "
                          f"write what it imitates)")
    bad = torch.nonzero(batch.penalised_turns).flatten().tolist()
    if bad:
        said = f"for seeds {[seeds[i] for i in bad[:5]]}: {batch.response_texts[bad[0]]!r:.200}"
        if ro.engine.answered_text:  # the user's expert gave answers the game or the parser refuses
            raise EnvError(f"environment {env_name!r}: its expert() gave answers that are penalised as malformed or "
                           f"invalid (a name not in action_names, or info['valid'] False) {said}")
        raise RuntimeError(f"expert answers read back as malformed {said}")  # moves by name: a bug of fastpo's
    return batch


@torch.no_grad()
def first_action_accuracy(model, batch, max_trajectories: int = 64) -> tuple[float, int]:
    """Imitation measured directly: the share of expert answer turns whose first token (in
    answer-only mode the first action's name, one token for the built-in games) is the model's
    most likely next token, teacher-forced on the expert's own trajectory.

    model: a causal LM (HF or peft); batch: the expert's TrajectoryBatch (`expert_rollout`),
    of states the model was not trained on (e.g. the eval seeds); its first `max_trajectories`
    trajectories are scored, one forward each, logits only at the scored positions.
    Returns (accuracy in [0, 1], number of answer turns scored); (nan, 0) when there are none.
    """
    was_training = model.training
    model.eval()
    hits = turns = 0
    try:
        for ids, mask in zip(batch.input_ids[:max_trajectories], batch.loss_mask[:max_trajectories]):
            m = mask.bool()
            starts = torch.nonzero(m[1:] & ~m[:-1]).flatten() + 1  # each answer's first token
            if starts.numel() == 0:
                continue
            dev = next(model.parameters()).device
            logits = model(input_ids=ids[None].to(dev), logits_to_keep=(starts - 1).to(dev)).logits[0]
            hits += int((logits.argmax(-1).cpu() == ids[starts]).sum())
            turns += int(starts.numel())
    finally:
        model.train(was_training)
    return (hits / turns if turns else float("nan")), turns
