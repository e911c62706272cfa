"""A `gymnasium.Env` around one instance of a batched environment, for users of other
RL frameworks: text observations (`spaces.Text`), `spaces.Discrete` actions.

    import gymnasium as gym
    import fastpo.envs_native.gym_registration  # registers the ids below
    env = gym.make("fastpo/Sokoban-v0", size=6, num_boxes=1)
    obs, info = env.reset(seed=3)      # same level as make_native_env("sokoban", B).reset([..., 3, ...])
    obs, reward, terminated, truncated, info = env.step(0)

Registered ids: fastpo/Bandit-v0, fastpo/Sokoban-v0, fastpo/FrozenLake-v0. Needs gymnasium
(the `dev` extra); importing fastpo.envs_native alone does not import it.
"""
from __future__ import annotations

import string

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from . import ENV_NAMES, make_native_env

GYM_IDS = {"bandit": "fastpo/Bandit-v0", "sokoban": "fastpo/Sokoban-v0", "frozenlake": "fastpo/FrozenLake-v0"}


class TextGameEnv(gym.Env):
    """One instance of `make_native_env(env_name, 1, **config)` as a gymnasium environment.

    reset(seed=s) gives the instance that seed s gives in the batched env. info carries
    "instructions" and "action_names" (reset) and "success", "effective" (step).
    Truncation: hitting the env's max_steps (Sokoban, FrozenLake) without success.
    Raises ValueError for an unknown env_name or config, or an action outside the space.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, env_name: str = "frozenlake", render_mode: str | None = None, **config):
        if env_name not in ENV_NAMES:
            raise ValueError(f"unknown environment {env_name!r}; choose one of {ENV_NAMES}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self.env_name = env_name
        self._env = make_native_env(env_name, 1, **config)
        self._env.reset([0])
        self.action_space = spaces.Discrete(len(self._env.action_names(0)))
        symbols = "".join(getattr(self._env, "symbols", {}).values())
        charset = frozenset(string.printable + symbols)
        max_len = 4096 if env_name == "bandit" else len(self._env.render()[0]) + 1
        self.observation_space = spaces.Text(max_length=max_len, min_length=1, charset=charset)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Reset from `seed` (or one drawn from self.np_random); returns (text, info)."""
        super().reset(seed=seed)
        s = seed if seed is not None else int(self.np_random.integers(0, 2**62))
        obs = self._env.reset([s])[0]
        return obs, {"instructions": self._env.instructions()[0], "action_names": self._env.action_names(0)}

    def step(self, action):
        """One action id; returns (text, reward, terminated, truncated, info)."""
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        res = self._env.step(np.array([[int(action)]], dtype=np.int64))
        truncated = bool(self._env.truncated[0])
        terminated = bool(res.done[0]) and not truncated
        info = {"success": bool(res.success[0]), "effective": bool(res.effective[0, 0])}
        return self._env.render()[0], float(res.reward[0]), terminated, truncated, info

    def render(self):
        """The current text for render_mode "ansi", else None."""
        if self.render_mode == "ansi":
            return self._env.render()[0]
        return None


def register_gymnasium() -> None:
    """Register the ids in GYM_IDS with gymnasium (idempotent)."""
    for name, gid in GYM_IDS.items():
        if gid not in gym.registry:
            gym.register(id=gid, entry_point="fastpo.envs_native.gym_registration:TextGameEnv", kwargs={"env_name": name})


register_gymnasium()
