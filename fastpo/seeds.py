"""The random streams a run derives from `trainer.seed`, each from its own salt.

The values are fixed: a run repeats, and a resume continues it identically, only while they
never change. The env seeds of an iteration are a pure function of (seed, iteration), so a
resumed or dropped iteration is redone with the same env groups.
"""
from __future__ import annotations

import numpy as np

SALT_ENV_SEEDS = 7919  # (seed, iteration, salt) -> the env groups' seeds (`iteration_seeds`)
SALT_MINI_BATCH_ORDER = 104729  # (seed, iteration, salt) -> the PPO epochs' mini-batch shuffles
SALT_EVAL_SAMPLING = 12345  # seed + salt: the evaluation's sampling seed (`eval_sampling_seed`)
SALT_ROLLOUT_SAMPLING = 1_000_003  # seed * salt + iteration: a training rollout's sampling seed
SALT_GROUP_SAMPLING = 15485863  # (sampling seed, group, salt) -> an env group's own sampling stream
SALT_DYNAMIC_DRAW = 2750159  # (seed, iteration, draw, salt) -> DAPO's extra draws: env seeds, sampling seed
SALT_CLIP_COV = 32452843  # (seed, iteration, call, salt) -> Clip-Cov's token draw in one loss call


def iteration_seeds(seed: int, iteration: int, n: int) -> list[int]:
    """The `n` env seeds (ints in [0, 2**31 - 1)) of iteration `iteration`, a pure function of
    (seed, iteration)."""
    rng = np.random.default_rng([seed, iteration, SALT_ENV_SEEDS])
    return [int(s) for s in rng.integers(0, 2**31 - 1, size=n)]


def rollout_sampling_seed(seed: int, iteration: int) -> int:
    """The sampling seed of iteration `iteration`'s rollout."""
    return seed * SALT_ROLLOUT_SAMPLING + iteration


def eval_sampling_seed(seed: int) -> int:
    """The sampling seed of every evaluation of a run (the same at each iteration, so that
    evaluations differ only by the policy)."""
    return seed + SALT_EVAL_SAMPLING


def mini_batch_generator_seed(seed: int, iteration: int) -> int:
    """The seed of the torch.Generator that shuffles iteration `iteration`'s mini-batches."""
    return int(np.random.default_rng([seed, iteration, SALT_MINI_BATCH_ORDER]).integers(2**62))


def clip_cov_seed(seed: int, iteration: int, call: int) -> int:
    """The `cov_seed` of Clip-Cov's random token choice in the `call`-th policy-loss call
    (micro-batch, counted from 0 over the PPO epochs) of iteration `iteration`: a fresh draw
    per call, as verl's, and a pure function of (seed, iteration, call), so a resumed
    iteration draws the same tokens. A value in [0, 2**62)."""
    return int(np.random.default_rng([seed, iteration, call, SALT_CLIP_COV]).integers(2**62))


def group_sampling_seed(sampling_seed: int, group: int) -> int:
    """The seed of env group `group`'s own sampling stream in a rollout seeded `sampling_seed`
    (per-group streams: `MultiTurnRollout.generate(group_ids=...)`), a value in [0, 2**62)."""
    return int(np.random.default_rng([int(sampling_seed) % 2**63, int(group), SALT_GROUP_SAMPLING]).integers(2**62))


def dynamic_draw_seeds(seed: int, iteration: int, draw: int, n: int) -> tuple[list[int], int]:
    """(the `n` env seeds, the sampling seed) of extra draw `draw` >= 1 of iteration
    `iteration` under DAPO's dynamic sampling (draw 0 is the iteration's own rollout:
    `iteration_seeds`, `rollout_sampling_seed`); a pure function of (seed, iteration, draw),
    so a resumed iteration draws the same groups."""
    rng = np.random.default_rng([seed, iteration, draw, SALT_DYNAMIC_DRAW])
    seeds = [int(s) for s in rng.integers(0, 2**31 - 1, size=n)]
    return seeds, int(rng.integers(2**62))
