"""gymnasium environments as plain-Python fastpo environments (`--env gym:ID`).

Two kinds of gymnasium env work: one whose observations are text (a `spaces.Text`
observation space), or one with `render_mode="ansi"`, whose rendered text is the
observation. Actions must be `Discrete(n)`; the user names them in id order
(`env.options.action_names=[Left,Down,Right,Up]` for FrozenLake-v1), and the model answers
with those names as in the built-in games.

fastpo's own options (`action_names`, `instructions`, `player`) are kept apart from the
keyword arguments of `gym.make`, which go under `make` (e.g.
`env.options.make.map_name=8x8 env.options.make.is_slippery=false`).

Rendered ANSI markup is turned into plain text: a cell highlighted by a colour (FrozenLake's
player) becomes the `player` symbol ("P"), characters drawn in a colour are named with their
colours in a last line ("Colours: Y magenta, B blue, P on yellow.": Taxi marks its passenger
and destination only so), and every other escape sequence is dropped; the
"  (Down)" line FrozenLake prints after a move is dropped too (the prompt shows the turn's
moves already). Success: `info["success"]` where the env gives it, else an episode that
terminated (not truncated) with a positive reward.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

from .errors import EnvError

_STYLED = re.compile(r"((?:\x1b\[[0-9;]*m)+)([^\x1b\n])")  # colour codes, then the character they style
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_COLOURS = ("black", "red", "green", "yellow", "blue", "magenta", "cyan", "white", "", "default")
_LAST_MOVE = re.compile(r"^\s*\([A-Za-z]+\)\s*$")


def check_gym_id(gym_id: str) -> None:
    """EnvError unless gymnasium is installed and `gym_id` is registered."""
    try:
        import gymnasium as gym
    except ImportError as e:
        raise EnvError(f"the gymnasium adapter needs gymnasium (pip install 'fastpo[gymnasium]'): {e}") from None
    if gym_id not in gym.registry:
        near = sorted(k for k in gym.registry if k.split("-")[0].lower() == gym_id.split("-")[0].lower())
        raise EnvError(f"unknown gymnasium env {gym_id!r}" + (f"; registered: {', '.join(near)}" if near else ""))


def plain_text(ansi: str, player: str = "P") -> str:
    """ANSI-rendered text as plain text: a colour-highlighted character becomes `player`,
    other escape sequences are removed, "(Move)" lines and outer blank lines dropped.

    Characters drawn in a colour (Taxi's passenger in blue, its destination in magenta) keep
    their meaning in a last line, "Colours: Y magenta, B blue, P on yellow." (the highlight's
    colour is named there too: Taxi's cab is yellow empty and green carrying); text without
    coloured characters (FrozenLake's) gets no such line."""
    coloured, highlights = [], []

    def style(m) -> str:
        codes = [int(c) for c in re.findall(r"\d+", m.group(1))]
        fg = next((_COLOURS[c - 30] for c in codes if 30 <= c <= 37), None)
        bg = next((_COLOURS[c - 40] for c in codes if 40 <= c <= 47), None)
        ch = m.group(2)
        if fg:  # a letter under a highlighted cell (Taxi's cab on the passenger) keeps its colour's note
            coloured.append(f"{ch} {fg}" + (f" under {player}" if bg else ""))
        if bg:
            highlights.append(f"{player} on {bg}")
            return player
        return ch

    text = _ANSI.sub("", _STYLED.sub(style, ansi))
    lines = [ln for ln in text.split("\n") if not _LAST_MOVE.match(ln)]
    out = "\n".join(lines).strip("\n")
    if coloured:
        out += "\nColours: " + ", ".join(coloured + highlights) + "."
    return out


class GymTextEnv:
    """One gymnasium env (`fastpo.envs.interface`, named moves).

    Args:
        gym_id: a registered gymnasium id, e.g. "FrozenLake-v1".
        action_names: the names of the Discrete actions in id order (required unless the env
            has a text action space... which fastpo does not support: Discrete only).
        instructions: the rules text shown to the model ("" gives a generic one).
        player: the symbol that replaces a colour-highlighted cell ("P").
        make: keyword arguments of `gym.make` (e.g. {"desc": [...], "is_slippery": True}).
    Raises EnvError for a non-Discrete action space, missing or wrongly counted action names,
    or an env that neither returns text observations nor renders ansi.
    """

    settings: dict = {}

    def __init__(self, gym_id: str, action_names: Optional[Sequence[str]] = None, instructions: str = "",
                 player: str = "P", make: Optional[dict] = None):
        import gymnasium as gym

        if make is not None and not isinstance(make, dict):
            raise EnvError(f"gym:{gym_id}: option make must be a mapping of gym.make keyword arguments, got {make!r}")
        kwargs = dict(make or {})
        kwargs.setdefault("render_mode", "ansi")
        try:
            self.env = gym.make(gym_id, **kwargs)
        except Exception as e:
            raise EnvError(f"gym:{gym_id}: gym.make({gym_id!r}, **{kwargs!r}) failed: {type(e).__name__}: "
                           f"{' '.join(str(e).split())[:200]}") from None
        space = self.env.action_space
        if not isinstance(space, gym.spaces.Discrete):
            raise EnvError(f"gym:{gym_id}: its action space {space} is not Discrete; fastpo names Discrete actions only")
        if action_names is None:
            raise EnvError(f"gym:{gym_id}: name its {space.n} actions in id order, e.g. "
                           f"env.options.action_names=[{','.join(f'a{i}' for i in range(space.n))}]")
        if isinstance(action_names, str) or len(action_names) != space.n:
            raise EnvError(f"gym:{gym_id}: env.options.action_names must name its {space.n} actions in id order, "
                           f"got {action_names!r}")
        self.action_names = [str(a) for a in action_names]
        self._text_obs = isinstance(self.env.observation_space, gym.spaces.Text)
        if not self._text_obs and kwargs["render_mode"] != "ansi":
            raise EnvError(f"gym:{gym_id}: observations are not text; it needs render_mode='ansi'")
        self.player = player
        self.gym_id = gym_id
        self.instructions = instructions or (
            f"You play the gymnasium game {gym_id}. Your moves: {', '.join(self.action_names)}.")
        self._lookup = {n.lower(): i for i, n in enumerate(self.action_names)}
        self._total = 0.0

    def _text(self, obs) -> str:
        return plain_text(obs if self._text_obs else self.env.render(), self.player)

    def reset(self, seed: int) -> str:
        """gymnasium's reset(seed=seed); the observation text."""
        obs, _ = self.env.reset(seed=int(seed))
        self._total = 0.0
        return self._text(obs)

    def step(self, answer: str):
        """One named move; (observation, reward, done = terminated or truncated, info)."""
        a = self._lookup[answer.strip().lower()]
        obs, reward, terminated, truncated, info = self.env.step(a)
        self._total += float(reward)
        success = bool(info["success"]) if "success" in info else bool(terminated and self._total > 0)
        return self._text(obs), float(reward), bool(terminated or truncated), \
            {"success": success, "terminated": bool(terminated)}
