"""Plain-Python reference implementations of one environment turn: parse the answer text,
step the dynamics, render the text. One object per instance, readable and slow. The tests
use them to cross-check the Numba kernels (same seeds give the same random streams), and the
benchmarks use them as the plain-Python baseline of a whole turn.

    refs = reference_envs(env)                         # copies the state of a batched env
    obs, reward, done = reference_turn(refs, answers, max_actions=5)
"""
from __future__ import annotations

from collections import deque

from .bandit import BanditEnv
from .frozenlake import FrozenLakeEnv
from .sokoban import OUTSIDE, TARGET, WALL, SokobanEnv

_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def parse_answer(answer: str, names: dict[str, int], max_actions: int) -> tuple[list[int], list[str]]:
    """Parse one answer: pieces split on '||', stripped, empty ones skipped, the first
    `max_actions` looked at, matched ASCII case-insensitively against `names`
    (lower-case name -> action id). Returns (action ids, invalid pieces)."""
    actions, invalid = [], []
    pieces = [p.strip() for p in answer.split("||")]
    pieces = [p for p in pieces if p][:max_actions]
    for p in pieces:
        a = names.get(p.translate(_ASCII_LOWER))
        if a is None:
            invalid.append(p)
        else:
            actions.append(a)
    return actions, invalid


def mix64(z: int) -> int:
    """SplitMix64's output function on a 64-bit int."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class SplitMix64:
    """The per-instance random stream of the batched envs, in plain Python integers: the
    starting state is mix64(seed * GOLDEN + mix64(salt)) (as ``_core.rng_seed_all``)."""

    def __init__(self, seed: int, salt: int):
        self.state = mix64((seed * _GOLDEN + mix64(salt)) & _M64)

    def next(self) -> int:
        """The next 64-bit output (int in [0, 2**64))."""
        self.state = (self.state + _GOLDEN) & _M64
        return mix64(self.state)

    def uniform(self) -> float:
        """A float in [0, 1) from the top 53 bits."""
        return (self.next() >> 11) * 2.0 ** -53

    def below(self, n: int) -> int:
        """An int in [0, n)."""
        return (self.next() >> 11) % n


class RefFrozenLake:
    """One FrozenLake instance. rows: gymnasium-notation map (S/F/H/G)."""

    actions = ("Left", "Down", "Right", "Up")

    def __init__(self, rows, start, rng: SplitMix64, slippery=True, success_prob=1 / 3, max_steps=100, symbols=None):
        self.rows = [r.replace("S", "F") for r in rows]
        self.pos = start
        self.rng = rng
        self.slippery, self.success_prob, self.max_steps = slippery, success_prob, max_steps
        self.sym = symbols or {"player": "P", "frozen": "_", "hole": "O", "goal": "G", "player_in_hole": "X",
                               "player_on_goal": "√"}
        self.steps = 0
        self.done = self.success = False
        self.names = {a.lower(): i for i, a in enumerate(self.actions)}

    @classmethod
    def generate(cls, seed: int, size: int = 4, p: float = 0.8, layout: str = "ragen", **kw) -> "RefFrozenLake":
        """Draw the map of seed `seed` exactly as the batched env does: cells frozen with
        probability p, then (layout "ragen") start row, start column, goal row, goal column,
        the whole draw repeated while start == goal or no path joins them; (layout
        "gymnasium") start top-left and goal bottom-right."""
        rng = SplitMix64(seed, 0xF20)
        while True:
            rows = [["F" if rng.uniform() < p else "H" for _ in range(size)] for _ in range(size)]
            if layout == "ragen":
                start = (rng.below(size), rng.below(size))
                goal = (rng.below(size), rng.below(size))
                if start == goal:
                    continue
            else:
                start, goal = (0, 0), (size - 1, size - 1)
            rows[start[0]][start[1]] = "S"
            rows[goal[0]][goal[1]] = "G"
            if cls._has_path(rows, start):
                return cls(["".join(r) for r in rows], start, rng, **kw)

    @staticmethod
    def _has_path(rows, start) -> bool:
        n, m = len(rows), len(rows[0])
        seen, queue = {start}, deque([start])
        while queue:
            r, c = queue.popleft()
            if rows[r][c] == "G":
                return True
            for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= rr < n and 0 <= cc < m and (rr, cc) not in seen and rows[rr][cc] != "H":
                    seen.add((rr, cc))
                    queue.append((rr, cc))
        return False

    def step(self, a: int) -> float:
        """Apply action a (0 Left, 1 Down, 2 Right, 3 Up); returns the reward."""
        if self.slippery:
            u = self.rng.uniform()
            side = (1 - self.success_prob) / 2
            d = a if u < self.success_prob else ((a + 3) % 4 if u < self.success_prob + side else (a + 1) % 4)
        else:
            d = a
        r, c = self.pos
        dr, dc = {0: (0, -1), 1: (1, 0), 2: (0, 1), 3: (-1, 0)}[d]
        r = min(max(r + dr, 0), len(self.rows) - 1)
        c = min(max(c + dc, 0), len(self.rows[0]) - 1)
        self.pos = (r, c)
        self.steps += 1
        tile = self.rows[r][c]
        if tile == "G":
            self.done = self.success = True
            return 1.0
        if tile == "H" or (self.max_steps and self.steps >= self.max_steps):
            self.done = True
        return 0.0

    def render(self) -> str:
        """The grid text, rows joined by newlines."""
        s = self.sym
        lines = []
        for r, row in enumerate(self.rows):
            line = ""
            for c, t in enumerate(row):
                if (r, c) == self.pos:
                    line += s["player"] if t == "F" else (s["player_in_hole"] if t == "H" else s["player_on_goal"])
                else:
                    line += s["frozen"] if t == "F" else (s["hole"] if t == "H" else s["goal"])
            lines.append(line)
        return "\n".join(lines)


class RefSokoban:
    """One Sokoban instance: walls, targets, boxes (sets of (row, col)), player (row, col)."""

    actions = ("Up", "Down", "Left", "Right")

    def __init__(self, shape, walls, targets, boxes, player, max_steps=100, rewards=(-0.1, 1.0, 1.0, 10.0), symbols=None):
        self.shape = shape
        self.walls, self.targets, self.boxes, self.player = set(walls), set(targets), set(boxes), tuple(player)
        self.max_steps, self.rewards = max_steps, rewards
        self.sym = symbols or {"wall": "#", "floor": "_", "target": "O", "box": "X", "box_on_target": "√",
                               "player": "P", "player_on_target": "S"}
        self.steps = 0
        self.done = self.success = False
        self.names = {a.lower(): i for i, a in enumerate(self.actions)}

    def step(self, a: int) -> float:
        """Apply action a (0 Up, 1 Down, 2 Left, 3 Right); returns the reward."""
        step, on, off, fin = self.rewards
        reward = step
        dr, dc = ((-1, 0), (1, 0), (0, -1), (0, 1))[a]
        r, c = self.player
        nxt = (r + dr, c + dc)
        beyond = (r + 2 * dr, c + 2 * dc)
        if nxt not in self.walls:
            if nxt in self.boxes:
                if beyond not in self.walls and beyond not in self.boxes:
                    self.boxes.remove(nxt)
                    self.boxes.add(beyond)
                    reward += (on if beyond in self.targets else 0.0) - (off if nxt in self.targets else 0.0)
                    self.player = nxt
            else:
                self.player = nxt
        self.steps += 1
        if self.boxes == self.targets:
            reward += fin
            self.done = self.success = True
        elif self.max_steps and self.steps >= self.max_steps:
            self.done = True
        return reward

    def render(self) -> str:
        """The grid text, rows joined by newlines."""
        s = self.sym
        lines = []
        for r in range(self.shape[0]):
            line = ""
            for c in range(self.shape[1]):
                p = (r, c)
                if p in self.walls:
                    line += s["wall"]
                elif p == self.player:
                    line += s["player_on_target"] if p in self.targets else s["player"]
                elif p in self.boxes:
                    line += s["box_on_target"] if p in self.targets else s["box"]
                else:
                    line += s["target"] if p in self.targets else s["floor"]
            lines.append(line)
        return "\n".join(lines)


def reverse_search(free, targets, player, search_depth, generator="ragen", max_states=300_000):
    """The depth-first reverse-play search of Sokoban level generation, plain and recursive.

    free: set of (row, col) cells that are not walls (targets included); targets: list of
    (row, col), box k starts on targets[k]; player: (row, col); search_depth: the ttl, as in
    gym-sokoban and RAGEN (a call at depth d explores its node iff d <= search_depth - 2);
    generator: "ragen" (pull moves only, box_swaps counts changes of the pulled box) or
    "gym" (pulls then plain moves, box_swaps counts pulls); max_states: explored-state cap.
    A state is the player and the set of (box cell, pulled at least once); each is explored
    the first time it is reached. Returns (best score, player, box cells in target order)
    of the first explored state with the highest score
    box_swaps * sum(|box - its target|), the score being 0 while a box or the player is on
    a target.
    """
    pull_only, count_pulls = {"ragen": (True, False), "gym": (False, True)}[generator]
    explored = set()
    best = [-1, player, list(targets)]
    target_set = set(targets)
    moves = ((-1, 0), (1, 0), (0, -1), (0, 1))

    def visit(player, boxes, pulled, swaps, last, ttl):
        ttl -= 1
        if ttl <= 0 or len(explored) >= max_states:
            return
        key = (player, frozenset(zip(boxes, pulled)))
        if key in explored:
            return
        explored.add(key)
        covered = player in target_set or any(b in target_set for b in boxes)
        disp = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets))
        score = 0 if covered else swaps * disp
        if score > best[0]:
            best[:] = [score, player, list(boxes)]
        for a in range(4 if pull_only else 8):
            dr, dc = moves[a % 4]
            nxt = (player[0] + dr, player[1] + dc)
            if nxt not in free or nxt in boxes:
                continue
            behind = (player[0] - dr, player[1] - dc)
            if a < 4 and behind in boxes:
                k = boxes.index(behind)
                new_boxes = boxes[:k] + [player] + boxes[k + 1:]
                new_pulled = pulled[:k] + [True] + pulled[k + 1:]
                new_swaps = swaps + (1 if count_pulls or k != last else 0)
                visit(nxt, new_boxes, new_pulled, new_swaps, k, ttl)
            else:
                visit(nxt, boxes, pulled, swaps, last, ttl)

    visit(tuple(player), [tuple(t) for t in targets], [False] * len(targets), 0, -1, search_depth)
    return best[0], best[1], best[2]


class RefBandit:
    """One two-armed bandit instance: arms (name shown first, name shown second)."""

    def __init__(self, arms, high_index, rng: SplitMix64, low_reward=0.1, high_reward=1.0, high_prob=0.25):
        self.arms, self.high_index, self.rng = tuple(arms), high_index, rng
        self.low_reward, self.high_reward, self.high_prob = low_reward, high_reward, high_prob
        self.done = self.success = False
        self.chosen, self.total = None, 0.0
        self.names = {a.lower(): i for i, a in enumerate(self.arms)}

    def step(self, a: int) -> float:
        """Pull arm a (0 shown first, 1 shown second); returns the reward."""
        if a == self.high_index:
            reward = self.high_reward if self.rng.uniform() < self.high_prob else 0.0
        else:
            reward = self.low_reward
        self.chosen, self.total = a, reward
        self.success = (a == self.high_index) == (self.high_reward * self.high_prob >= self.low_reward)
        self.done = True
        return reward

    def render(self) -> str:
        """The situation before the pull, or the pull's result."""
        a, b = self.arms
        if self.chosen is None:
            return f"Two arms: {a} and {b}. Which arm do you pull?"
        return f"You pulled {self.arms[self.chosen]} and received reward {self.total:g}."


def reference_envs(env) -> list:
    """Plain-Python copies of every instance of a batched env (after its reset or any turn),
    sharing nothing with it; their random streams continue from the same state."""
    out = []
    for i in range(env.batch_size):
        rng = SplitMix64(0, 0)
        rng.state = int(env._rng[i])
        if isinstance(env, FrozenLakeEnv):
            R, C = env.size
            rows = ["".join("FHG"[t] for t in env._maps[i, r]) for r in range(R)]
            ref = RefFrozenLake(rows, divmod(int(env._pos[i]), C), rng, env.is_slippery, env.success_prob,
                                env.max_steps, env.symbols)
            ref.steps = int(env._steps[i])
        elif isinstance(env, SokobanEnv):
            C = env.size[1]
            r, c = int(env._rows[i]), int(env._cols[i])
            t = env._tiles[i, :r, :c]
            cells = [(y, x) for y in range(r) for x in range(c)]
            ref = RefSokoban((r, c), [p for p in cells if t[p] in (WALL, OUTSIDE)], [p for p in cells if t[p] == TARGET],
                             [p for p in cells if env._boxes[i, p[0], p[1]]], divmod(int(env._player[i]), C),
                             env.max_steps, env.rewards, env.symbols)
            ref.steps = int(env._steps[i])
        elif isinstance(env, BanditEnv):
            ref = RefBandit(env.action_names(i), int(env.high_risk_action()[i]), rng, env.low_reward, env.high_reward,
                            env.high_prob)
            if env._chosen[i] >= 0:
                ref.chosen, ref.total = int(env._chosen[i]), float(env._reward[i])
        else:
            raise TypeError(f"no reference for {type(env).__name__}")
        ref.done, ref.success = bool(env.done[i]), bool(env.success[i])
        out.append(ref)
    return out


def reference_turn(refs: list, answers: list[str], max_actions: int) -> tuple[list[str], list[float], list[bool]]:
    """One whole turn in plain Python: parse each answer, execute its actions until the
    episode ends, render. Returns (observation texts, rewards, done flags)."""
    obs, rewards, dones = [], [], []
    for ref, answer in zip(refs, answers):
        actions, _ = parse_answer(answer, ref.names, max_actions)
        total = 0.0
        for a in actions:
            if ref.done:
                break
            total += ref.step(a)
        obs.append(ref.render())
        rewards.append(total)
        dones.append(ref.done)
    return obs, rewards, dones
