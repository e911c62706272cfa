"""Batched FrozenLake (RAGEN's multi-turn stochastic grid game), compiled with Numba.

Dynamics follow gymnasium's ``FrozenLake-v1``: actions Left=0, Down=1, Right=2, Up=3;
on slippery ice the agent moves in the intended direction with probability
``success_prob`` (1/3 by default, as gymnasium and RAGEN at the paper's commit) and in each
perpendicular direction with probability (1 - success_prob) / 2; moves off the grid leave
it in place. Reward 1 on reaching the goal; the episode ends in a hole or on the goal, or
after ``max_steps``.

Random maps (``layout="ragen"``, the default) follow RAGEN's ``generate_random_map``
(ragen/env/frozen_lake/utils.py at commit 540ab84): every cell is frozen with probability
p (else a hole), then a start cell and a goal cell are drawn uniformly (row and column
each), overwriting what was there; the whole draw is repeated while start == goal or no
4-connected path over non-hole cells joins them. ``layout="gymnasium"`` is gymnasium's
rule instead: start top-left, goal bottom-right. Both draw from the instance's own seeded
stream, so the maps do not match RAGEN's or gymnasium's for the same seed, only their
distribution.

`optimal_success` and `random_success` give, per seed, the success probability of the
best policy and of the uniformly random policy within a number of actions, exactly (value
iteration over the finite horizon): a learning curve's ceiling and floor.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._core import (BatchedTextEnv, NameTable, _is_real, cell_list, check_horizon, check_observation, format_symbols,
                    observation_note, rng_below, rng_seed_all, rng_uniform, seed_list)

ACTIONS = ("Left", "Down", "Right", "Up")
DEFAULT_SYMBOLS = {"player": "P", "frozen": "_", "hole": "O", "goal": "G", "player_in_hole": "X",
                   "player_on_goal": "√"}
# gymnasium's named maps
MAPS = {
    "4x4": ["SFFF", "FHFH", "FFFH", "HFFG"],
    "8x8": ["SFFFFFFF", "FFFFFFFF", "FFFHFFFF", "FFFFFHFF", "FFFHFFFF", "FHHFFFHF", "FHFFHFHF", "FFFHFFFG"],
}
_FROZEN, _HOLE, _GOAL = 0, 1, 2
# Worth of a step in the expert's tie-break between equally likely successes (a shorter
# route scores higher); any value in (0, 1) would do.
_TIE_DISCOUNT = 0.9
_SALT = 0xF20
_MAX_MAP_TRIES = 100_000
LAYOUTS = ("ragen", "gymnasium")


@njit(cache=True)
def _has_path(grid, start, queue, seen):
    """Breadth-first search over non-hole cells from start to any goal (grid int8 [R, C])."""
    R, C = grid.shape
    seen[:] = False
    head = 0
    tail = 1
    queue[0] = start
    seen[start] = True
    while head < tail:
        s = queue[head]
        head += 1
        r = s // C
        c = s % C
        if grid[r, c] == _GOAL:
            return True
        for d in range(4):
            rr = r + (d == 1) - (d == 3)
            cc = c + (d == 2) - (d == 0)
            if 0 <= rr < R and 0 <= cc < C:
                t = rr * C + cc
                if not seen[t] and grid[rr, cc] != _HOLE:
                    seen[t] = True
                    queue[tail] = t
                    tail += 1
    return False


@njit(cache=True)
def _fl_reset(seeds, p, fixed, fixed_start, ragen, maps, pos, start, rng, steps):
    """Reset every instance: seed its stream, draw (or copy) its map, place the player.

    seeds uint64 [B]; fixed int8 [R, C] (used when fixed_start >= 0); ragen: random start
    and goal cells (RAGEN) rather than the corners (gymnasium); maps int8 [B, R, C];
    pos/start/steps int64 [B]; rng uint64 [B]. Returns -1, or the index of an instance for
    which no solvable map was found.
    """
    B, R, C = maps.shape
    rng_seed_all(seeds, _SALT, rng)
    queue = np.empty(R * C, dtype=np.int64)
    seen = np.empty(R * C, dtype=np.bool_)
    for b in range(B):
        steps[b] = 0
        if fixed_start >= 0:
            maps[b] = fixed
            pos[b] = fixed_start
            start[b] = fixed_start
            continue
        ok = False
        s = 0
        for _ in range(_MAX_MAP_TRIES):
            for r in range(R):
                for c in range(C):
                    maps[b, r, c] = _FROZEN if rng_uniform(rng, b) < p else _HOLE
            if ragen:
                # as RAGEN: board first, then start (row, col), then goal (row, col); a start
                # equal to the goal redraws everything
                s = rng_below(rng, b, R) * C + rng_below(rng, b, C)
                g = rng_below(rng, b, R) * C + rng_below(rng, b, C)
                if s == g:
                    continue
            else:
                s = 0
                g = R * C - 1
            maps[b, s // C, s % C] = _FROZEN
            maps[b, g // C, g % C] = _GOAL
            if _has_path(maps[b], s, queue, seen):
                ok = True
                break
        if not ok:
            return b
        pos[b] = s
        start[b] = s
    return -1


@njit(cache=True)
def _fl_success_values(maps, start, slippery, p_intended, horizon, greedy, out, policy, pi):
    """out[b] (float64 [B]): the probability of reaching a goal from start[b] (int64 [B])
    within `horizon` actions, for the best policy (greedy), the uniformly random one, or the
    given stochastic one.

    Finite-horizon value iteration: V_0 = 0; V_k(s) = max (or mean, or the pi-weighted sum)
    over actions of sum_s' P(s' | s, a) * (1 if s' is a goal, 0 if a hole, else V_{k-1}(s')),
    with the transition probabilities of `_fl_step`; out[b] = V_horizon(start[b]).
    pi: float64 [B, horizon + 1, R * C, 4] (or an empty array: greedy decides), pi[b, k, s, a]
    the probability of action a in cell s with k actions left: policy evaluation.
    policy: int8 [B, horizon + 1, R * C] (or an empty array: not wanted): policy[b, k, s] is
    an action maximising the sum above with k actions left (row 0 stays 0); among actions
    within 1e-12 of the best, the one with the highest discounted success (the same sums with
    each step worth _TIE_DISCOUNT, the chosen actions' value carried as U_k), then the lowest
    id: without slip every action that still reaches the goal in time ties at 1, and the
    lowest id alone would bump into walls until the last moment instead of walking the
    shortest path. The values (out) do not depend on the tie-break.
    """
    want_policy = policy.shape[0] > 0
    given = pi.shape[0] > 0
    B, R, C = maps.shape
    n = R * C
    p_side = (1.0 - p_intended) / 2.0
    v = np.zeros(n)
    nv = np.zeros(n)
    u = np.zeros(n)  # discounted success of the chosen actions: the tie-break
    nu = np.zeros(n)
    qs = np.zeros(4)
    qus = np.zeros(4)
    for b in range(B):
        v[:] = 0.0
        u[:] = 0.0
        for k in range(1, horizon + 1):
            for s in range(n):
                r0 = s // C
                c0 = s % C
                if maps[b, r0, c0] != _FROZEN:
                    nv[s] = 0.0
                    nu[s] = 0.0
                    continue
                best = -1.0
                best_u = -1.0
                best_a = 0
                total = 0.0
                for a in range(4):
                    q = 0.0
                    qu = 0.0
                    for o in range(3 if slippery else 1):
                        if o == 0:
                            d = a
                            pr = p_intended if slippery else 1.0
                        elif o == 1:
                            d = (a + 3) % 4
                            pr = p_side
                        else:
                            d = (a + 1) % 4
                            pr = p_side
                        r = r0
                        c = c0
                        if d == 0:
                            c = max(c - 1, 0)
                        elif d == 1:
                            r = min(r + 1, R - 1)
                        elif d == 2:
                            c = min(c + 1, C - 1)
                        else:
                            r = max(r - 1, 0)
                        t = maps[b, r, c]
                        if t == _GOAL:
                            q += pr
                            qu += pr * _TIE_DISCOUNT
                        elif t == _FROZEN:
                            q += pr * v[r * C + c]
                            qu += pr * _TIE_DISCOUNT * u[r * C + c]
                    qs[a] = q
                    qus[a] = qu
                    best = max(best, q)
                    total += q
                for a in range(4):  # the fastest of the (near-)best actions; the lowest id on equal terms
                    if qs[a] >= best - 1e-12 and qus[a] > best_u:
                        best_u = qus[a]
                        best_a = a
                if given:
                    nv[s] = 0.0
                    for a in range(4):
                        nv[s] += pi[b, k, s, a] * qs[a]
                else:
                    nv[s] = best if greedy else total / 4.0
                nu[s] = best_u
                if want_policy:
                    policy[b, k, s] = best_a
            for s in range(n):
                v[s] = nv[s]
                u[s] = nu[s]
        out[b] = v[start[b]]


@njit(cache=True)
def _fl_step(maps, pos, rng, steps, done, success, truncated, actions, active, slippery, p_intended, max_steps,
             reward, num_exec, valid, effective):
    """One turn for every active, not-done instance (see module docstring for dynamics)."""
    B, R, C = maps.shape
    A = actions.shape[1]
    p_side = (1.0 - p_intended) / 2.0
    for b in range(B):
        if not active[b] or done[b]:
            continue
        for j in range(A):
            a = actions[b, j]
            if a < 0 or a > 3:
                continue
            valid[b, j] = True
            num_exec[b] += 1
            d = a
            if slippery:
                u = rng_uniform(rng, b)
                if u < p_intended:
                    d = a
                elif u < p_intended + p_side:
                    d = (a + 3) % 4
                else:
                    d = (a + 1) % 4
            r = pos[b] // C
            c = pos[b] % C
            if d == 0:
                c = max(c - 1, 0)
            elif d == 1:
                r = min(r + 1, R - 1)
            elif d == 2:
                c = min(c + 1, C - 1)
            else:
                r = max(r - 1, 0)
            new = r * C + c
            effective[b, j] = new != pos[b]
            pos[b] = new
            steps[b] += 1
            t = maps[b, r, c]
            if t == _GOAL:
                reward[b] += 1.0
                done[b] = True
                success[b] = True
            elif t == _HOLE:
                done[b] = True
            elif max_steps > 0 and steps[b] >= max_steps:
                done[b] = True
                truncated[b] = True
            if done[b]:
                break


@njit(cache=True)
def _fl_render(maps, pos, sym, out):
    """Write each grid as code points into out uint32 [B, R*(C+1)-1].

    sym uint32 [6]: player, frozen, hole, goal, player_in_hole, player_on_goal.
    """
    B, R, C = maps.shape
    for b in range(B):
        k = 0
        for r in range(R):
            if r > 0:
                out[b, k] = 10
                k += 1
            for c in range(C):
                t = maps[b, r, c]
                if r * C + c == pos[b]:
                    out[b, k] = sym[0] if t == _FROZEN else (sym[4] if t == _HOLE else sym[5])
                else:
                    out[b, k] = sym[1] if t == _FROZEN else (sym[2] if t == _HOLE else sym[3])
                k += 1


def parse_map(desc) -> tuple[np.ndarray, int]:
    """Parse a gymnasium-notation map: a name ("4x4", "8x8"), a list of rows, or rows joined
    by "/" or newlines, with S start, F frozen, H hole, G goal.

    Returns (int8 [R, C] tiles, start cell index). Raises ValueError naming the bad row or
    character, a missing/duplicate start, a missing goal, an unknown map name such as
    "4X5", or a desc of another type (e.g. 5).
    """
    if isinstance(desc, str):
        if desc.lower() in MAPS:
            desc = desc.lower()
        rows = MAPS[desc] if desc in MAPS else [r for r in desc.replace("\n", "/").split("/") if r.strip()]
        if len(rows) == 1 and "x" in rows[0].lower():
            raise ValueError(f"unknown FrozenLake map name {desc!r}; known: {sorted(MAPS)}, or rows like 'SFFF/FHFH/...'")
    elif isinstance(desc, (list, tuple)) and all(isinstance(r, str) or (isinstance(r, (list, tuple)) and all(
            isinstance(ch, str) for ch in r)) for r in desc):
        rows = ["".join(r) if not isinstance(r, str) else r for r in desc]
    else:
        raise ValueError(f"desc must be a map name {sorted(MAPS)}, rows joined by '/' or newlines, or a list of "
                         f"row strings, got {desc!r:.100}")
    rows = [r.strip() for r in rows]
    if not rows or not rows[0]:
        raise ValueError(f"empty FrozenLake map {desc!r}")
    C = len(rows[0])
    grid = np.zeros((len(rows), C), dtype=np.int8)
    start = []
    goals = 0
    for i, row in enumerate(rows):
        if len(row) != C:
            raise ValueError(f"FrozenLake map row {i} {row!r} has length {len(row)}, expected {C}")
        for j, ch in enumerate(row.upper()):
            if ch == "S":
                start.append(i * C + j)
            elif ch == "H":
                grid[i, j] = _HOLE
            elif ch == "G":
                grid[i, j] = _GOAL
                goals += 1
            elif ch != "F":
                raise ValueError(f"FrozenLake map row {i}, column {j}: unknown tile {ch!r} (use S, F, H, G)")
    if len(start) != 1:
        raise ValueError(f"FrozenLake map needs exactly one start 'S', found {len(start)}")
    if goals == 0:
        raise ValueError("FrozenLake map needs at least one goal 'G'")
    return grid, start[0]


class FrozenLakeEnv(BatchedTextEnv):
    """B FrozenLake instances stepped together.

    Config: size (int >= 2, default 4), p (frozen probability in (0, 1], default 0.8),
    layout ("ragen", default: random distinct start and goal cells as RAGEN; "gymnasium":
    start top-left, goal bottom-right), is_slippery (default True), success_prob
    (probability of the intended direction when slippery, default 1/3 as gymnasium and RAGEN
    at the paper's commit; RAGEN's current head uses p=0.9, success_prob=0.8), desc (a
    fixed map in gymnasium notation; then size, p and layout are unused and every seed gives
    that map), max_steps (default 100, 0 = no cap; hitting it ends the episode as
    truncated), symbols (overrides of DEFAULT_SYMBOLS), observation (the text format, one of
    OBSERVATIONS in _core: "grid", the paper's run-together rows, default; "cells", one token
    per cell; "coords", the grid plus (row, column) lines; "cells+coords").
    Raises ValueError naming a bad config value.
    """

    name = "frozenlake"
    actions = ACTIONS  # Left, Down, Right, Up: gymnasium's ids
    # one move per answer: the ice decides where each move lands, so the model is shown every
    # cell the expert acts on
    expert_moves_per_turn = 1

    def __init__(self, batch_size: int, size: int = 4, p: float = 0.8, is_slippery: bool = True,
                 success_prob: float = 1.0 / 3.0, desc=None, max_steps: int = 100, symbols: dict | None = None,
                 layout: str = "ragen", observation: str = "grid"):
        super().__init__(batch_size)
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout = layout
        if desc is not None:
            self._fixed, self._fixed_start = parse_map(desc)
        else:
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
                raise ValueError(f"size must be an integer >= 2, got {size!r}")
            if not (_is_real(p) and 0.0 < p <= 1.0):
                raise ValueError(f"p (frozen probability) must be in (0, 1], got {p!r}")
            self._fixed, self._fixed_start = np.zeros((int(size), int(size)), dtype=np.int8), -1
        if not isinstance(is_slippery, (bool, np.bool_)):
            raise ValueError(f"is_slippery must be True or False, got {is_slippery!r}")
        if not (_is_real(success_prob) and 0.0 <= success_prob <= 1.0):
            raise ValueError(f"success_prob must be in [0, 1], got {success_prob!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps < 0:
            raise ValueError(f"max_steps must be an integer >= 0, got {max_steps!r}")
        self.size = self._fixed.shape
        self.p = float(p)
        self.is_slippery = bool(is_slippery)
        self.success_prob = float(success_prob)
        self.max_steps = int(max_steps)
        self.observation = check_observation(observation)
        self.symbols = format_symbols(DEFAULT_SYMBOLS, symbols, self.observation)
        self._sym = np.array([ord(self.symbols[k]) for k in DEFAULT_SYMBOLS], dtype=np.uint32)
        R, C = self.size
        B = self._B
        self._maps = np.zeros((B, R, C), dtype=np.int8)
        self._pos = np.zeros(B, dtype=np.int64)
        self._start = np.zeros(B, dtype=np.int64)
        self._rng = np.zeros(B, dtype=np.uint64)
        self._steps = np.zeros(B, dtype=np.int64)
        self._table = NameTable(ACTIONS)
        self._name_action = np.tile(np.arange(4, dtype=np.int64), (B, 1))
        self._render_buf = None  # allocated on first render
        self._expert_table = None  # optimal_policy of the current maps, for `expert`

    def _reset_kernel(self, s: np.ndarray) -> None:
        """Each instance's map from its seed (`reset` returns the grid texts). Raises
        RuntimeError naming the seed when no solvable map is found in 100,000 draws (only for
        tiny p on large maps)."""
        self._expert_table = None
        bad = self._draw(s, self._maps, self._pos, self._start, self._rng, self._steps)
        if bad >= 0:
            raise RuntimeError(f"no solvable {self.size} map found for seed {int(s[bad])} with p={self.p}")

    def _draw(self, s, maps, pos, start, rng, steps) -> int:
        return _fl_reset(s, self.p, self._fixed, self._fixed_start, self.layout == "ragen", maps, pos, start, rng, steps)

    def _success_values(self, seeds, horizon, greedy: bool) -> np.ndarray:
        s = seed_list(seeds)
        h = check_horizon(horizon)
        if self.max_steps > 0:
            h = min(h, self.max_steps)
        n = s.shape[0]
        R, C = self.size
        maps = np.zeros((n, R, C), dtype=np.int8)
        pos = np.zeros(n, dtype=np.int64)
        start = np.zeros(n, dtype=np.int64)
        bad = self._draw(s, maps, pos, start, np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.int64))
        if bad >= 0:
            raise RuntimeError(f"no solvable {self.size} map found for seed {int(s[bad])} with p={self.p}")
        out = np.zeros(n, dtype=np.float64)
        _fl_success_values(maps, start, self.is_slippery, self.success_prob, h, greedy, out,
                           np.zeros((0, 0, 0), dtype=np.int8), np.zeros((0, 0, 0, 0)))
        return out

    def optimal_policy(self, horizon: int) -> np.ndarray:
        """int8 [B, horizon + 1, R * C]: for each current instance, the best action id (0 Left,
        1 Down, 2 Right, 3 Up) in each cell (row * C + column) with k = 1..horizon actions left
        (row k), from the finite-horizon value iteration of `optimal_success` (ties: the faster
        route, then the lowest id, see `_fl_success_values`; row 0 and cells that are holes or
        goals hold 0). The closed-loop expert: acting with table[b, k, position] at every step,
        k the actions the episode has left, reaches the goal with `optimal_success`'s
        probability. The table does not apply max_steps: k must count it (the smaller of the
        horizon's and max_steps' actions left), or a cap below the horizon makes the expert fall
        short of that probability with slip. Raises ValueError for a horizon that is not an integer >= 1,
        RuntimeError before the first reset.
        """
        self._require_reset()
        h = check_horizon(horizon)
        B, (R, C) = self._B, self.size
        table = np.zeros((B, h + 1, R * C), dtype=np.int8)
        _fl_success_values(self._maps, self._start, self.is_slippery, self.success_prob, h, True,
                           np.zeros(B, dtype=np.float64), table, np.zeros((0, 0, 0, 0)))
        return table

    def policy_success(self, pi) -> np.ndarray:
        """float64 [B]: for each current instance, the exact probability that the stochastic
        policy `pi` reaches the goal from the instance's start within horizon = pi.shape[1] - 1
        actions: finite-horizon policy evaluation with the env's own slip probabilities,
        V_k(s) = sum_a pi[b, k, s, a] sum_s' P(s' | s, a) (1 if s' is the goal, V_{k-1}(s') if
        frozen, 0 in a hole).

        pi: array-like [B, horizon + 1, R * C, 4] of probabilities, pi[b, k, s, a] that of
        action a (0 Left, 1 Down, 2 Right, 3 Up) in cell s (row * C + column) with k actions
        left; row k = 0 is not read, and every row k >= 1 sums to 1. Like `optimal_policy`,
        max_steps is not applied: for the current instances' seeds and a horizon within
        max_steps, the uniform policy gives `random_success` and the one-hot `optimal_policy`
        table `optimal_success` (to float rounding). Raises ValueError for a wrong shape,
        horizon < 1, a negative or non-finite entry or a row not summing to 1 (naming the
        first such entry); RuntimeError before the first reset.
        """
        self._require_reset()
        B, (R, C) = self._B, self.size
        p = np.array(pi, dtype=np.float64)  # a writable C-ordered copy: one compiled signature
        if p.ndim != 4 or p.shape[0] != B or p.shape[2] != R * C or p.shape[3] != 4 or p.shape[1] < 2:
            raise ValueError(f"pi of shape {p.shape}: must be [{B}, horizon + 1 >= 2, {R * C}, 4] "
                             f"(instances, actions left, cells, actions)")
        rows = p[:, 1:]
        bad = np.argwhere(~np.isfinite(rows) | (rows < 0))
        if bad.shape[0]:
            b, k, c, a = (int(x) for x in bad[0])
            raise ValueError(f"pi[{b}, {k + 1}, {c}, {a}] = {float(rows[b, k, c, a])}: must be finite and >= 0")
        sums = rows.sum(-1)
        off = np.argwhere(np.abs(sums - 1.0) > 1e-6)
        if off.shape[0]:
            b, k, c = (int(x) for x in off[0])
            raise ValueError(f"pi[{b}, {k + 1}, {c}] sums to {float(sums[b, k, c]):.6g}, not 1")
        out = np.zeros(B, dtype=np.float64)
        _fl_success_values(self._maps, self._start, self.is_slippery, self.success_prob, p.shape[1] - 1, True,
                           out, np.zeros((0, 0, 0), dtype=np.int8), p)
        return out

    def expert(self, i: int, actions_left: int) -> list[str]:
        """The expert's move in instance i's current cell with `actions_left` actions left: one
        move (where it lands is the ice's to decide), `optimal_policy`'s, whose table for the
        current maps is computed once per reset (for the most actions left asked so far: its
        row k does not depend on the horizon). Raises RuntimeError before the first reset."""
        i = self._check_index(i)
        k = int(actions_left)
        if self._expert_table is None or self._expert_table.shape[1] <= k:
            self._expert_table = self.optimal_policy(max(k, 1))
        return [ACTIONS[int(self._expert_table[i, k, int(self._pos[i])])]]

    def positions(self) -> np.ndarray:
        """int64 [B]: each instance's current cell (row * C + column). RuntimeError before reset."""
        self._require_reset()
        return self._pos.copy()

    def optimal_success(self, seeds, horizon: int) -> np.ndarray:
        """float64 [n]: for each seed's map, the probability that the best policy reaches the
        goal within `horizon` actions (and within max_steps), exactly: finite-horizon value
        iteration over the map's cells with the env's own slip probabilities.

        This policy sees the state after every action; an agent that commits to several
        actions per turn can do no better, so it is the ceiling of any learning curve.
        seeds: a list, range or 1-D array of non-negative integers (any count; this env's
        own instances are untouched). Raises TypeError for another seeds type, ValueError
        for a horizon that is not an integer >= 1 or a bad seed.
        """
        return self._success_values(seeds, horizon, True)

    def random_success(self, seeds, horizon: int) -> np.ndarray:
        """float64 [n]: for each seed's map, the probability that the uniformly random policy
        (each action Left/Down/Right/Up with probability 1/4) reaches the goal within
        `horizon` actions, exactly (the same value iteration, averaging over actions instead
        of maximising): the floor of a learning curve. Arguments and errors as
        `optimal_success`."""
        return self._success_values(seeds, horizon, False)

    def render(self) -> list[str]:
        """The B current observations in the `observation` format: the grid's rows separated by
        newlines (cells separated by spaces in the per-cell formats), then, in the coordinate
        formats, where the player, the goal and the holes are. Raises RuntimeError before the
        first reset."""
        return self._grid_texts(lambda buf: _fl_render(self._maps, self._pos, self._sym, buf))

    def instructions(self) -> list[str]:
        """The game description for the prompt (the same for every instance; needs no reset)."""
        s = self.symbols
        slip = (f"The ice is slippery: you move in the intended direction only with probability "
                f"{self.success_prob:.2g}, otherwise to one of the two perpendicular directions. "
                if self.is_slippery else "")
        text = (
            "You are walking on a frozen lake and must reach the goal without falling into a hole.\n"
            f"Symbols: {s['player']} you, {s['frozen']} frozen ice, {s['hole']} hole, {s['goal']} goal, "
            f"{s['player_in_hole']} you in a hole, {s['player_on_goal']} you on the goal.\n"
            f"{slip}Reaching the goal gives reward 1; falling into a hole ends the game.\n"
            f"{observation_note(self.observation)}"
            f"Valid actions: {', '.join(ACTIONS)}. Separate several actions with ' || '."
        )
        return [text] * self._B

    def _coordinate_lines(self, b: int) -> str:
        grid = self._maps[b]
        r, c = divmod(int(self._pos[b]), self.size[1])
        holes = list(zip(*np.nonzero(grid == _HOLE)))
        return (f"You ({self.symbols['player']}) are at ({r}, {c}).\n"
                f"Goal at {cell_list(zip(*np.nonzero(grid == _GOAL)))}.\n"
                f"Holes at {cell_list(holes) if holes else 'none'}.")

    def _step_kernel(self, acts, active, out) -> None:
        _fl_step(self._maps, self._pos, self._rng, self._steps, self.done, self.success, self.truncated, acts, active,
                 self.is_slippery, self.success_prob, self.max_steps, out.reward, out.num_executed, out.valid, out.effective)

    # helpers for tests and users
    def tiles(self, i: int) -> list[str]:
        """Instance i's map in gymnasium notation (rows of S/F/H/G; S marks the start cell)."""
        i = self._check_index(i)
        self._require_reset()
        R, C = self.size
        start = int(self._start[i])
        rows = []
        for r in range(R):
            row = ""
            for c in range(C):
                t = self._maps[i, r, c]
                row += "S" if r * C + c == start else "FHG"[t]
            rows.append(row)
        return rows
