"""The plain-Python environment interface: one game instance per object.

A user's game needs no Numba and no batching; fastpo runs B instances behind the batched
protocol the rollout uses (`fastpo.envs.batched.PythonBatchedEnv`)::

    class Guess:
        instructions = "Guess my number between 1 and 100."
        def reset(self, seed: int) -> str: ...                       # first observation text
        def step(self, answer: str) -> tuple[str, float, bool, dict]: ...  # obs, reward, done, info

Required: `reset(seed)` (seed: a non-negative int; the same seed must give the same game)
and `step(answer)` returning (observation: str, reward: real number, done: bool,
info: dict), with `info["success"]` (bool) once the game is won. Optional:

- `instructions`: the rules shown once in the first user message (a str, or a method of no
  argument read after `reset`).
- `action_names`: a sequence of move names (attribute or method read after `reset`). With
  it, answers are lists of named moves ("Up || Left"), parsed as for the built-in games
  (RAGEN's rule, the per-turn action cap, the format penalty on an unknown name), and
  `step` gets one move name per call. Without it (None or absent) the game takes free text:
  the whole `<answer>` content goes to `step` once per turn, and `info["valid"]` (default
  True) says whether the env accepted it (False: the format penalty).
- `settings`: a dict of the rollout settings the game fixes (`max_turns`,
  `max_actions_per_turn`, `max_actions_per_traj`, `format_penalty`), applied like the
  built-in games' env presets (after `--preset`, before the config file and overrides).
- `expert()`: the answer a good player gives in the current state (after `reset` and after
  each turn's `step` calls): the `<answer>` content as text, e.g. "Up || Left" or "42".
  `fastpo sft --env yourmod:Game` plays the game with it, closed loop, and trains the model
  on those answers (docs/sft.md).
- `random_success(seeds, horizon)` and `optimal_success(seeds, horizon)`: per seed, the
  success probability of the uniformly random and of the best policy within `horizon`
  actions; the evaluation table shows them beside the model's, or says they are not known.

Options: `env.options.KEY=VALUE` become keyword arguments of the class's constructor; an
option the constructor does not take is refused (one line, before any model loads).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from .errors import EnvError

#: Keys an env's `settings` may fix (RolloutConfig fields).
SETTING_KEYS = ("max_turns", "max_actions_per_turn", "max_actions_per_traj", "format_penalty")


class TextEnv:
    """Optional base class of a plain-Python environment (duck typing works as well).

    Subclasses implement `reset` and `step`; see the module docstring for the contract.
    """

    instructions: str = ""
    action_names: Optional[Sequence[str]] = None
    settings: dict = {}

    def reset(self, seed: int) -> str:  # pragma: no cover - interface
        """Start a game from `seed` (int >= 0); returns the first observation text."""
        raise NotImplementedError

    def step(self, answer: str) -> tuple:  # pragma: no cover - interface
        """Play one answer (a move name, or the free-text answer); returns (observation str,
        reward float, done bool, info dict with "success" bool and optionally "valid" bool)."""
        raise NotImplementedError


def missing_methods(cls) -> list:
    """The required methods (`reset`, `step`) that `cls` lacks or does not make callable."""
    return [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]


def check_settings(settings: dict, owner: str) -> None:
    """EnvError naming `owner` for a key outside SETTING_KEYS or a bad value (format_penalty: a
    finite number; the limits: integers >= 1)."""
    bad = [k for k in settings if k not in SETTING_KEYS]
    if bad:
        raise EnvError(f"{owner}: unknown key(s) {bad}; known: {list(SETTING_KEYS)}")
    for k, v in settings.items():
        if k == "format_penalty":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        if not ok:
            raise EnvError(f"{owner}[{k!r}] = {v!r} must be " + ("a finite number" if k == "format_penalty"
                                                                 else "an integer >= 1"))
