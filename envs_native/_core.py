"""Pieces shared by the batched environments: per-instance RNG, answer parsing, text
rendering, the result records and the base class with the public batched API.

Design notes (why it looks like this):
- Every instance owns a 64-bit SplitMix64 state derived from its seed only, so the
  instance reset from seed s is identical whatever the batch size, its position in the
  batch, or PYTHONHASHSEED.
- Parsing and rendering run inside Numba too. Answers go in as one UCS-4 code point array
  (``np.array(answers)`` is one C call) and rendered grids come out as one code point array
  that NumPy views as B strings, so a whole turn costs a handful of Python calls.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import numpy as np
from numba import njit

# ---------------------------------------------------------------------------------------
# Random numbers: SplitMix64 (Steele, Lea, Flood 2014), one uint64 state per instance.
# ---------------------------------------------------------------------------------------
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53


@njit(cache=True)
def mix64(z):
    """SplitMix64's output function: a bijection on uint64 with full avalanche (every input
    bit flips each output bit with probability about 1/2)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True)
def rng_next(state, i):
    """Advance state[i] (uint64 array) and return the next 64-bit output (uint64)."""
    state[i] = state[i] + _GOLDEN
    return mix64(state[i])


@njit(cache=True)
def rng_uniform(state, i):
    """A float64 uniform in [0, 1) from instance i's stream (53 random bits)."""
    return np.float64(rng_next(state, i) >> _S11) * _INV53


@njit(cache=True)
def rng_below(state, i, n):
    """An int64 uniform in [0, n) from instance i's stream (n >= 1; bias < 2**-40 for n < 2**13)."""
    return np.int64((rng_next(state, i) >> _S11) % np.uint64(n))


@njit(cache=True)
def rng_seed_all(seeds, salt, out):
    """out[b] = mix64(seeds[b] * GOLDEN + mix64(salt)); seeds, out: uint64 [B].

    The starting states of nearby seeds are thus SplitMix64 outputs for consecutive
    counter values, i.e. independent-looking 64-bit numbers rather than neighbours on one
    stream (a plain ``seed * GOLDEN + salt`` state would make seed s+1's stream seed s's
    shifted by one draw). Distinct seeds get distinct states (each step is a bijection);
    two streams of n draws overlap with probability about 2n / 2**64. The salt separates
    the environments, so one seed gives unrelated streams in FrozenLake and Sokoban.
    """
    base = mix64(np.uint64(salt))
    for b in range(seeds.shape[0]):
        out[b] = mix64(seeds[b] * _GOLDEN + base)


def _is_real(v) -> bool:
    """A real number (Python or NumPy), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def seeds_to_array(seeds, batch_size: int) -> np.ndarray:
    """Validate seeds (B integers in [0, 2**64)) and return them as uint64 [B].

    Raises TypeError for non-integer seeds, ValueError for a wrong count or a seed outside
    [0, 2**64), naming the bad seed.
    """
    arr = np.asarray(seeds)
    if arr.dtype.kind not in "iu" and arr.ndim == 1 and (arr.dtype == object or not isinstance(seeds, np.ndarray)):
        # Python ints of 2**63 or more make NumPy choose object or float64: check the values
        vals = arr.tolist() if arr.dtype == object else list(seeds)
        for s in vals:
            if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
                raise TypeError(f"seeds must be integers, got {s!r} in {seeds!r:.80}")
        for s in vals:
            if not 0 <= s < 2**64:
                raise ValueError(f"seeds must be non-negative integers below 2**64, got {s}")
        arr = np.array(vals, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"seeds must be integers, got dtype {arr.dtype} ({seeds!r:.80})")
    if arr.shape != (batch_size,):
        raise ValueError(f"expected {batch_size} seeds (one per instance), got shape {arr.shape}")
    if arr.dtype.kind == "i" and (arr < 0).any():
        raise ValueError(f"seeds must be non-negative integers below 2**64, got {int(arr.min())}")
    return arr.astype(np.uint64)


def seed_list(seeds) -> np.ndarray:
    """Seeds of any count (a non-empty list, tuple, range or 1-D integer array of values in
    [0, 2**64)) as uint64 [n]: what the success bounds (`optimal_success`,
    `random_success`) take.

    Raises TypeError naming the type for anything else (an int, a string, a set, a
    generator ...) or for non-integer values, ValueError for an empty one or a value
    outside [0, 2**64).
    """
    if hasattr(seeds, "tolist") and not isinstance(seeds, np.ndarray):  # e.g. a torch tensor
        seeds = seeds.tolist()
    if not isinstance(seeds, (list, tuple, range, np.ndarray)) or (isinstance(seeds, np.ndarray) and seeds.ndim != 1):
        raise TypeError(f"seeds must be a list, range or 1-D array of non-negative integers, got "
                        f"{type(seeds).__name__} {seeds!r:.80}")
    if len(seeds) == 0:
        raise ValueError("seeds is empty: give at least one seed")
    return seeds_to_array(seeds, len(seeds))


def check_horizon(horizon) -> int:
    """`horizon` (a number of actions) as an int; ValueError naming it unless an integer >= 1."""
    if isinstance(horizon, (bool, np.bool_)) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
        raise ValueError(f"horizon must be an integer >= 1 (a number of actions), got {horizon!r}")
    return int(horizon)


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class ParsedActions:
    """Actions parsed from the answer texts of one turn.

    actions: np.int64 [B, max_actions], action ids in order, padded with -1.
    num_actions: np.int64 [B], number of recognised actions.
    invalid: list of B tuples of str, the unrecognised pieces (stripped) per instance, in
        answer order (the empty tuple for an instance without any).
    all_valid: np.bool_ [B], True iff at least one action and no invalid piece
        (the format check behind RAGEN's per-turn format penalty).
    """

    actions: np.ndarray
    num_actions: np.ndarray
    invalid: list
    all_valid: np.ndarray


@dataclasses.dataclass
class StepResult:
    """What one turn did to each instance.

    reward: np.float32 [B], summed over the turn's executed actions.
    done: np.bool_ [B], episode over (after this turn).
    success: np.bool_ [B], episode solved.
    num_executed: np.int32 [B], actions executed this turn.
    valid: np.bool_ [B, A], action j was a legal id for instance b and was reached.
    effective: np.bool_ [B, A], action j changed the state.
    """

    reward: np.ndarray
    done: np.ndarray
    success: np.ndarray
    num_executed: np.ndarray
    valid: np.ndarray
    effective: np.ndarray


# ---------------------------------------------------------------------------------------
# Parsing: "Up || left||RIGHT" -> action ids, case-insensitive (ASCII), cut to max_actions.
# ---------------------------------------------------------------------------------------
# Every code point for which Python's str.isspace() is True (what str.strip() removes);
# tests/unit/envs/test_envs_parse.py checks this list against Python.
WHITESPACE = tuple([9, 10, 11, 12, 13, 28, 29, 30, 31, 32, 0x85, 0xA0, 0x1680] + list(range(0x2000, 0x200B))
                   + [0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


@njit(cache=True, inline="always")
def _is_space(c):
    if c <= 32:
        return (9 <= c <= 13) or (28 <= c <= 32)
    if c < 0x85:
        return False
    return (c == 0x85 or c == 0xA0 or c == 0x1680 or (0x2000 <= c <= 0x200A) or c == 0x2028
            or c == 0x2029 or c == 0x202F or c == 0x205F or c == 0x3000)


_S29 = np.uint64(29)


@njit(cache=True, inline="always")
def _lower(c):
    """ASCII upper case to lower case (int64 code point); other code points unchanged."""
    c = np.int64(c)
    return c + 32 if 65 <= c <= 90 else c


@njit(cache=True, inline="always")
def _name_key(length, first, last):
    """Hash-table key (uint64) of a name from its length and lower-cased first and last
    code points: O(1) per piece, collisions are resolved by comparing the whole name."""
    h = np.uint64(length) * _GOLDEN ^ np.uint64(first) * _M1 ^ np.uint64(last) * _M2  # SplitMix64's odd constants
    return h ^ (h >> _S29)


@njit(cache=True)
def _build_name_slots(name_codes, name_lens, slots):
    """Open-addressing hash table: slots (int64 [S], S a power of two > N, filled with -1)
    gets each name index k at the first free slot from its `_name_key` & (S - 1)."""
    mask = slots.shape[0] - 1
    for k in range(name_codes.shape[0]):
        ln = name_lens[k]
        i = np.int64(_name_key(ln, name_codes[k, 0], name_codes[k, ln - 1]) & np.uint64(mask))
        while slots[i] >= 0:
            i = (i + 1) & mask
        slots[i] = k


@njit(cache=True)
def _parse_kernel(text, lengths, slots, name_codes, name_lens, name_action, actions, num_actions, all_valid, spans):
    """Split each answer on '||', strip, match names (ASCII case-insensitive).

    text: uint8 (all ASCII) or uint32 [T] code points of all answers, each followed by one
    separator code point; lengths: int64 [B] code points per answer, or empty when no
    answer holds a NUL (then each answer ends at the next NUL). slots: int64 [S] the
    names' hash table (`_build_name_slots`); name_codes: uint32 [N, K] lower-case names;
    name_lens: int64 [N]; name_action: int64 [B, N] action id of name n for instance b
    (-1: not an action of b). Fills actions int64 [B, M] (-1 padded), num_actions int64
    [B], all_valid bool [B] and spans int64 [B * M, 3], one row (instance, start, end)
    per invalid piece, start and end relative to the instance's answer. Returns the number
    of invalid pieces.
    """
    B = actions.shape[0]
    M = actions.shape[1]
    T = text.shape[0]
    mask = slots.shape[0] - 1
    known = lengths.shape[0] == B
    o = 0
    n_spans = 0
    for b in range(B):
        n = lengths[b] if known else T - o  # without lengths the answer ends at the next NUL
        pieces = 0
        na = 0
        ni = 0
        s = 0
        while True:
            # the piece ends at the next "||" or at the end of the answer
            e = s
            while e < n:
                c = text[o + e]
                if c == 124:
                    if e + 1 < n and text[o + e + 1] == 124:
                        break
                elif c == 0 and not known:
                    n = e
                    break
                e += 1
            a = s
            z = e
            while a < z and _is_space(text[o + a]):
                a += 1
            while z > a and _is_space(text[o + z - 1]):
                z -= 1
            if z > a:
                pieces += 1
                found = -1
                ln = z - a
                i = np.int64(_name_key(ln, _lower(text[o + a]), _lower(text[o + z - 1])) & np.uint64(mask))
                while slots[i] >= 0:
                    k = slots[i]
                    if name_lens[k] == ln:
                        j = 0
                        while j < ln and _lower(text[o + a + j]) == name_codes[k, j]:
                            j += 1
                        if j == ln:
                            found = name_action[b, k]
                            break
                    i = (i + 1) & mask
                if found >= 0:
                    actions[b, na] = found
                    na += 1
                else:
                    spans[n_spans, 0] = b
                    spans[n_spans, 1] = a
                    spans[n_spans, 2] = z
                    n_spans += 1
                    ni += 1
            if e >= n or pieces == M:
                break
            s = e + 2
        if not known and e < n:  # stopped at max_actions: find this answer's end
            while o + e < T and text[o + e] != 0:
                e += 1
            n = e
        for j in range(na, M):
            actions[b, j] = -1
        num_actions[b] = na
        all_valid[b] = na > 0 and ni == 0
        o += n + 1
    return n_spans


class NameTable:
    """All action names of an environment, lower-cased, with a hash table for the parser.

    names: the distinct action names (ASCII, no '||', no surrounding whitespace).
    Raises ValueError naming a bad or repeated name.
    """

    def __init__(self, names: Sequence[str]):
        for n in names:
            if not isinstance(n, str) or not n or not n.isascii() or "||" in n or n != n.strip():
                raise ValueError(f"action name {n!r} must be non-empty ASCII without '||' or surrounding spaces")
        lowered = [n.lower() for n in names]
        if len(set(lowered)) != len(lowered):
            raise ValueError(f"action names must be distinct ignoring case, got {list(names)}")
        self.names = list(names)
        self.index = {n: i for i, n in enumerate(lowered)}
        width = max(len(n) for n in lowered)
        self.codes = np.zeros((len(lowered), width), dtype=np.uint32)
        for i, n in enumerate(lowered):
            self.codes[i, : len(n)] = [ord(c) for c in n]
        self.lens = np.array([len(n) for n in lowered], dtype=np.int64)
        # at most half full, so that a lookup probes about one slot
        self.slots = np.full(max(8, 1 << (2 * len(lowered) - 1).bit_length()), -1, dtype=np.int64)
        _build_name_slots(self.codes, self.lens, self.slots)


_NO_LENGTHS = np.zeros(0, dtype=np.int64)


def parse_answers(answers: Sequence[str], max_actions: int, table: NameTable, name_action: np.ndarray) -> ParsedActions:
    """Parse B answer texts (the text inside <answer>...</answer>) into action ids.

    answers: B strings (None or non-strings count as empty answers); max_actions >= 1.
    table/name_action: the env's names and int64 [B, N] per-instance id map.
    Never raises on any text. Raises ValueError for a max_actions that is not a positive
    integer or a number of answers other than B.
    """
    B = name_action.shape[0]
    if type(max_actions) is not int and (isinstance(max_actions, bool) or not isinstance(max_actions, np.integer)) \
            or max_actions < 1:
        raise ValueError(f"max_actions must be a positive integer, got {max_actions!r}")
    if isinstance(answers, str) or len(answers) != B:
        raise ValueError(f"expected {B} answers (one per instance), got {answers!r:.80}")
    try:
        joined = "\x00".join(answers)  # one C call; raises TypeError on a non-str answer
    except TypeError:
        answers = [a if isinstance(a, str) else "" for a in answers]
        joined = "\x00".join(answers)
    # answers without NUL characters: the kernel finds the boundaries itself
    lengths = np.fromiter(map(len, answers), np.int64, B) if joined.count("\x00") != B - 1 else _NO_LENGTHS
    # every answer's code points, NUL-separated (the separators are never read): one byte
    # each for ASCII text (isascii is a flag check, the encode a copy), else UTF-32, where
    # surrogatepass keeps lone surrogates as code points that simply match no name
    if joined.isascii():
        text = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
    else:
        text = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        text = text.astype(np.uint32, copy=False)  # no copy on little-endian machines
    M = int(max_actions)
    actions = np.empty((B, M), dtype=np.int64)
    num_actions = np.empty(B, dtype=np.int64)
    all_valid = np.empty(B, dtype=np.bool_)
    spans = np.empty((B * M, 3), dtype=np.int64)
    n_spans = _parse_kernel(text, lengths, table.slots, table.codes, table.lens, name_action, actions, num_actions,
                            all_valid, spans)
    # tuples: one shared empty tuple for the usual instance without invalid pieces
    # (B fresh lists cost more than the kernel's whole parse)
    invalid = [()] * B
    if n_spans:
        # plain ints: indexing NumPy scalars one by one costs more than the parse itself
        for b, a, z in spans[:n_spans].tolist():
            invalid[b] += (answers[b][a:z],)
    return ParsedActions(actions, num_actions, invalid, all_valid)


# ---------------------------------------------------------------------------------------
# Rendering: code point arrays -> B Python strings in one NumPy view.
# ---------------------------------------------------------------------------------------
def codes_to_strings(codes: np.ndarray) -> list[str]:
    """uint32 [B, L] code points (0-padded at the end) -> B str (trailing NULs dropped)."""
    B, L = codes.shape
    if L == 0:
        return [""] * B
    return np.ascontiguousarray(codes).view(np.dtype(("U", L))).reshape(B).tolist()


# Observation formats of the grid games (the `observation` config key):
#   grid          the paper's rendering, cells run together ("#_P_#"): a BPE tokenizer merges runs
#                 such as "____", "OO", "GP" into single tokens, so a cell's column is only known by
#                 counting characters inside tokens of varying width;
#   cells         one token per cell: cells separated by spaces ("# _ P _ #"), and a one-token
#                 symbol in place of the default "√" (two byte-level tokens);
#   coords        the grid plus lines naming each object's (row, column), as RAGEN's later
#                 CoordSokoban / CoordFrozenLake observations;
#   cells+coords  both.
OBSERVATIONS = ("grid", "cells", "coords", "cells+coords")
# "√" (box on target, player on goal) is two byte-level tokens for GPT-2-style tokenizers
# (SmolLM2's included); the per-cell formats default to "*" (XSB's box on target) instead, or
# the next of these that no other symbol uses.
CELL_FORMAT_SYMBOLS = ("*", "+", "&", "%", "$")


def check_observation(observation) -> str:
    """The observation format name, checked: one of OBSERVATIONS. Raises ValueError naming a bad one."""
    if not isinstance(observation, str) or observation not in OBSERVATIONS:
        raise ValueError(f"observation must be one of {OBSERVATIONS}, got {observation!r}")
    return observation


def format_symbols(defaults: dict, overrides: dict | None, observation: str) -> dict:
    """`symbol_table(defaults, overrides)` for an observation format: in the per-cell formats a
    default symbol "√" that the user did not override becomes the first of CELL_FORMAT_SYMBOLS
    ("*") that no other symbol uses, so that every cell is one token. Raises what symbol_table
    raises, and ValueError for a blank symbol in a per-cell format (cells are told apart by
    the spaces between them)."""
    sym = symbol_table(defaults, overrides)
    if "cells" not in observation:
        return sym
    for k, v in sym.items():
        if not v.strip():
            raise ValueError(f"symbol for {k!r} is {v!r}: a blank symbol cannot be told from the spaces between cells "
                             f"in observation={observation!r}")
    for k, v in sym.items():
        if v == "√" and k not in (overrides or {}):
            sym[k] = next(c for c in CELL_FORMAT_SYMBOLS if c not in sym.values())
    return sym


def observation_note(observation: str) -> str:
    """The line(s) the instructions add for an observation format ("" for the paper's grid)."""
    note = ""
    if "cells" in observation:
        note += "In the grid, cells are separated by spaces.\n"
    if "coords" in observation:
        note += "Below the grid, positions are (row, column), counted from (0, 0) at the top left.\n"
    return note


def spaced_cells(grid: str) -> str:
    """A run-together grid text with its cells separated by single spaces, row by row."""
    return "\n".join(" ".join(row) for row in grid.split("\n"))


def cell_list(cells) -> str:
    """"(r, c)" pairs joined by "; ": the coordinate lines' notation for several cells."""
    return "; ".join(f"({r}, {c})" for r, c in cells)


def symbol_table(defaults: dict, overrides: dict | None) -> dict:
    """Merge symbol overrides into defaults; each symbol must be one printable character.

    Raises ValueError naming an unknown key, a bad symbol (not one character, or a control
    character such as NUL or newline, which would break the grid text) or two keys given
    the same symbol (the text could no longer be read back).
    """
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"symbols must be a dict of symbol key -> character, got {overrides!r}")
    sym = dict(defaults)
    for k, v in (overrides or {}).items():
        if k not in defaults:
            raise ValueError(f"unknown symbol key {k!r}; known: {sorted(defaults)}")
        if not isinstance(v, str) or len(v) != 1 or not v.isprintable():
            raise ValueError(f"symbol for {k!r} must be one printable character (no control character), got {v!r}")
        sym[k] = v
    seen = {}
    for k, v in sym.items():
        if v in seen:
            raise ValueError(f"symbols {seen[v]!r} and {k!r} are both {v!r}; each must be distinct")
        seen[v] = k
    return sym


# ---------------------------------------------------------------------------------------
# Base class
# ---------------------------------------------------------------------------------------
class BatchedTextEnv:
    """B instances of a text game stepped together. Subclasses fill the state arrays.

    Public API (all environments): reset(seeds), render(), instructions(),
    action_names(i), parse_actions(answers, max_actions), step(actions, active),
    and the arrays done, success, truncated (np.bool_ [B]).

    Errors: reset raises TypeError for non-integer seeds and ValueError for a wrong count
    or a seed outside [0, 2**64) (and RuntimeError where an instance cannot be built);
    render, parse_actions and step raise RuntimeError before the first reset (so do
    Bandit's instructions and action_names, whose arm names come from the reset).
    """

    name = "base"
    actions: tuple = ()  # action names in id order, where every instance has the same
    #: The expert's moves per answer when the SFT data asks for the game's own count
    #: (`sft.actions_per_turn=0`); None: the rollout's per-turn cap.
    expert_moves_per_turn: int | None = None

    def __init__(self, batch_size: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self._B = int(batch_size)
        self.done = np.ones(self._B, dtype=np.bool_)
        self.success = np.zeros(self._B, dtype=np.bool_)
        self.truncated = np.zeros(self._B, dtype=np.bool_)
        self._all_active = np.ones(self._B, dtype=np.bool_)  # read-only use by the step kernels
        self._was_reset = False

    @property
    def batch_size(self) -> int:
        """Number of instances B."""
        return self._B

    # -- subclasses implement these -----------------------------------------------------
    def _reset_kernel(self, seeds: np.ndarray) -> None:  # pragma: no cover - abstract
        """Draw every instance's start state from `seeds` (uint64 [B], checked)."""
        raise NotImplementedError

    def render(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def instructions(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def action_names(self, i: int) -> list[str]:
        """Action names of instance i, in id order (`actions`, the same for every instance,
        unless a subclass names them per instance). Raises ValueError for an index outside [0, B)."""
        self._check_index(i)
        return list(self.actions)

    def _step_kernel(self, actions, active, out) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # A game with an expert defines `expert(i, actions_left) -> list[str]`: the moves (action
    # names) a good player plays from instance i's current state with `actions_left` actions
    # left, in order, as far as it commits to them ([] where it has none); the SFT data and
    # DAgger's labels come from it (fastpo.sft).

    # -- shared -------------------------------------------------------------------------
    def has_expert(self) -> bool:
        """Whether the game defines `expert(i, actions_left)`."""
        return callable(getattr(self, "expert", None))

    def expert_answers(self, indices: Sequence[int], actions_left) -> list:
        """The expert's moves (a list of action names each, `expert`) in the current states of
        instances `indices`; actions_left: int [B], each instance's actions left. Raises
        AttributeError for a game without an expert, RuntimeError before the first reset."""
        self._require_reset()
        return [self.expert(int(b), int(actions_left[b])) for b in indices]

    def reset(self, seeds) -> list[str]:
        """Reset all B instances from B non-negative integer seeds; returns the B observation
        texts (`render()`). The start states come from the subclass's `_reset_kernel`.

        Raises TypeError for seeds that are not integers, ValueError for a count other than
        B, a negative seed or one of 2**64 or more, and what `_reset_kernel` raises
        (RuntimeError naming the seed where no instance can be built).
        """
        self._reset_kernel(seeds_to_array(seeds, self._B))
        self.done[:] = False
        self.success[:] = False
        self.truncated[:] = False
        self._was_reset = True
        return self.render()

    def _name_table(self) -> tuple[NameTable, np.ndarray]:
        """(the action-name table, name id -> action id per instance [B, names]) for parsing."""
        return self._table, self._name_action

    def _grid_texts(self, fill) -> list[str]:
        """The B observations: `fill(buf)` writes the grids' code points into a uint32
        [B, R * (C + 1) - 1] buffer (rows of self.size, newline-separated), kept between calls;
        the `observation` format (OBSERVATIONS; "grid" when a subclass sets none) spaces the
        cells and appends `_coordinate_lines`."""
        self._require_reset()
        if getattr(self, "_render_buf", None) is None:
            R, C = self.size
            self._render_buf = np.zeros((self._B, R * (C + 1) - 1), dtype=np.uint32)
        fill(self._render_buf)
        texts = codes_to_strings(self._render_buf)
        observation = getattr(self, "observation", "grid")
        if "cells" in observation:
            texts = [spaced_cells(t) for t in texts]
        if "coords" in observation:
            texts = [f"{t}\n{self._coordinate_lines(b)}" for b, t in enumerate(texts)]
        return texts

    def _coordinate_lines(self, b: int) -> str:  # pragma: no cover - abstract
        """The "coords" observation's lines for instance b: where each object is, as (row, column)."""
        raise NotImplementedError

    def _check_index(self, i) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self._B:
            raise ValueError(f"instance index must be in [0, {self._B}), got {i!r}")
        return int(i)

    def _require_reset(self) -> None:
        if not self._was_reset:
            raise RuntimeError(f"{self.name}: call reset(seeds) before this")

    def parse_actions(self, answers: Sequence[str], max_actions: int) -> ParsedActions:
        """Parse the B answer texts of one turn; see `ParsedActions`.

        Action names are matched ASCII case-insensitively after stripping whitespace;
        pieces are separated by '||'; empty pieces are skipped; only the first
        `max_actions` non-empty pieces are looked at. Never raises on any answer text.
        Raises RuntimeError before the first reset, ValueError for a max_actions that is
        not a positive integer or a number of answers other than B.
        """
        self._require_reset()
        table, name_action = self._name_table()
        return parse_answers(answers, max_actions, table, name_action)

    def step(self, actions, active=None) -> StepResult:
        """Apply one turn: each instance's actions in order, stopping at the episode's end.

        actions: integer array [B, A] of action ids, -1 = no action (padding); a 1-D [B]
        array is one action each. Ids outside the instance's action range are skipped and
        reported as not valid.
        active: optional bool [B]; inactive or already-done instances are not stepped
        (reward 0, nothing changes). Returns a `StepResult`.
        Raises ValueError for a wrong shape, TypeError for a non-integer array, RuntimeError
        before the first reset.
        """
        self._require_reset()
        acts = np.asarray(actions)
        if acts.dtype.kind not in "iu":
            raise TypeError(f"actions must be an integer array, got dtype {acts.dtype}")
        if acts.ndim == 1:
            acts = acts[:, None]
        if acts.ndim != 2 or acts.shape[0] != self._B:
            raise ValueError(f"actions must have shape [{self._B}, A], got {np.shape(actions)}")
        acts = np.ascontiguousarray(acts, dtype=np.int64)
        if active is None:
            act = self._all_active
        else:
            act = np.asarray(active)
            if act.shape != (self._B,):
                raise ValueError(f"active must have shape [{self._B}], got {act.shape}")
            act = np.ascontiguousarray(act, dtype=np.bool_)
        A = acts.shape[1]
        out = StepResult(
            reward=np.zeros(self._B, dtype=np.float32),
            done=self.done,
            success=self.success,
            num_executed=np.zeros(self._B, dtype=np.int32),
            valid=np.zeros((self._B, A), dtype=np.bool_),
            effective=np.zeros((self._B, A), dtype=np.bool_),
        )
        self._step_kernel(acts, act, out)
        out.done = self.done.copy()
        out.success = self.success.copy()
        return out
