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

from ._core import BatchedTextEnv, NameTable, _is_real, check_horizon, rng_below, rng_seed_all, rng_uniform, seed_list

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
def _bandit_reset(seeds, n_pairs, rng, pair, swapped, obs):
    rng_seed_all(seeds, _SALT, rng)
    for b in range(seeds.shape[0]):
        pair[b] = rng_below(rng, b, n_pairs)
        swapped[b] = rng_below(rng, b, 2) == 1
        obs[b] = (pair[b] * 2 + swapped[b]) * 4


@njit(cache=True)
def _bandit_step(rng, swapped, chosen, obs, total, done, success, actions, active, params, reward, num_exec, valid,
                 effective):
    """One pull per active, not-done instance (the first valid action id of its row).

    params: float64 [4] (low_reward, high_reward, high_prob, 1.0 if the high-risk arm is the
    better one else 0.0). obs[b] (the index of b's observation text) moves from the
    before-the-pull text to outcome 1 (low arm), 2 (high arm paid) or 3 (high arm not paid);
    total[b] is the episode's reward.
    """
    B = actions.shape[0]
    A = actions.shape[1]
    high_better = params[3] != 0.0
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
                if rng_uniform(rng, b) < params[2]:
                    r = params[1]
                    obs[b] += 2
                else:
                    r = 0.0
                    obs[b] += 3
            else:
                r = params[0]
                obs[b] += 1
            reward[b] += r
            total[b] = r
            chosen[b] = a
            success[b] = high == high_better
            done[b] = True
            break


class BanditEnv(BatchedTextEnv):
    """B two-armed bandit instances.

    Config: split ("train" or "test": which list of name pairs), pairs (custom list of
    (low-risk name, high-risk name); overrides split), low_reward (0.1), high_reward (1.0),
    high_prob (0.25). Raises ValueError naming a bad config value.

    Unlike FrozenLake and Sokoban, `instructions()` and `action_names(i)` name the arms of
    each instance, which exist only after `reset`: before it they raise RuntimeError.
    """

    name = "bandit"

    def __init__(self, batch_size: int, split: str = "train", pairs=None, low_reward: float = 0.1,
                 high_reward: float = 1.0, high_prob: float = 0.25):
        super().__init__(batch_size)
        if pairs is None:
            if split not in ("train", "test"):
                raise ValueError(f"split must be 'train' or 'test', got {split!r}")
            pairs = TRAIN_PAIRS if split == "train" else TEST_PAIRS
        self.pairs = _check_pairs(pairs)
        for k, v in (("low_reward", low_reward), ("high_reward", high_reward)):
            if not _is_real(v) or not np.isfinite(v):
                raise ValueError(f"{k} must be a finite number, got {v!r}")
        if not (_is_real(high_prob) and 0.0 <= high_prob <= 1.0):
            raise ValueError(f"high_prob must be in [0, 1], got {high_prob!r}")
        self.low_reward, self.high_reward, self.high_prob = float(low_reward), float(high_reward), float(high_prob)
        self.high_better = self.high_reward * self.high_prob >= self.low_reward
        self._params = np.array([self.low_reward, self.high_reward, self.high_prob, float(self.high_better)])
        names = []
        for p in self.pairs:
            for n in p:
                if n.lower() not in (x.lower() for x in names):
                    names.append(n)
        self._table = NameTable(names)  # validates the names
        idx = np.array([[self._table.index[n.lower()] for n in p] for p in self.pairs], dtype=np.int64)
        self._pair_names = idx
        B = self._B
        self._rng = np.zeros(B, dtype=np.uint64)
        self._pair = np.zeros(B, dtype=np.int64)
        self._swapped = np.zeros(B, dtype=np.bool_)
        self._chosen = np.full(B, -1, dtype=np.int64)
        self._reward = np.zeros(B, dtype=np.float32)  # the episode's reward
        # every observation text there can be, flat: index (pair * 2 + swapped) * 4 + outcome
        # (outcome 0 before the pull, 1 low arm, 2 high arm paid, 3 high arm not paid);
        # _obs holds each instance's index, so render is one NumPy take
        texts = []
        for lo, hi in self.pairs:
            for sw in (0, 1):
                a, b = (hi, lo) if sw else (lo, hi)
                texts += [f"Two arms: {a} and {b}. Which arm do you pull?",
                          f"You pulled {lo} and received reward {self.low_reward:g}.",
                          f"You pulled {hi} and received reward {self.high_reward:g}.",
                          f"You pulled {hi} and received reward 0."]
        self._texts = np.array(texts, dtype=object)
        self._obs = np.zeros(B, dtype=np.int64)
        self._name_action = np.full((B, len(names)), -1, dtype=np.int64)

    def _arms(self, i: int) -> tuple[str, str]:
        lo, hi = self.pairs[self._pair[i]]
        return (hi, lo) if self._swapped[i] else (lo, hi)

    def _reset_kernel(self, s: np.ndarray) -> None:
        """Each instance's arm pair and order from its seed; `reset` returns the situation texts."""
        _bandit_reset(s, len(self.pairs), self._rng, self._pair, self._swapped, self._obs)
        self._name_action[:] = -1
        rows = np.arange(self._B)
        lo = self._pair_names[self._pair, 0]
        hi = self._pair_names[self._pair, 1]
        self._name_action[rows, lo] = self._swapped.astype(np.int64)
        self._name_action[rows, hi] = 1 - self._swapped.astype(np.int64)
        self._chosen[:] = -1
        self._reward[:] = 0

    def render(self) -> list[str]:
        """Before the pull: which arms there are; after it: which arm was pulled and its reward.

        Raises RuntimeError before the first reset.
        """
        self._require_reset()
        return self._texts.take(self._obs).tolist()

    def instructions(self) -> list[str]:
        """Per-instance rules: the two arm names (in shown order) and how to answer.

        Raises RuntimeError before the first reset (the arm names come from it).
        """
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
        """The two arm names of instance i in id order (the order they are shown).

        Raises ValueError for an index outside [0, B), RuntimeError before the first reset.
        """
        i = self._check_index(i)
        self._require_reset()
        return list(self._arms(i))

    def high_risk_action(self) -> np.ndarray:
        """np.int64 [B]: the action id of each instance's high-risk arm. Raises RuntimeError before reset."""
        self._require_reset()
        return 1 - self._swapped.astype(np.int64)

    def better_action(self) -> np.ndarray:
        """np.int64 [B]: the action id of each instance's arm of higher expected reward (the
        high-risk arm when high_reward * high_prob >= low_reward, as in the paper's 0.25 > 0.1;
        otherwise the low-risk arm): the expert's pull. Raises RuntimeError before reset."""
        high = self.high_risk_action()
        return high if self.high_better else 1 - high

    def expert(self, i: int, actions_left: int = 1) -> list[str]:
        """The expert's pull in instance i: the arm of higher expected reward (`better_action`).
        Raises ValueError for an index outside [0, B), RuntimeError before reset."""
        return [self.action_names(i)[int(self.better_action()[i])]]

    def optimal_success(self, seeds, horizon: int = 1) -> np.ndarray:
        """float64 [n]: 1.0 per seed. Success is pulling the arm of higher expected reward
        (from low_reward, high_reward and high_prob), which the best policy always does.

        seeds: a list, range or 1-D array of non-negative integers. Raises TypeError for
        another seeds type, ValueError for a horizon that is not an integer >= 1 or a bad seed.
        """
        check_horizon(horizon)
        return np.ones(seed_list(seeds).shape[0])

    def random_success(self, seeds, horizon: int = 1) -> np.ndarray:
        """float64 [n]: 0.5 per seed, exactly: the uniformly random policy pulls the better of
        the two arms half the time (one pull ends the episode, whatever the horizon).
        Arguments and errors as `optimal_success`."""
        check_horizon(horizon)
        return np.full(seed_list(seeds).shape[0], 0.5)

    def _step_kernel(self, acts, active, out) -> None:
        _bandit_step(self._rng, self._swapped, self._chosen, self._obs, self._reward, self.done, self.success, acts,
                     active, self._params, out.reward, out.num_executed, out.valid, out.effective)


def _check_pairs(pairs) -> list[tuple[str, str]]:
    """pairs as a list of (low-risk name, high-risk name) tuples; ValueError naming a bad one."""
    what = "pairs must be a non-empty list of (low-risk name, high-risk name) pairs"
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError(f"{what}, got {pairs!r:.200}")
    out = []
    for p in pairs:
        if isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple)) or len(p) != 2 \
                or not all(isinstance(n, str) for n in p):
            raise ValueError(f"{what}; {p!r:.100} is not a pair of two name strings")
        if p[0].lower() == p[1].lower():
            raise ValueError(f"the two arms of a pair need different names, got {tuple(p)!r}")
        out.append((p[0], p[1]))
    return out
