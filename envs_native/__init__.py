"""Numba-compiled batched text-game environments: Bandit, Sokoban, FrozenLake.

    from fastpo.envs_native import make_native_env
    env = make_native_env("frozenlake", 128, size=4, p=0.8)
    obs = env.reset(range(128))                      # B observation texts
    parsed = env.parse_actions(answers, max_actions=5)
    result = env.step(parsed.actions)                # StepResult: reward, done, success, ...

Every environment holds B instances as NumPy arrays and steps them in one compiled call
(``@njit(cache=True)``, so only the first process on a machine pays the compile time; any
edit to a source file of this package recompiles them all once, see _numba_cache.py).
Importing this package loads NumPy and Numba only.
"""
from __future__ import annotations

import inspect as _inspect
import os as _os

from . import _numba_cache

# Before any compiled module is imported: numba stamps each cached function when decorated.
_numba_cache.install(_os.path.dirname(_os.path.abspath(__file__)))

from ._core import BatchedTextEnv, ParsedActions, StepResult
from .bandit import BanditEnv
from .frozenlake import FrozenLakeEnv
from .sokoban import SokobanEnv

ENV_NAMES = ("bandit", "sokoban", "frozenlake")
_CLASSES = {"bandit": BanditEnv, "sokoban": SokobanEnv, "frozenlake": FrozenLakeEnv}

__all__ = ["ENV_NAMES", "BatchedTextEnv", "ParsedActions", "StepResult", "env_class", "make_native_env"]


def env_class(name: str) -> type:
    """The class of environment `name` (one of ENV_NAMES). Raises ValueError for another name."""
    if name not in _CLASSES:
        raise ValueError(f"unknown environment {name!r}; choose one of {ENV_NAMES}")
    return _CLASSES[name]


def make_native_env(name: str, batch_size: int, **config) -> BatchedTextEnv:
    """Build B instances of the Numba game `name` (one of ENV_NAMES) with its config as keyword
    arguments. (`fastpo.envs.make_env(name, batch_size, options)` takes every environment name,
    plain-Python games and adapters too, and builds a Numba game through this.)

    Config keys per environment are the keyword arguments of BanditEnv, SokobanEnv and
    FrozenLakeEnv. Raises ValueError naming an unknown environment, an unknown config key
    or a bad config value.
    """
    cls = env_class(name)
    params = _inspect.signature(cls.__init__).parameters
    unknown = [k for k in config if k not in params or k in ("self", "batch_size")]
    if unknown:
        known = [k for k in params if k not in ("self", "batch_size")]
        raise ValueError(f"unknown config key(s) {unknown} for {name!r}; known: {known}")
    return cls(batch_size, **config)
