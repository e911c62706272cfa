"""Batched two-armed Bandit (RAGEN's single-turn stochastic game), compiled with Numba.

Each instance shows two arms named by a (low-risk, high-risk) pair whose names carry the
hint (e.g. "Vault" vs "Casino"); the pair and the order of the two arms are drawn from the
instance's seed. The low-risk arm pays ``low_reward`` (0.1) every time; the high-risk arm
pays ``high_reward`` (1.0) with probability ``high_prob`` (0.25), else 0. Success means the
arm with the higher expected reward was chosen (the high-risk one with the defaults:
0.25 > 0.1). One action ends the episode. Actions are the arm names (ids 0 and 1 in the
order the arms are shown); numbers such as "1" are not accepted, so that the model has to
name the arm it means.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._core import BatchedTextEnv, NameTable, _is_real, rng_below, rng_seed_all, rng_uniform, seeds_to_array

# (low-risk, high-risk) pairs. Training pairs and a held-out list for the generalization
# test (the paper's Phoenix/Dragon style: the model must infer risk from the names).
TRAIN_PAIRS = (
    ("Vault", "Casino"), ("Oak", "Lightning"), ("Anchor", "Comet"), ("Lighthouse", "Tornado"),
    ("Granite", "Volcano"), ("Shepherd", "Gambler"), ("Harbor", "Storm"), ("Bank", "Lottery"),
    ("Tortoise", "Firework"), ("Blanket", "Rocket"),
)
TEST_PAIRS = (("Phoenix", "Dragon"), ("Librarian", "Pirate"), ("Monk", "Gladiator"), ("Glacier", "Meteor"))
_SALT = 0xBA4D17


@njit(cache=True)
def _bandit_reset(seeds, n_pairs, rng, pair, swapped):
    rng_seed_all(seeds, _SALT, rng)
    for b in range(seeds.shape[0]):
        pair[b] = rng_below(rng, b, n_pairs)
        swapped[b] = rng_below(rng, b, 2) == 1


@njit(cache=True)
def _bandit_step(rng, swapped, done, success, chosen, outcome, actions, active, low_reward, high_reward, high_prob,
                 high_better, reward, num_exec, valid, effective):
    """One pull per active, not-done instance; outcome[b] = 1 low arm, 2 high arm paid, 3 high arm not paid."""
    B = actions.shape[0]
    A = actions.shape[1]
    for b in range(B):
        if not active[b] or done[b]:
            continue
        for j in range(A):
            a = actions[b, j]
            if a < 0 or a > 1:
                continue
            valid[b, j] = True
            effective[b, j] = True
            num_exec[b] += 1
            high = (a == 1) != swapped[b]  # arm shown second is the high-risk one unless swapped
            if high:
                if rng_uniform(rng, b) < high_prob:
                    reward[b] += high_reward
                    outcome[b] = 2
                else:
                    outcome[b] = 3
            else:
                reward[b] += low_reward
                outcome[b] = 1
            chosen[b] = a
            success[b] = high == high_better
            done[b] = True
            break


class BanditEnv(BatchedTextEnv):
    """B two-armed bandit instances.

    Config: split ("train" or "test": which list of name pairs), pairs (custom list of
    (low-risk name, high-risk name); overrides split), low_reward (0.1), high_reward (1.0),
    high_prob (0.25). Raises ValueError naming a bad config value.
    """

    name = "bandit"

    def __init__(self, batch_size: int, split: str = "train", pairs=None, low_reward: float = 0.1,
                 high_reward: float = 1.0, high_prob: float = 0.25):
        super().__init__(batch_size)
        if pairs is None:
            if split not in ("train", "test"):
                raise ValueError(f"split must be 'train' or 'test', got {split!r}")
            pairs = TRAIN_PAIRS if split == "train" else TEST_PAIRS
        pairs = [tuple(p) for p in pairs]
        if not pairs or any(len(p) != 2 or not all(isinstance(n, str) for n in p) for p in pairs):
            raise ValueError(f"pairs must be a non-empty list of (low-risk name, high-risk name), got {pairs!r}")
        if any(p[0].lower() == p[1].lower() for p in pairs):
            raise ValueError(f"the two arms of a pair need different names, got {pairs!r}")
        for k, v in (("low_reward", low_reward), ("high_reward", high_reward)):
            if not _is_real(v) or not np.isfinite(v):
                raise ValueError(f"{k} must be a finite number, got {v!r}")
        if not (_is_real(high_prob) and 0.0 <= high_prob <= 1.0):
            raise ValueError(f"high_prob must be in [0, 1], got {high_prob!r}")
        self.pairs = pairs
        self.low_reward, self.high_reward, self.high_prob = float(low_reward), float(high_reward), float(high_prob)
        self.high_better = self.high_reward * self.high_prob >= self.low_reward
        names = []
        for p in pairs:
            for n in p:
                if n.lower() not in (x.lower() for x in names):
                    names.append(n)
        self._table = NameTable(names)  # validates the names
        idx = np.array([[self._table.index[n.lower()] for n in p] for p in pairs], dtype=np.int64)
        self._pair_names = idx
        B = self._B
        self._rng = np.zeros(B, dtype=np.uint64)
        self._pair = np.zeros(B, dtype=np.int64)
        self._swapped = np.zeros(B, dtype=np.bool_)
        self._chosen = np.full(B, -1, dtype=np.int64)
        self._outcome = np.zeros(B, dtype=np.int64)
        # every observation text there can be, indexed [pair, swapped, outcome]
        texts = np.empty((len(pairs), 2, 4), dtype=object)
        for k, (lo, hi) in enumerate(pairs):
            for sw in (0, 1):
                a, b = (hi, lo) if sw else (lo, hi)
                texts[k, sw, 0] = f"Two arms: {a} and {b}. Which arm do you pull?"
                texts[k, sw, 1] = f"You pulled {lo} and received reward {self.low_reward:g}."
                texts[k, sw, 2] = f"You pulled {hi} and received reward {self.high_reward:g}."
                texts[k, sw, 3] = f"You pulled {hi} and received reward 0."
        self._texts = texts
        self._reward = np.zeros(B, dtype=np.float32)
        self._name_action = np.full((B, len(names)), -1, dtype=np.int64)

    def _arms(self, i: int) -> tuple[str, str]:
        lo, hi = self.pairs[self._pair[i]]
        return (hi, lo) if self._swapped[i] else (lo, hi)

    def reset(self, seeds) -> list[str]:
        """Reset all B instances from B non-negative integer seeds; returns the B situation texts."""
        s = seeds_to_array(seeds, self._B)
        _bandit_reset(s, len(self.pairs), self._rng, self._pair, self._swapped)
        self._name_action[:] = -1
        rows = np.arange(self._B)
        lo = self._pair_names[self._pair, 0]
        hi = self._pair_names[self._pair, 1]
        self._name_action[rows, lo] = self._swapped.astype(np.int64)
        self._name_action[rows, hi] = 1 - self._swapped.astype(np.int64)
        self._chosen[:] = -1
        self._outcome[:] = 0
        self._reward[:] = 0
        self.done[:] = False
        self.success[:] = False
        self.truncated[:] = False
        self._was_reset = True
        return self.render()

    def render(self) -> list[str]:
        """Before the pull: which arms there are; after it: which arm was pulled and its reward."""
        self._require_reset()
        return self._texts[self._pair, self._swapped.astype(np.int64), self._outcome].tolist()

    def instructions(self) -> list[str]:
        """Per-instance rules: the two arm names (in shown order) and how to answer."""
        self._require_reset()
        out = []
        for i in range(self._B):
            a, b = self._arms(i)
            out.append(
                "You are playing a two-armed bandit game. Goal: get the highest reward on average.\n"
                f"There are two arms, named {a} and {b}. Each pays a reward drawn from its own distribution, "
                "which the arm's name hints at. You pull exactly one arm, once.\n"
                f"Valid actions: {a}, {b} (answer with the arm's name)."
            )
        return out

    def action_names(self, i: int) -> list[str]:
        """The two arm names of instance i in id order (the order they are shown)."""
        i = self._check_index(i)
        self._require_reset()
        return list(self._arms(i))

    def high_risk_action(self) -> np.ndarray:
        """np.int64 [B]: the action id of each instance's high-risk arm."""
        self._require_reset()
        return 1 - self._swapped.astype(np.int64)

    def _name_table(self):
        return self._table, self._name_action

    def _step_kernel(self, acts, active, out) -> None:
        _bandit_step(self._rng, self._swapped, self.done, self.success, self._chosen, self._outcome, acts, active,
                     self.low_reward, self.high_reward, self.high_prob, self.high_better, out.reward,
                     out.num_executed, out.valid, out.effective)
        self._reward += out.reward
