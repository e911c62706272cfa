"""Environment names: the built-in games, import paths, installed entry points, adapters.

A name is, in this order:

- a built-in game: "bandit", "sokoban", "frozenlake" (the Numba fast path);
- "probe:NAME": one of fastpo's probe games (fastpo.envs.probes: choice, constant, delayed,
  recall, discount), each proving one property of the trainer;
- "textarena:ID" or "gym:ID": a game of that suite through fastpo's adapter (these three
  prefixes are reserved: "textarena:X" never means class X of a module named textarena);
- "module.path:Class": that class, imported (the module must be importable: installed, or
  on sys.path / PYTHONPATH);
- a name an installed package registers in the "fastpo.envs" entry-point group, e.g. in its
  pyproject.toml: `[project.entry-points."fastpo.envs"] guess = "mygames.guess:Guess"`.

Everything here raises `EnvError` with one line naming what is wrong, and loads no model.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import sys
from typing import Callable, Optional

from .batched import PythonBatchedEnv
from .errors import EnvError
from .gym_env import GymTextEnv, check_gym_id
from .interface import check_settings, missing_methods
from .probes import PROBES
from .textarena_env import TextArenaEnv, check_game_id

BUILTIN = ("bandit", "sokoban", "frozenlake")
#: What each built-in game fixes (RolloutConfig keys), applied after the named preset: Bandit is
#: single-turn; the multi-turn games take the defaults (5 turns, 5 actions per turn, 10 per
#: trajectory) or the preset's.
BUILTIN_SETTINGS = {"bandit": {"max_turns": 1, "max_actions_per_turn": 1, "max_actions_per_traj": 1},
                    "sokoban": {}, "frozenlake": {}}
ENTRY_POINT_GROUP = "fastpo.envs"
#: The reserved prefixes ("PREFIX:ID"), each with an example id for its error.
ADAPTERS = {"textarena": "textarena:GuessTheNumber-v0", "gym": "gym:FrozenLake-v1", "probe": "probe:choice"}


@dataclasses.dataclass
class EnvSpec:
    """What a name resolves to.

    name: the name as given. kind: "native" (a Numba game) or "python" (a plain-Python game
    behind `PythonBatchedEnv`). factory: the class (or a partial of it) building one
    instance from the options; None for native games. settings: the rollout settings the game
    fixes (RolloutConfig keys), applied after the named preset (a built-in's: BUILTIN_SETTINGS).
    """

    name: str
    kind: str
    factory: Optional[Callable] = None
    settings: dict = dataclasses.field(default_factory=dict)


def installed_envs() -> dict:
    """{name: entry point} of the "fastpo.envs" entry-point group (installed packages' games)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _choices() -> str:
    extra = sorted(installed_envs())
    return (f"a built-in game ({', '.join(BUILTIN)})" + (f", an installed one ({', '.join(extra)})" if extra else "")
            + ", 'probe:NAME', 'module.path:Class', 'textarena:GAME-ID' or 'gym:GAME-ID'")


@functools.lru_cache(maxsize=64)
def resolve_env(name: str) -> EnvSpec:
    """The EnvSpec of env name `name` (see the module docstring). Raises EnvError for an
    unknown name, a module that fails to import, a missing class or one that does not
    implement the interface (reset, step), or bad `settings`."""
    if not isinstance(name, str) or not name.strip():
        raise EnvError(f"env name must be a non-empty string, got {name!r}; choose {_choices()}")
    name = name.strip()
    if name in BUILTIN:
        return EnvSpec(name, "native", settings=dict(BUILTIN_SETTINGS[name]))
    prefix, sep, rest = name.partition(":")
    if sep and prefix in ADAPTERS:
        game = rest.strip()
        if not game:
            raise EnvError(f"env {name!r}: give the game id after '{prefix}:', e.g. {ADAPTERS[prefix]}")
        if prefix == "probe":
            if game not in PROBES:
                raise EnvError(f"unknown probe game {game!r}; choose one of {', '.join(PROBES)}")
            cls = factory = PROBES[game]
        elif prefix == "textarena":
            check_game_id(game)
            cls, factory = TextArenaEnv, functools.partial(TextArenaEnv, game)
        else:
            check_gym_id(game)
            cls, factory = GymTextEnv, functools.partial(GymTextEnv, game)
        return EnvSpec(name, "python", factory, _settings(cls, name))
    if sep:
        cls = _import_class(name, prefix, rest)
    else:
        eps = installed_envs()
        if name not in eps:
            raise EnvError(f"unknown environment {name!r}; choose {_choices()}")
        try:
            cls = eps[name].load()
        except Exception as e:
            raise EnvError(f"environment {name!r} (entry point {eps[name].value!r}) failed to load: "
                           f"{type(e).__name__}: {_first_line(e)}") from None
    missing = missing_methods(cls)
    if missing or not callable(cls):
        raise EnvError(f"environment {name!r}: {getattr(cls, '__name__', cls)!r} does not implement the environment "
                       f"interface (missing {', '.join(missing) or 'a constructor'}; needs reset(seed) -> str and "
                       "step(answer) -> (observation, reward, done, info))")
    return EnvSpec(name, "python", cls, _settings(cls, name))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else "(no message)"


def _import_class(name: str, module: str, attr: str):
    if not module.strip() or not attr.strip():
        raise EnvError(f"env {name!r}: an import path is 'module.path:Class'")
    if os.getcwd() not in sys.path:  # `fastpo train --env mygame:Game` from the game's folder (as uvicorn does)
        sys.path.append(os.getcwd())
    try:
        mod = importlib.import_module(module.strip())
    except ModuleNotFoundError as e:
        if e.name and module.strip().startswith(e.name):
            raise EnvError(f"environment {name!r}: no module named {e.name!r} (is it installed, on PYTHONPATH or under the current folder?)") \
                from None
        raise EnvError(f"environment {name!r}: importing {module!r} failed: {type(e).__name__}: {_first_line(e)}") \
            from None
    except Exception as e:
        raise EnvError(f"environment {name!r}: importing {module!r} failed: {type(e).__name__}: {_first_line(e)}") \
            from None
    obj = mod
    for part in attr.strip().split("."):
        if not hasattr(obj, part):
            raise EnvError(f"environment {name!r}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def _settings(cls, name: str) -> dict:
    s = getattr(cls, "settings", None) or {}
    if not isinstance(s, dict):
        raise EnvError(f"environment {name!r}: settings must be a dict, got {type(s).__name__}")
    check_settings(s, f"environment {name!r}: its settings")  # said as the game's, not as a config key
    return dict(s)


def has_expert(name: str) -> bool:
    """Whether game `name` has an expert (the answer a good player gives in a state, which
    `fastpo sft` and `fastpo dagger` learn from): a class with a callable `expert`, a built-in
    game's (`expert(i, actions_left)`, fastpo.envs_native) or a plain-Python game's
    (`expert()`, fastpo.envs.interface). Raises EnvError as `resolve_env`."""
    spec = resolve_env(name)
    if spec.kind == "native":
        # numba: `import fastpo.envs` loads none (the Numba games load on first use)
        from fastpo.envs_native import env_class

        return callable(getattr(env_class(spec.name), "expert", None))
    return callable(getattr(spec.factory, "expert", None))


def env_preset(name: str) -> dict:
    """The env preset of `name`: what the game fixes, as a config dict ({"rollout": {...}});
    {} for the multi-turn built-ins, the built-in Bandit's single-turn limits, a Python game's
    `settings`. Raises EnvError as `resolve_env`."""
    spec = resolve_env(name)
    return {"rollout": dict(spec.settings)} if spec.settings else {}


def _check_options(spec: EnvSpec, options: dict) -> None:
    """EnvError naming the options the factory does not take."""
    try:
        sig = inspect.signature(spec.factory)
    except (TypeError, ValueError):  # builtins without a signature: the call itself will tell
        return
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    takes = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in options if k not in takes]
    if unknown:
        raise EnvError(f"environment {spec.name!r} takes no option(s) {unknown}; its options: {takes or 'none'}")


def make_env(name: str, batch_size: int, options: Optional[dict] = None, workers: int = 0):
    """B instances of env `name` behind the batched protocol: a Numba `BatchedTextEnv` for a
    built-in game, a `PythonBatchedEnv` (with `workers` processes, 0 = in process)
    otherwise. Raises EnvError for a bad name or option, or when building fails."""
    spec = resolve_env(name)
    options = dict(options or {})
    if spec.kind == "native":
        # numba: `import fastpo.envs` loads none (the Numba games load on first use)
        from fastpo.envs_native import make_native_env

        try:
            return make_native_env(spec.name, batch_size, **options)
        except (ValueError, TypeError, RuntimeError) as e:
            raise EnvError(f"environment {name!r}: {e}") from None
    _check_options(spec, options)
    return PythonBatchedEnv(spec.factory, batch_size, options, name=name, workers=workers)


def check_env(name: str, options: Optional[dict] = None, bounds: Optional[tuple] = None) -> None:
    """Dry run before any model loads: resolve `name` and build one instance with
    `options` (a built-in Sokoban with options is also reset once, which finds impossible
    levels). A plain-Python game (TextArena's and gymnasium's included) is also played once
    (`PythonBatchedEnv.probe`: a reset, a step, and with `bounds` = (seeds, horizon) its
    reference lines), so a broken definition is refused now rather than mid-run. Raises
    EnvError naming what is wrong."""
    env = make_env(name, 1, options)
    if name == "sokoban" and options:
        try:
            env.reset([0])
        except (ValueError, TypeError, RuntimeError) as e:
            raise EnvError(f"environment {name!r}: {e}") from None
    probe = getattr(env, "probe", None)
    if probe is not None:
        try:
            probe(bounds)
        finally:
            env.close()
