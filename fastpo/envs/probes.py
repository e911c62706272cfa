"""Probe games: tiny diagnostic games, one property of the trainer each (`--env probe:NAME`).

In the spirit of the probe environments RL engineers use to debug a trainer (each so small that
its right answer is known and a failure points at one part), made for multi-turn text agents.
Every probe asks for one of two answers, A or B, one per turn, over one to three turns:

| name | turns | reward | what learning it proves |
|---|---|---|---|
| `choice` | 1 | 1 for B, 0 for A | the policy gradient moves the policy towards the rewarded answer |
| `constant` | 1 | 0.5 for any answer | the critic's value converges to the reward, and the advantages (GAE) to 0 |
| `delayed` | 2 | at the end only: 1 when the *first* answer was B | credit reaches an earlier turn (trajectory- and turn-level estimators) |
| `recall` | 3 | 1 when the last answer names the letter shown after the first answer | a later answer reads an earlier turn from the context kept across turns (KV cache, context window) |
| `discount` | 1-2 | A: 1 now and the game ends; B: 0 now, 2 in the next turn | gamma / the turn-level discount decide which answer is best |

`success` is the rewarded outcome: B (choice, delayed), any answer (constant), the right
letter (recall), the larger later reward (discount: the best policy when the discount over
the turn boundary keeps 2 x discount above 1; with a stronger discount A is best and a
trainer that discounts must drive success to 0).

Each probe's `expert()` answers A or B uniformly at random (not the right answer): `fastpo sft
--env probe:NAME` teaches the answer format and no preference, so that what StarPO adds after
it is StarPO's own (the tests start every probe from such a model). The random and the
optimal policy's success are known exactly (`random_success`, `optimal_success`: 0.5 and 1
for every probe but constant, 1 and 1). The rollout's format penalty (-0.1) stays: without it
a malformed answer pays what a wrong one does, and the negative advantages of the wrong
answers, which fall on their closing `</answer>` tokens too, taught the embedded model to stop
closing its answers within two updates (success 0.38 -> 0, every later group without a reward
spread).

Docs: docs/probes.md (what each probe proves, the commands, the measured iterations).
"""
from __future__ import annotations

import random

from .interface import TextEnv

#: The two answers every probe takes.
ANSWERS = ("A", "B")


class _Probe(TextEnv):
    """What the probes share: answers A and B, one per turn, a uniformly random expert."""

    action_names = ANSWERS
    turns = 1
    instructions = "A probe game. Each turn, answer A or B."

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.settings = {"max_turns": cls.turns, "max_actions_per_turn": 1, "max_actions_per_traj": cls.turns}

    def reset(self, seed: int) -> str:
        self.turn = 0
        self.rng = random.Random(seed)
        return self.first_observation()

    def first_observation(self) -> str:
        return "Answer A or B."

    def expert(self) -> str:
        """A or B uniformly at random (SFT from it teaches the format only)."""
        return random.choice(ANSWERS)

    def random_success(self, seeds, horizon):
        """Answers drawn uniformly from A and B: half the games won."""
        return [0.5 for _ in seeds]

    def optimal_success(self, seeds, horizon):
        return [1.0 if horizon >= self.turns else 0.0 for _ in seeds]


class Choice(_Probe):
    """One turn, two answers: B pays 1, A pays 0. Proves: the policy learns (the policy
    gradient, the update, the weights reaching the sampler)."""

    def step(self, answer: str):
        won = answer == "B"
        return "The game is over.", float(won), True, {"success": won}


class Constant(_Probe):
    """One turn; every answer pays 0.5. Proves (PPO + GAE): the critic's value converges to the
    reward and the advantages to 0 (nothing to prefer), with whitening off."""

    REWARD = 0.5

    def step(self, answer: str):
        return "The game is over.", self.REWARD, True, {"success": True}

    def random_success(self, seeds, horizon):
        """Every answer counts: the random policy always succeeds."""
        return [1.0 for _ in seeds]


class Delayed(_Probe):
    """Two turns; nothing is paid until the end, and then 1 when the first answer was B (the
    second answer does not matter, and the second observation does not tell). Proves: credit
    reaches an earlier turn (an estimator or loss mask that credits the last turn only stays
    at 0.5)."""

    turns = 2

    def step(self, answer: str):
        self.turn += 1
        if self.turn == 1:
            self.first = answer
            return "Answer A or B.", 0.0, False, {"success": False}
        won = self.first == "B"
        return "The game is over.", float(won), True, {"success": won}


class Recall(_Probe):
    """Three turns: the observation after the first answer shows a letter (A or B, drawn from
    the seed), the one after the second asks for it back: 1 when the third answer names it;
    the first two answers do not matter. The letter arrives after a response, so it lives in
    the tokens appended between turns (not in the prompt an env group shares, which every
    context window keeps). Proves: a later answer reads an earlier turn from the context kept
    across turns (a KV cache reset between turns, or `rollout.context_window=1`, leaves 0.5;
    a window of 2 turns keeps it)."""

    turns = 3
    instructions = "A memory game. Each turn, answer A or B."

    def step(self, answer: str):
        self.turn += 1
        if self.turn == 1:
            self.letter = self.rng.choice(ANSWERS)
            return f"Remember this letter: {self.letter}. Answer A or B.", 0.0, False, {"success": False}
        if self.turn == 2:
            return "Which letter did I show you? Answer A or B.", 0.0, False, {"success": False}
        won = answer == self.letter
        return "The game is over.", float(won), True, {"success": won}


class Discount(_Probe):
    """A: 1 now and the game ends; B: 0 now, then 2 for any answer in a second turn. Undiscounted,
    B is best (2 > 1); when the discount applied between the two rewards makes 2 x discount < 1
    (token-level gamma over the model tokens between them, bilevel_gae's high_level_gamma over
    the turn), A is. Success = B. Proves: gamma and the turn-level discount reach the advantages."""

    turns = 2

    def step(self, answer: str):
        self.turn += 1
        if self.turn == 1:
            if answer == "A":
                return "You took 1 point. The game is over.", 1.0, True, {"success": False}
            return "You waited. Answer A or B to take 2 points.", 0.0, False, {"success": False}
        return "You took 2 points. The game is over.", 2.0, True, {"success": True}


#: The probes by name (`--env probe:NAME`).
PROBES = {"choice": Choice, "constant": Constant, "delayed": Delayed, "recall": Recall, "discount": Discount}
