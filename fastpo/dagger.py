"""DAgger for text games (`fastpo dagger`): the expert labels the states the model reaches.

DAgger (Ross, Gordon & Bagnell 2011, arXiv 1011.0686): a model trained on an expert's
trajectories meets, when it plays, states the expert never led it into, and its errors there
compound. Each round rolls the current model out, asks the expert what it would answer in
every state the model reached, and trains on those labels. `fastpo dagger` runs

- round 0 (`dagger.sft_round`, on by default): supervised fine-tuning on the expert's own
  trajectories, exactly what `fastpo sft` trains (the `sft.*` settings; DAgger's first
  iteration, whose policy is the expert's);
- rounds 1..N: the previous round's model plays `dagger.levels` fresh training levels at
  `dagger.temperature`; each answered turn gets the expert's answer for the state it was
  given in (`label_trajectories`); the conversations (`labelled_conversations`) are written
  as a JSONL chat file and the model is fine-tuned on them (`fastpo sft sft.data=FILE`'s
  trainer, one epoch by default) into the round's own run folder.

The labels come from replaying each trajectory: a fresh copy of the game is reset from the
trajectory's seed and stepped with the model's own answers through the rollout's own turn
function (`fastpo.rollout.multiturn.env_turn`), and the expert is asked before each step. A
game whose `reset(seed)` and `step` are deterministic (the built-in games' slips and a user
game's random draws included: both are seeded by the seed) reaches the states the rollout
reached; a replay that renders another state than the one the model was shown is refused
(EnvError). The experts: FrozenLake's optimal policy (one move: the cell after a slip is
unknown until it happens), Sokoban's breadth-first solver (the first moves of a shortest
solution from the state, up to the turn's action cap; a state it cannot solve, e.g. a box
pushed into a corner, gets no label), the Bandit's better arm, and a user game's `expert()`.

Conversations (TRL's chat format; `"weight": 0` marks context, OpenAI's fine-tuning format):
`dagger.history=own` (default; what the measurements in docs/sft.md found best) gives one
conversation per labelled turn, the model's own earlier answers as context and the label as
the one target, so the model learns to act from the histories it makes itself;
`dagger.history=expert` gives one conversation per trajectory with every answer replaced by
its label. By default a round trains on its own data only (continuing from the previous
round's weights); `dagger.aggregate=true` trains round k on the union of rounds 1..k, DAgger's
rule.

Run folder OUT: `dagger.yaml` (the `dagger.*` and `sft.*` settings), `config.yaml` (the run
configuration every round shares), `round-0/` ... `round-N/` (each an ordinary `fastpo sft` run
folder: its model is what `--model OUT/round-k` loads), `data/round-k.jsonl` and its summary
`data/round-k.json`, `rounds.json` (one record per finished round). Every step can be
stopped and continued: a round's rollout is saved chunk by chunk (`dagger.chunk` levels),
its training checkpoint by checkpoint; `fastpo dagger --resume OUT` (or the same command
again) continues at the round and step where the run stopped.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from typing import Optional

import numpy as np

from fastpo.config.fields import ConfigError, checked
from fastpo.config.schema import at_least
from fastpo.run.folder import DAGGER_FILE, atomic_write_text
from fastpo.sft import SFTConfig, SFTTrainer, expert_answer_text, expert_rollout

#: What `fastpo dagger --env GAME` adds on the CPU preset alone (before your overrides), per game:
#: (config overrides, sft.* overrides, dagger.* overrides). FrozenLake: the measured recipe
#: (docs/sft.md, "FrozenLake: the states the model reaches itself"): the coordinate observation,
#: one move per answer over 10 turns, SFT on 768 expert levels (96 steps of 8 at lr 2e-4), then
#: rounds of 256 levels, 2 labelled turns per trajectory with the model's own history, lr 1e-4.
DAGGER_CPU_GAME_DEFAULTS = {
    "frozenlake": (["env.options.observation=coords", "rollout.max_turns=10", "rollout.max_actions_per_traj=10",
                    "rollout.max_actions_per_turn=1", "rollout.max_context=2048", "optim.actor_lr=2e-4",
                    "trainer.iterations=96"],
                   ["sft.actions_per_turn=1", "sft.trajectories=768"],
                   ["dagger.lr=1e-4"]),
}

# (seed, round, salt) -> a round's rollout sampling seed (a chunk starting at level index i samples
# with it + i); (seed, round, chunk, salt) -> the labelled turns that chunk keeps. Pure functions of
# their arguments, so a resumed round redoes a chunk exactly. (Here rather than in fastpo.seeds,
# whose every change marks the recorded evaluations stale: tools/results_row.py.)
_SALT_SAMPLING = 49979687
_SALT_TURNS = 67867967


def round_sampling_seed(seed: int, k: int) -> int:
    """The sampling seed of DAgger round k's rollout (trainer.seed `seed`), in [0, 2**31)."""
    return int(np.random.default_rng([seed, k, _SALT_SAMPLING]).integers(2**31))


def chunk_turns_rng(seed: int, k: int, chunk: int) -> np.random.Generator:
    """The generator that draws the labelled turns chunk `chunk` of round k keeps."""
    return np.random.default_rng([seed, k, chunk, _SALT_TURNS])


#: Files and folders of a DAgger run folder besides the rounds (`round-K`).
_RUN_FILES = (DAGGER_FILE, "config.yaml", "rounds.json", "data")
_ROUND = re.compile(r"round-(\d+)$")


@dataclasses.dataclass
class DaggerConfig:
    """The `dagger.*` settings of `fastpo dagger` (kept in the run folder's dagger.yaml).

    rounds: DAgger rounds after the SFT round (round k's model plays, round k + 1 learns
    from it). levels: training levels (env seeds) each round plays, one trajectory each:
    round k plays seed_offset + (k - 1) * levels .. seed_offset + k * levels - 1 (disjoint
    from the eval seeds: checked). temperature: the rollout's sampling temperature (0.5, the
    paper's eval temperature, by default; 0 = greedy). history: "own" (one conversation per
    labelled turn, the model's earlier answers as context) or "expert" (one conversation per
    trajectory, every answer replaced by its label). turns_per_trajectory: with "own", the
    labelled turns kept per trajectory, drawn at random (0 = all). expert_trajectories: the
    expert's own trajectories on the first N levels of each round, added to its data.
    aggregate: train round k on rounds 1..k's data (DAgger's rule) instead of round k's
    alone. steps: optimizer steps per round (0 = one epoch of its data, `sft.batch_size`
    conversations a step). lr: the rounds' learning rate (0 = optim.actor_lr, round 0's).
    sft_round: run round 0, SFT on the expert's trajectories (`sft.*`); false starts round 1
    from --model as it is (e.g. a `fastpo sft` run). chunk: trajectories rolled out at once
    (the KV cache of a chunk bounds the rollout's memory; a stopped rollout keeps its
    finished chunks).
    """

    rounds: int = checked(3, at_least(1), "must be >= 1")
    levels: int = checked(256, at_least(1), "must be >= 1")
    seed_offset: int = checked(0, lambda v: 0 <= v < 2**31, "must be in [0, 2**31)")
    temperature: float = checked(0.5, lambda v: 0 <= v <= 10, "must be in [0, 10] (0 = greedy)")
    history: str = checked("own", lambda v: v in ("own", "expert"), "must be 'own' or 'expert'")
    turns_per_trajectory: int = checked(2, at_least(0), "must be >= 0 (0 = every labelled turn)")
    expert_trajectories: int = checked(0, at_least(0), "must be >= 0")
    aggregate: bool = checked(False, lambda v: isinstance(v, bool), "must be true or false")
    steps: int = checked(0, at_least(0), "must be >= 0 (0 = one epoch of the round's data)")
    lr: float = checked(0.0, lambda v: 0 <= v < 1, "must be in [0, 1) (0 = optim.actor_lr)")
    sft_round: bool = checked(True, lambda v: isinstance(v, bool), "must be true or false")
    chunk: int = checked(128, at_least(1), "must be >= 1")

    def round_levels(self, k: int) -> list[int]:
        """The env seeds round k >= 1 plays."""
        lo = self.seed_offset + (k - 1) * self.levels
        return list(range(lo, lo + self.levels))


def dagger_config(overrides: list[str], base: Optional[DaggerConfig] = None) -> DaggerConfig:
    """A DaggerConfig from `base` (default: the defaults) and dotted overrides
    "dagger.key=value". Raises ConfigError naming a bad key or value."""
    from fastpo.config.fields import apply_dict, check_fields, parse_override

    cfg = dataclasses.replace(base) if base is not None else DaggerConfig()
    for o in overrides:
        apply_dict(cfg, parse_override(o).get("dagger", {}), prefix="dagger.")
    check_fields(cfg, "dagger.")
    if cfg.expert_trajectories > cfg.levels:
        raise ConfigError(f"config key 'dagger.expert_trajectories' = {cfg.expert_trajectories}: more than the "
                          f"{cfg.levels} levels of a round (dagger.levels); the expert plays the round's first levels")
    return cfg


def check_levels(dag: DaggerConfig, cfg) -> None:
    """ConfigError when the levels the rounds play overlap the eval seeds."""
    lo, hi = cfg.trainer.eval_seed_offset, cfg.trainer.eval_seed_offset + cfg.trainer.eval_seeds
    a, b = dag.seed_offset, dag.seed_offset + dag.rounds * dag.levels
    if a < hi and lo < b:
        raise ConfigError(f"config key 'dagger.seed_offset' = {dag.seed_offset}: the levels of {dag.rounds} rounds "
                          f"[{a}, {b}) overlap the eval seeds [{lo}, {hi}); choose levels outside them")


def write_dagger_file(out: str, sft: SFTConfig, dag: DaggerConfig) -> None:
    """OUT/dagger.yaml: the run's `dagger.*` and `sft.*` settings."""
    import yaml

    atomic_write_text(os.path.join(out, DAGGER_FILE), yaml.safe_dump(
        {"dagger": dataclasses.asdict(dag), "sft": dataclasses.asdict(sft)}, sort_keys=False))


def read_dagger_file(out: str) -> tuple[SFTConfig, DaggerConfig]:
    """(SFTConfig, DaggerConfig) of the DAgger run in `out`. ConfigError when missing or bad."""
    from fastpo.config.fields import apply_dict, check_fields
    from fastpo.config.files import parse_config_yaml

    path = os.path.join(out, DAGGER_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{path} not found: is {out} a `fastpo dagger` run folder?")
    with open(path, encoding="utf-8") as f:
        d = parse_config_yaml(f, path)
    sft, dag = SFTConfig(), DaggerConfig()
    apply_dict(dag, d.get("dagger") or {}, prefix="dagger.")
    apply_dict(sft, d.get("sft") or {}, prefix="sft.")
    check_fields(dag, "dagger.")
    check_fields(sft, "sft.")
    return sft, dag


def is_dagger_run(path: str) -> bool:
    """Whether folder `path` holds a `fastpo dagger` run (its dagger.yaml)."""
    return os.path.isfile(os.path.join(path, DAGGER_FILE))


def dagger_folder_of(path: str) -> str:
    """The DAgger run folder that `path` names: itself, or the run holding it when `path` is
    one of its rounds (`OUT/round-k`, which the stop messages of a round name). `path`
    unchanged when it is neither."""
    p = path.rstrip("/\\") or path
    parent = os.path.dirname(os.path.abspath(p))
    if not is_dagger_run(p) and _ROUND.match(os.path.basename(p)) and is_dagger_run(parent):
        return os.path.dirname(p) or "."
    return path


def clear_dagger_run(out: str) -> None:
    """Delete a DAgger run's files and rounds in `out` (--overwrite); nothing else."""
    for name in os.listdir(out):
        p = os.path.join(out, name)
        if name in _RUN_FILES or _ROUND.match(name):
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.remove(p)


# --------------------------------------------------------------------------------- the labels

class StateExpert:
    """The expert's answer in the current state of each instance of `env`, a batched env of
    game `env_name` reset from the rollout's seeds and stepped with the model's answers.

    `answers(indices, actions_left)` -> {b: move names (list) | answer text (str) | None}:
    FrozenLake: the optimal policy's move for the cell and the actions left (one move: after
    it the ice decides the cell); Sokoban: the first `per_turn` moves (capped by the actions
    left) of a shortest solution from the current state, None when the solver finds none;
    Bandit: the arm of higher expected reward; a user game: its `expert()` text. `horizon`:
    the trajectory's action budget (rollout.max_actions_per_traj). Raises EnvError (from a
    user game's expert)."""

    def __init__(self, env, env_name: str, horizon: int, per_turn: int):
        from fastpo.envs import resolve_env

        self.env, self.name, self.horizon, self.per_turn = env, env_name, int(horizon), max(1, int(per_turn))
        self.native = resolve_env(env_name).kind == "native"
        self._policy = self._better = None

    def answers(self, indices: list, actions_left: np.ndarray) -> dict:
        if not indices:
            return {}
        if not self.native:
            return dict(zip(indices, self.env.expert_answers(indices)))
        env = self.env
        if self.name == "frozenlake":
            if self._policy is None:  # the map's table: computed once, after the reset
                self._policy = env.optimal_policy(self.horizon)
            pos = env.positions()
            return {b: [env.action_names(b)[int(self._policy[b, min(int(actions_left[b]), self.horizon),
                                                                 int(pos[b])])]] for b in indices}
        if self.name == "bandit":
            if self._better is None:
                self._better = env.better_action()
            return {b: [env.action_names(b)[int(self._better[b])]] for b in indices}
        out = {}
        for b in indices:  # sokoban: solved afresh from the state the model left
            plan = env.solve(b)
            out[b] = list(plan[:max(1, min(self.per_turn, int(actions_left[b])))]) if plan else None
        return out


def label_trajectories(batch, rollout, actions_per_turn: int = 0) -> list[list]:
    """The expert's answer in each state a rollout's trajectories were given (DAgger's labels).

    batch: a TrajectoryBatch of `rollout` (a fastpo.rollout.MultiTurnRollout of one game; any
    group size). Each trajectory is replayed on a fresh copy of the game reset from its seed:
    before turn k the expert (`StateExpert`) is asked, then the turn is stepped with the
    trajectory's own response text through `env_turn`, exactly as the rollout stepped it.
    actions_per_turn: the expert's moves per answer on Sokoban (0: rollout.max_actions_per_turn;
    capped by it), as `sft.actions_per_turn`.

    Returns, per trajectory, one entry per answered turn: the label as the model would write
    it (the rollout's prime and `fastpo.sft.expert_answer_text`, e.g. "<answer>Right</answer>"),
    or None where the expert has no answer. Raises EnvError when a replayed state is not the one
    the rollout showed (a game whose reset or step is not a function of the seed and the
    answers), ConfigError when a label does not fit rollout.max_new_tokens.
    """
    from fastpo.envs import EnvError
    from fastpo.rollout.multiturn import env_turn

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
        expert = StateExpert(env, rollout.env_name, cfg.max_actions_per_traj, per_turn)
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
            for b, answer in expert.answers(going, left).items():
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
    """The expert's own trajectories (`fastpo.sft.expert_rollout`) as conversations: its
    answers are its labels."""
    labels = [[t.strip() for t in texts] for texts in batch.response_texts]
    return labelled_conversations(batch, labels, system, history="expert")[0]


def jsonl(rows: list) -> str:
    """Rows as JSONL text, one JSON object a line (what `sft.data` reads)."""
    return "".join(json.dumps(r) + "\n" for r in rows)


# ------------------------------------------------------------------------------------ the run

class DaggerStopped(KeyboardInterrupt):
    """A DAgger run stopped by a signal outside a round's training (its rollout); `signum`
    gives the exit status 128 + signum (the CLI's)."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = int(signum)


class DaggerRoundTrainer(SFTTrainer):
    """One round's SFT (`fastpo.sft.SFTTrainer`) inside a DAgger run: its stop and error
    messages name `fastpo dagger --resume OUT`; the DAgger run prints the hand-off at its end."""

    def __init__(self, cfg, sft: SFTConfig, dagger_out: str, **kw):
        super().__init__(cfg, sft, **kw)
        self.dagger_out = dagger_out

    def resume_hint(self) -> str:
        return f"fastpo dagger --resume {self.dagger_out}"

    def finish(self, records: list[dict]) -> None:
        pass


class DaggerRun:
    """A `fastpo dagger` run in folder `cfg.trainer.output_dir` (OUT).

    cfg: the TrainConfig every round shares (model.name: the starting model; round k's own
    config differs in model.name, its parent round's folder, in trainer.iterations,
    optim.actor_lr and the output folder). sft: the SFTConfig of round 0 (batch_size and
    common_prefix also of the rounds). dag: DaggerConfig. `run()` does what is left: each
    round's rollout and labels (saved chunk by chunk), then its training (resumed from its
    checkpoint); it returns None when every round is done, or the signal that stopped it (the
    CLI then exits 128 + signal). `console`: a rich Console. Raises ConfigError (bad input found
    late, e.g. a round whose rollout labelled nothing), EnvError, CheckpointSaveError, as the
    trainer does.
    """

    def __init__(self, cfg, sft: SFTConfig, dag: DaggerConfig, console, trust_checkpoint: bool = False):
        self.cfg, self.sft, self.dag, self.console = cfg, sft, dag, console
        self.out = cfg.trainer.output_dir
        self.trust = trust_checkpoint
        self.data_dir = os.path.join(self.out, "data")

    # -- where things are
    def round_dir(self, k: int) -> str:
        return os.path.join(self.out, f"round-{k}")

    def parent(self, k: int) -> str:
        """The model round k starts from (and, for k >= 1, whose rollout it learns from)."""
        if k == 0 or (k == 1 and not self.dag.sft_round):
            return self.cfg.model.name
        return os.path.abspath(self.round_dir(k - 1))

    def first_round(self) -> int:
        return 0 if self.dag.sft_round else 1

    # -- the whole run
    def run(self) -> Optional[int]:
        from fastpo.run.folder import RunLock

        os.makedirs(self.out, exist_ok=True)
        from fastpo.config.files import dump_yaml

        with RunLock(self.out):
            # the settings the rounds run with (a resume's allowed changes included)
            write_dagger_file(self.out, self.sft, self.dag)
            atomic_write_text(os.path.join(self.out, "config.yaml"), dump_yaml(self.cfg))
            for k in range(self.first_round(), self.dag.rounds + 1):
                stopped = self.round(k)
                if stopped is not None:
                    return stopped
            self.report()
        return None

    def round(self, k: int) -> Optional[int]:
        """Round k: its data (k >= 1), then its training; the signal that stopped it, or None."""
        cfg_k, sft_k = self.round_config(k, self.collect(k) if k >= 1 else None)
        return self.train(k, cfg_k, sft_k)

    def round_config(self, k: int, data: Optional[dict]):
        """(TrainConfig, SFTConfig) of round k (`data`: its training data's summary, k >= 1)."""
        cfg = copy.deepcopy(self.cfg)
        cfg.trainer.output_dir = self.round_dir(k)
        if k == 0:
            return cfg, dataclasses.replace(self.sft)
        n = data["conversations"]
        batch = min(self.sft.batch_size, n)
        cfg.model.name = self.parent(k)
        cfg.optim.actor_lr = self.dag.lr or self.cfg.optim.actor_lr
        cfg.trainer.iterations = self.dag.steps or math.ceil(n / batch)
        # the parent's last evaluation is this round's "before" (same seeds, same sampling stream)
        cfg.trainer.eval_before_training = cfg.trainer.eval_before_training and self.parent(k) == self.cfg.model.name
        return cfg, SFTConfig(data=os.path.abspath(data["file"]), batch_size=batch,
                              common_prefix=self.sft.common_prefix)

    def train(self, k: int, cfg, sft: SFTConfig) -> Optional[int]:
        """Round k's SFT into its folder: resumed from its checkpoint, skipped when done."""
        from fastpo.run.checkpoint import plan_resume
        from fastpo.run.manifest import search_checkpoints
        from fastpo.sft import read_sft_config

        d = cfg.trainer.output_dir
        resume = os.path.isdir(d) and search_checkpoints(d).folder is not None
        if resume:
            try:
                plan = plan_resume(d, trust=self.trust)
            except FileNotFoundError as e:
                raise ConfigError(str(e)) from None
            if plan.nothing_to_do(cfg.trainer.iterations):
                self.console.print(f"round {k}: trained ({d}, {plan.iteration} steps)", markup=False)
                return None
            sft.data_sha256 = read_sft_config(d).data_sha256  # a resume refuses changed data
        what = "SFT on the expert's trajectories" if k == 0 else f"SFT on the labelled states of round {k}"
        self.console.print(f"[bold]round {k}/{self.dag.rounds}[/]: {what}, {cfg.trainer.iterations} steps of "
                           f"{sft.batch_size}, lr {cfg.optim.actor_lr:g}, from {cfg.model.name} -> {d}"
                           + (" (resumed)" if resume else ""))
        trainer = DaggerRoundTrainer(cfg, sft, self.out, resume=resume, console=self.console,
                                     trust_checkpoint=self.trust)
        trainer.run()
        return trainer.stop_state.signum if trainer.stop_state.interrupted else None

    # -- a round's data
    def collect(self, k: int) -> dict:
        """Round k's training data (rolled out and labelled unless already there): the summary
        of data/round-k.json with "file", the JSONL file round k trains on."""
        summary = self.summary_path(k)
        if not os.path.isfile(summary):
            self.roll_out(k)
        with open(summary, encoding="utf-8") as f:
            s = json.load(f)
        if not self.dag.aggregate or k == 1:
            return {**s, "file": os.path.join(self.data_dir, f"round-{k}.jsonl")}
        path = os.path.join(self.data_dir, f"rounds-1-{k}.jsonl")
        if not os.path.isfile(path):  # DAgger's aggregate: the union of rounds 1..k
            parts = []
            for j in range(1, k + 1):
                with open(os.path.join(self.data_dir, f"round-{j}.jsonl"), encoding="utf-8") as f:
                    parts.append(f.read())
            atomic_write_text(path, "".join(parts))
        n = 0
        for j in range(1, k + 1):
            with open(self.summary_path(j), encoding="utf-8") as f:
                n += json.load(f)["conversations"]
        return {**s, "conversations": n, "file": path}

    def summary_path(self, k: int) -> str:
        return os.path.join(self.data_dir, f"round-{k}.json")

    def roll_out(self, k: int) -> None:
        """Round k's rollout of its parent on its levels, labelled, chunk by chunk (a chunk
        already on disk is kept), then data/round-k.jsonl and its summary (written last)."""
        import torch

        from fastpo import rollout as ro
        from fastpo.memory import release_free_memory
        from fastpo.models import load_model_checked, resolve_device

        cfg, dag = self.cfg, self.dag
        levels = dag.round_levels(k)
        chunks = [levels[i:i + dag.chunk] for i in range(0, len(levels), dag.chunk)]
        part_dir = os.path.join(self.data_dir, f"round-{k}.chunks")
        os.makedirs(part_dir, exist_ok=True)
        done = [os.path.isfile(os.path.join(part_dir, f"{i:04d}.json")) for i in range(len(chunks))]
        t0 = time.perf_counter()
        self.console.print(f"[bold]round {k}/{dag.rounds}[/]: {self.parent(k)} plays levels {levels[0]}..{levels[-1]} "
                           f"at temperature {dag.temperature:g}; the expert labels the states it reaches"
                           + (f" ({sum(done)} of {len(chunks)} chunks already done)" if any(done) else ""))
        main_thread = threading.current_thread() is threading.main_thread()  # (signals reach that one alone)
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}

        def stop(signum, frame):  # the chunk under way is dropped; finished chunks are on disk
            raise DaggerStopped(signum)

        for s in old:
            signal.signal(s, stop)
        try:
            if not all(done):
                device = resolve_device(cfg.trainer.device)
                model, tok, info = load_model_checked(self.parent(k), device=str(device),
                                                      dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype)
                rollout = ro.MultiTurnRollout.from_config(cfg, ro.NativeEngine(model, tok), tok)
                base = round_sampling_seed(cfg.trainer.seed, k)
                for i, seeds in enumerate(chunks):
                    if done[i]:
                        continue
                    with torch.no_grad():
                        batch = rollout.generate(seeds, 1, temperature=dag.temperature, seed=base + i * dag.chunk)
                    labels = label_trajectories(batch, rollout, self.sft.actions_per_turn)
                    rows, agree, n = labelled_conversations(batch, labels, rollout.chat.system_prompt, dag.history,
                                                            dag.turns_per_trajectory,
                                                            chunk_turns_rng(cfg.trainer.seed, k, i))
                    stats = {"trajectories": len(batch), "successes": int(batch.success.sum()),
                             "turns": int(batch.num_turns.sum()), "labelled": n, "agreed": agree,
                             "conversations": len(rows)}
                    atomic_write_text(os.path.join(part_dir, f"{i:04d}.jsonl"), jsonl(rows))
                    atomic_write_text(os.path.join(part_dir, f"{i:04d}.json"), json.dumps(stats) + "\n")
                    won = stats["successes"] / len(batch)
                    self.console.print(f"  levels {seeds[0]}..{seeds[-1]}: success {won:.3f}, "
                                       f"{n} states labelled, the model's answer was the expert's in "
                                       f"{agree / max(n, 1):.3f} ({time.perf_counter() - t0:.0f} s)", markup=False)
                    del batch
                del rollout, model  # the model's memory back before the round's training loads its own
                gc.collect()
                release_free_memory()
            self.write_round(k, chunks, part_dir, time.perf_counter() - t0)
        except DaggerStopped:
            kept = sum(os.path.isfile(os.path.join(part_dir, f"{i:04d}.json")) for i in range(len(chunks)))
            self.console.print(f"stopped in round {k}'s rollout ({kept} of {len(chunks)} chunks of {dag.chunk} levels "
                               f"saved); continue with `fastpo dagger --resume {self.out}` (or the same command)",
                               markup=False, soft_wrap=True)
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def write_round(self, k: int, chunks: list, part_dir: str, seconds: float) -> None:
        """data/round-k.jsonl from its chunks (and the expert's trajectories), then its summary."""
        from fastpo.models import load_model_checked
        from fastpo.rollout import MultiTurnRollout

        dag, text, s = self.dag, [], {"trajectories": 0, "successes": 0, "turns": 0, "labelled": 0, "agreed": 0,
                                      "conversations": 0}
        for i in range(len(chunks)):
            with open(os.path.join(part_dir, f"{i:04d}.json"), encoding="utf-8") as f:
                for key, v in json.load(f).items():
                    s[key] += v
            with open(os.path.join(part_dir, f"{i:04d}.jsonl"), encoding="utf-8") as f:
                text.append(f.read())
        expert = 0
        if dag.expert_trajectories:
            tok = load_model_checked(self.cfg.model.name, tokenizer_only=True)  # (every round's tokenizer)
            rcfg = self.cfg.rollout.rollout_config()
            eb = expert_rollout(tok, self.cfg.env.name, self.cfg.env.options, rcfg,
                                dag.round_levels(k)[:dag.expert_trajectories], self.sft.actions_per_turn)
            rows = expert_conversations(eb, MultiTurnRollout(None, tok, self.cfg.env.name, dict(self.cfg.env.options),
                                                             rcfg).chat.system_prompt)
            text.append(jsonl(rows))
            expert = len(rows)
        if s["conversations"] + expert == 0:
            raise ConfigError(f"round {k}: no state of the {s['trajectories']} trajectories got a label (every answer "
                              f"cut by rollout.max_context, or an expert without answers); nothing to train on")
        lv = dag.round_levels(k)
        summary = {"round": k, "model": self.parent(k), "levels": [lv[0], lv[-1]],
                   "temperature": dag.temperature, **s,
                   "success_rate": s["successes"] / max(s["trajectories"], 1),
                   "agreement": s["agreed"] / max(s["labelled"], 1),
                   "expert_conversations": expert, "conversations": s["conversations"] + expert,
                   "seconds": round(seconds, 1)}
        atomic_write_text(os.path.join(self.data_dir, f"round-{k}.jsonl"), "".join(text))
        atomic_write_text(self.summary_path(k), json.dumps(summary, indent=1) + "\n")
        shutil.rmtree(part_dir, ignore_errors=True)
        self.console.print(f"round {k}: {summary['conversations']} conversations -> "
                           f"{os.path.join(self.data_dir, f'round-{k}.jsonl')}; on its own states the model played "
                           f"the expert's answer in {summary['agreement']:.3f} of {s['labelled']} (success "
                           f"{summary['success_rate']:.3f})", markup=False, soft_wrap=True)

    # -- the end
    def rounds(self) -> list[dict]:
        """One record per round: its data's summary (k >= 1) and its last evaluation."""
        out = []
        for k in range(self.first_round(), self.dag.rounds + 1):
            rec: dict = {"round": k, "model": self.round_dir(k)}
            if k >= 1 and os.path.isfile(self.summary_path(k)):
                with open(self.summary_path(k), encoding="utf-8") as f:
                    s = json.load(f)
                rec.update({f"data/{key}": s[key] for key in ("levels", "success_rate", "agreement", "labelled",
                                                               "conversations")})
            ev = {}
            try:
                with open(os.path.join(self.round_dir(k), "metrics.jsonl"), encoding="utf-8") as f:
                    for line in f:
                        r = json.loads(line)
                        if "eval/success_rate" in r:
                            ev = r
            except (OSError, ValueError):
                pass
            for key in ("iteration", "eval/success_rate", "eval/success_rate_se", "eval/random_success",
                        "eval/optimal_success", "eval/expert_success"):
                if key in ev:
                    rec[key] = ev[key]
            out.append(rec)
        return out

    def report(self) -> None:
        """The rounds as a table (also OUT/rounds.json), the final model and the StarPO command."""
        from rich.table import Table

        from fastpo.sft import handoff_command

        recs = self.rounds()
        atomic_write_text(os.path.join(self.out, "rounds.json"), json.dumps(recs, indent=1) + "\n")
        t = Table(title=f"fastpo dagger: {self.cfg.env.name}")
        for col in ("round", "data: levels", "own states: agreement", "rollout success", "conversations",
                    "eval success", "z vs random"):
            t.add_column(col)
        for r in recs:
            succ, se, rnd = r.get("eval/success_rate"), r.get("eval/success_rate_se"), r.get("eval/random_success")
            z = (succ - rnd) / se if None not in (succ, se, rnd) and se > 0 else None
            t.add_row(str(r["round"]),
                      "expert" if r["round"] == 0 else "{}..{}".format(*r.get("data/levels", ["?", "?"])),
                      "-" if r["round"] == 0 else f"{r.get('data/agreement', float('nan')):.3f}",
                      "-" if r["round"] == 0 else f"{r.get('data/success_rate', float('nan')):.3f}",
                      "-" if r["round"] == 0 else str(r.get("data/conversations", "?")),
                      "-" if succ is None else f"{succ:.3f}" + ("" if se is None else f" +- {se:.3f}"),
                      "-" if z is None else f"{z:+.1f}")
        self.console.print(t)
        last = recs[-1]
        if "eval/random_success" in last:
            self.console.print(f"random policy {last['eval/random_success']:.3f}"
                               + (f", optimal {last['eval/optimal_success']:.3f}" if "eval/optimal_success" in last
                                  else "") + " on the same eval seeds", markup=False)
        final = self.round_dir(self.dag.rounds)
        cfg = copy.deepcopy(self.cfg)
        cfg.trainer.output_dir = final
        self.console.print(f"the model: {final} (--model {final})", markup=False, soft_wrap=True)
        self.console.print("StarPO from this model: " + handoff_command(cfg), markup=False, soft_wrap=True)


def dagger_run_finished(out: str, rounds: int) -> bool:
    """Whether the DAgger run in `out` has finished `rounds` rounds (the rounds.json its end
    writes lists round `rounds` or a later one)."""
    try:
        with open(os.path.join(out, "rounds.json"), encoding="utf-8") as f:
            recs = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(recs, list) and any(isinstance(r, dict) and isinstance(r.get("round"), int)
                                          and r["round"] >= rounds for r in recs)
