"""TextArena's single-player games as plain-Python fastpo environments (`--env textarena:ID`).

Checked against textarena 0.7.4 (the `textarena` extra):

- The game is made from its "-raw" id, which returns only the new messages each turn
  (`ta.make(id)`'s default wrappers return the whole transcript every turn: appended as the
  next user message it would repeat text in the KV cache). The first message, the rules,
  is fastpo's `instructions`; the player's own echoed action is dropped.
- `step(text)` returns (done, info) with no per-step reward; the reward comes from
  `close()` once the game is over (1 for a win, a fraction for partial progress on a loss),
  so success is a final reward of 1.
- Moves are bracketed ("[10]", "[down]", "[1 2 3 4]"): an answer without a bracket is put
  in one ("10" -> "[10]"), one with a bracket is passed as it is. A first invalid move gets
  a "resubmit" message at no cost (reported as not valid: the format penalty); a second one
  ends the game.
- `reset` seeds Python's global `random`, and e.g. Minesweeper draws its mines on the first
  step from it: `PythonBatchedEnv` keeps each instance's `random` state apart.
- Games that need NLTK data (Wordle, Hangman, WordLadder, SpellingBee, ...) download it
  when imported; fastpo checks for the data first and refuses with an error instead.
- Some games ignore the seed: TowerOfHanoi-v0 has one start state and Countdown-v0 one fixed
  puzzle, so every env group plays the same game.
"""
from __future__ import annotations

import importlib.util
import inspect
import re

from .errors import EnvError

_NLTK_RESOURCE = {"words": "corpora/words", "averaged_perceptron_tagger_eng": "taggers/averaged_perceptron_tagger_eng"}


def _registry():
    try:
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError as e:
        raise EnvError(f"the TextArena adapter needs the textarena package (pip install 'fastpo[textarena]'): "
                       f"{e}") from None
    return ENV_REGISTRY


def check_game_id(game_id: str) -> None:
    """EnvError unless `game_id` is a registered TextArena game whose data is present."""
    reg = _registry()
    raw = game_id if game_id.endswith("-raw") else game_id + "-raw"
    if raw not in reg:
        close = sorted(k[:-4] for k in reg if k.endswith("-raw") and k.lower().startswith(game_id[:4].lower()))
        raise EnvError(f"unknown TextArena game {game_id!r}" + (f"; similar: {', '.join(close[:8])}" if close else ""))
    entry = reg[raw].entry_point
    module = entry.split(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")
    _check_nltk(game_id, module)


def _check_nltk(game_id: str, module: str) -> None:
    """Refuse a game whose module downloads NLTK data that is not installed (no download)."""
    spec = importlib.util.find_spec(module) if module else None
    if spec is None or not spec.origin:
        return
    try:
        text = open(spec.origin, encoding="utf-8").read()
    except OSError:
        return
    if "nltk" not in text and "word_lists" not in text:
        return
    wanted = set(re.findall(r"""['"](words|averaged_perceptron_tagger_eng)['"]""", text)) or {"words"}
    try:
        import nltk
    except ImportError:
        raise EnvError(f"TextArena game {game_id!r} needs nltk (pip install 'fastpo[textarena]')") from None
    missing = []
    for name in sorted(wanted):
        try:
            nltk.data.find(_NLTK_RESOURCE[name])
        except LookupError:
            missing.append(name)
    if missing:
        raise EnvError(f"TextArena game {game_id!r} needs NLTK data {missing} that is not installed, and fastpo does "
                       f"not download it: install it first (python -m nltk.downloader {' '.join(missing)})")


def bracketed(answer: str) -> str:
    """The answer in TextArena's move format: as it is when it holds a "[...]", else "[answer]"."""
    a = answer.strip()
    return a if re.search(r"\[[^\[\]]*\]", a) else f"[{a}]"


class TextArenaEnv:
    """One TextArena single-player game (free-text answers; `fastpo.envs.interface`).

    Args:
        game_id: a TextArena id, e.g. "GuessTheNumber-v0" (its "-raw" version is made).
        **game_options: keyword arguments of the game's constructor (e.g. max_number).
    Raises EnvError for an unknown game, missing NLTK data, an option the game does not take,
    or a game that is not single-player.
    """

    action_names = None
    settings = {"max_actions_per_turn": 1}

    def __init__(self, game_id: str, **game_options):
        import textarena as ta

        check_game_id(game_id)
        self.game_id = game_id
        raw = game_id if game_id.endswith("-raw") else game_id + "-raw"
        spec = _registry()[raw]
        cls = spec.entry_point
        if isinstance(cls, str):
            mod, name = cls.split(":")
            cls = getattr(importlib.import_module(mod), name)
        takes = [k for k in inspect.signature(cls.__init__).parameters if k != "self"]
        unknown = [k for k in game_options if k not in takes]
        if unknown:
            raise EnvError(f"TextArena game {game_id!r} takes no option(s) {unknown}; its options: {takes}")
        self._env = ta.make(raw, **game_options)
        self.instructions = ""

    def _messages(self) -> tuple:
        """(rules, observation text) of the messages since the last call."""
        _, msgs = self._env.get_observation()
        import textarena as ta

        rules = [m for _, m, kind in msgs if kind == ta.ObservationType.PROMPT]
        rest = [m for _, m, kind in msgs if kind not in (ta.ObservationType.PROMPT, ta.ObservationType.PLAYER_ACTION)]
        return "\n".join(rules), "\n".join(rest).strip()

    def reset(self, seed: int) -> str:
        """Start the game from `seed`; the first observation (the rules go to `instructions`)."""
        try:
            self._env.reset(num_players=1, seed=int(seed))
        except AssertionError as e:
            raise EnvError(f"TextArena game {self.game_id!r} is not a single-player game ({e})") from None
        rules, obs = self._messages()
        self.instructions = (rules + "\nPut your move inside <answer></answer>, in square brackets or without "
                             "them (they are added), e.g. <answer>[5]</answer>.") if rules else ""
        return obs or "The game has started. Make your first move."

    def step(self, answer: str):
        """Play one answer; (observation, reward, done, info) with the reward from close()."""
        done, _ = self._env.step(bracketed(answer))
        _, obs = self._messages()
        state = self._env.state
        valid = getattr(state, "error_count", 0) == 0
        reward, info = 0.0, {}
        if done:
            rewards, game_info = self._env.close()
            reward = float((rewards or {}).get(0, 0.0))
            if (game_info or {}).get(0, {}).get("invalid_move"):
                valid = False
            info["reason"] = (game_info or {}).get(0, {}).get("reason", "")
        info.update(success=bool(done and reward >= 1.0), valid=bool(valid))
        return obs, reward, bool(done), info
