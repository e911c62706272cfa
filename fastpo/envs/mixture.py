"""Several environments in one run: the members of `env.mixture` and which one an env group plays.

A mixture is a list of entries, each a mapping::

    env:
      mixture:
        - {name: sokoban, weight: 2}
        - {name: frozenlake, options: {slippery: false}}
        - {name: textarena:GuessTheNumber-v0, settings: {max_turns: 8}}

Keys of an entry: `name` (required; any env name `fastpo.envs.resolve_env` takes), `weight`
(a positive number, default 1: the share of env groups drawn for this game is weight / sum of
weights), `options` (the game's constructor arguments, as `env.options`), `settings` (this
game's own turn and action limits and format penalty: `SETTING_KEYS`, applied over the game's
own `settings` and the run's `rollout.*`) and `label` (the name of its metrics,
`eval/<label>/success_rate`; default: `name`; labels must differ).

Each training env group plays the member `member_index(group seed, weights)`: a uniform draw
from the group's env seed, so the choice is fixed by the run's seed and the iteration (an exact
resume draws the same), and a group plays the same game whichever process rolls it out.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import numpy as np

from .errors import EnvError
from .interface import check_settings

#: `env.name` of a run whose env groups come from `env.mixture` (set by the configuration).
MIXTURE = "mixture"
ENTRY_KEYS = ("name", "weight", "options", "settings", "label")
_SALT = 0x6D1E  # keeps the member draw apart from the other uses of a group's env seed


@dataclasses.dataclass(frozen=True)
class EnvMember:
    """One game of a run. label: its metrics' name. name: the env name. weight: > 0 (its
    share of env groups is weight / the sum). options: constructor arguments. settings: the
    rollout settings it fixes over the run's (SETTING_KEYS)."""

    label: str
    name: str
    weight: float = 1.0
    options: dict = dataclasses.field(default_factory=dict)
    settings: dict = dataclasses.field(default_factory=dict)


def parse_mixture(entries) -> list[EnvMember]:
    """The members of an `env.mixture` value (a non-empty list of mappings, see the module
    docstring). Raises EnvError with one line naming the entry and what is wrong: not a list,
    an entry that is not a mapping, an unknown key, no name, a weight that is not a positive
    finite number, options or settings that are not mappings, an unknown setting or a bad
    value for one, a label used twice. Env names are not resolved here (`check_members`)."""
    if not isinstance(entries, (list, tuple)) or not entries:
        raise EnvError(f"env.mixture must be a non-empty list of {{name: ..., weight: ...}} entries, "
                       f"got {entries!r:.120}")
    out, labels = [], {}
    for i, e in enumerate(entries):
        where = f"env.mixture[{i}]"
        if isinstance(e, str):  # a bare name: weight 1
            e = {"name": e}
        if not isinstance(e, dict):
            raise EnvError(f"{where} = {e!r:.80}: must be a mapping such as {{name: sokoban, weight: 2}}")
        unknown = [k for k in e if k not in ENTRY_KEYS]
        if unknown:
            raise EnvError(f"{where}: unknown key(s) {unknown}; an entry takes {list(ENTRY_KEYS)}")
        name = e.get("name")
        if not isinstance(name, str) or not name.strip():
            raise EnvError(f"{where}: 'name' must name an environment, got {name!r}")
        name = name.strip()
        weight = _number(e.get("weight", 1.0))
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise EnvError(f"{where} ({name}): weight = {weight!r} must be a positive number")
        options = e.get("options") or {}
        settings = e.get("settings") or {}
        for key, value in (("options", options), ("settings", settings)):
            if not isinstance(value, dict):
                raise EnvError(f"{where} ({name}): '{key}' must be a mapping, got {value!r:.80}")
        settings = {k: _number(v) if k == "format_penalty" else v for k, v in settings.items()}
        check_settings(settings, f"{where} ({name}) settings")
        # the default label: the name with what a metric key cannot hold (e.g. gym:a/B-v0's "/") as "_"
        label = e.get("label", re.sub(r"[^A-Za-z0-9._:+-]", "_", name))
        if not isinstance(label, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:+-]*", label):
            raise EnvError(f"{where} ({name}): label = {label!r} must be a non-empty name of letters, digits and ._:+-")
        if label in labels:
            raise EnvError(f"{where}: label {label!r} is also env.mixture[{labels[label]}]'s; give one of them "
                           "another 'label'")
        labels[label] = i
        out.append(EnvMember(label, name, float(weight), dict(options), dict(settings)))
    return out


def _number(v):
    """`v`, or the float a string in exponent form means ("1e-3": YAML 1.1, which PyYAML reads,
    takes it for a string, as fastpo's typed config keys do not)."""
    if isinstance(v, str) and re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)\s*", v):
        return float(v)
    return v


def shares(members: Sequence[EnvMember]) -> np.ndarray:
    """float64 [M]: each member's weight over the sum of weights."""
    return _normalised([m.weight for m in members])


def _normalised(weights) -> np.ndarray:
    """float64 weights over their sum (divided by the largest first: a sum of huge weights must
    not overflow)."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.max()
    return w / w.sum()


def member_index(seed: int, weights: Sequence[float]) -> int:
    """The member an env group of env seed `seed` plays: u, uniform in [0, 1) from
    (seed, a salt), falls in member k's slice of the cumulative normalised `weights`."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 1:
        return 0
    u = np.random.default_rng([_SALT, int(seed)]).random()
    return int(min(np.searchsorted(np.cumsum(_normalised(w)), u, side="right"), len(w) - 1))


def assign_members(seeds: Sequence[int], members: Sequence[EnvMember]) -> list[int]:
    """`member_index` of each env group seed."""
    w = [m.weight for m in members]
    return [member_index(s, w) for s in seeds]
