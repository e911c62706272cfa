"""Environments by name: the built-in Numba games and any plain-Python game.

    from fastpo.envs import make_env
    env = make_env("frozenlake", 16)                          # the Numba fast path
    env = make_env("examples.guess_number:GuessNumber", 16)   # a user's class, by import path
    env = make_env("textarena:GuessTheNumber-v0", 16)         # the TextArena adapter
    env = make_env("gym:FrozenLake-v1", 16, {"action_names": ["Left", "Down", "Right", "Up"]})

All of them speak the batched protocol the rollout uses (reset(seeds), render(),
instructions(), action_names(i), parse_actions, step; `step_text` for free-text games).
The interface a plain-Python game implements is in `fastpo.envs.interface`; names are
resolved in `fastpo.envs.names`. Importing this package loads neither Numba nor any
adapter's library.
"""
from __future__ import annotations

from .errors import EnvError
from .interface import SETTING_KEYS, TextEnv
from .mixture import MIXTURE, EnvMember, assign_members, parse_mixture
from .names import (BUILTIN, ENTRY_POINT_GROUP, EnvSpec, check_env, env_preset, has_expert, installed_envs,
                    make_env, resolve_env)

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "EnvError", "EnvMember", "EnvSpec", "MIXTURE", "SETTING_KEYS", "TextEnv",
           "assign_members", "check_env", "env_preset", "has_expert", "installed_envs", "make_env", "parse_mixture",
           "resolve_env"]
