"""B plain-Python environment instances behind the batched protocol of the rollout.

`PythonBatchedEnv` offers what `fastpo.envs_native.BatchedTextEnv` offers (reset(seeds),
render(), instructions(), action_names(i), parse_actions(answers, max_actions),
step(actions, active), the `done` / `success` / `truncated` arrays, and the success bounds
when the game has them), plus the free-text path `step_text(answers, active)` for games
without named moves. Nothing downstream (rollout, metrics, StarPO-S, evaluation) knows
which kind it has.

Each instance keeps its own `random` module state: it starts as `random.seed(seed)` at
reset and is swapped in around each of the instance's calls, so a game that draws from the
global `random` (TextArena's do) gives the same results whatever the step order, the batch
or the worker it runs in; the caller's own `random` state is left as it was. (NumPy's
global generator is not swapped: a game using NumPy should own a `np.random.Generator`.)

With `workers=W > 0` the instances are split into W contiguous shards, each held by a
worker process (spawned, so the game class must be importable) that runs the same per-
instance code: the results are those of the in-process run.
"""
from __future__ import annotations

import multiprocessing as mp
import numbers
import random
import signal
from typing import Callable, Optional, Sequence

import numpy as np

from .errors import EnvError, user_code_failure


class _Shard:
    """Instances [start, start + n) of one batch: the per-instance code of both paths.

    Every method takes global instance indices and returns plain Python data (picklable).
    """

    def __init__(self, factory: Callable, options: dict, name: str, start: int, n: int):
        self.name = name
        self.start = start
        self.envs = []
        for _ in range(n):
            try:
                self.envs.append(factory(**options))
            except EnvError:
                raise
            except BaseException as e:
                said = user_code_failure(e)
                if said is None:
                    raise
                raise EnvError(f"environment {name!r}: building it with options {options!r} {said}") from None
        self.seeds = [0] * n
        self.states = [None] * n

    def _call(self, b: int, what: str, fn, *args, keep_draws: bool = True):
        """fn(*args) with instance b's random state swapped in; errors name the env and seed.
        keep_draws=False: what fn draws is not kept (the instance's stream goes on as if it had
        not been called: the expert, which the game the model sees never calls)."""
        i = b - self.start
        outer = random.getstate()
        random.setstate(self.states[i])
        try:
            return fn(*args)
        except BaseException as e:  # a game must not end the trainer: its process holds the user's run
            said = user_code_failure(e)
            if said is None:  # a Ctrl-C: the trainer's to handle
                raise
            raise EnvError(f"environment {self.name!r}, instance with seed {self.seeds[i]}: {what} {said}") \
                from (e if isinstance(e, Exception) else None)
        finally:
            if keep_draws:
                self.states[i] = random.getstate()
            random.setstate(outer)

    def reset(self, pairs) -> list:
        """pairs: [(b, seed)]; returns [(observation, instructions, action names or None)]."""
        out = []
        for b, seed in pairs:
            i = b - self.start
            self.seeds[i] = seed
            outer = random.getstate()
            random.seed(seed)
            self.states[i] = random.getstate()
            random.setstate(outer)
            env = self.envs[i]
            obs = self._call(b, f"reset({seed})", env.reset, seed)
            if not isinstance(obs, str):
                raise EnvError(f"environment {self.name!r}, instance with seed {seed}: reset() must return the "
                               f"observation as str, got {type(obs).__name__} {obs!r:.60}")
            _check_text(obs, "reset()'s observation", self.name, seed)
            out.append((obs, _text_attr(env, "instructions", self.name, seed), _names(env, self.name, seed)))
        return out

    def expert(self, items) -> list:
        """items: [(b,)]; the answer text each instance's game's `expert()` gives now."""
        out = []
        for (b,) in items:
            text = self._call(b, "expert()", self.envs[b - self.start].expert, keep_draws=False)
            if not isinstance(text, str):
                raise EnvError(f"environment {self.name!r}, instance with seed {self.seeds[b - self.start]}: expert() "
                               f"must return the answer as str, got {type(text).__name__} {text!r:.60}")
            _check_text(text, "expert()'s answer", self.name, self.seeds[b - self.start])
            out.append(text)
        return out

    def step(self, jobs) -> list:
        """jobs: [(b, [answer, ...])], each answer one `step` call until done; returns per
        job [(observation, reward, done, success, valid)] of the calls made."""
        out = []
        for b, answers in jobs:
            env, res = self.envs[b - self.start], []
            for a in answers:
                got = self._call(b, f"step({a!r:.40})", env.step, a)
                res.append(_check_step(got, self.name, self.seeds[b - self.start]))
                _check_text(res[-1][0], "step()'s observation", self.name, self.seeds[b - self.start])
                if res[-1][2]:
                    break
            out.append(res)
        return out


def _check_text(text: str, field: str, name: str, seed: int) -> None:
    """EnvError naming the game, the field and the seed when `text` cannot be encoded as UTF-8
    (a lone surrogate such as "\\ud800", what a bad decode leaves): no tokenizer can read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EnvError(f"environment {name!r}, instance with seed {seed}: {field} is not valid text: "
                       f"{text[e.start:e.end]!r} at character {e.start} cannot be encoded as UTF-8") from None


def _text_attr(env, attr: str, name: str, seed: int) -> str:
    v = getattr(env, attr, "")
    if callable(v):
        v = v()
    v = "" if v is None else v
    if not isinstance(v, str):
        raise EnvError(f"environment {name!r}, instance with seed {seed}: {attr} must be a str, got "
                       f"{type(v).__name__} {v!r:.60}")
    _check_text(v, attr, name, seed)
    return v


def _names(env, name: str, seed: int) -> Optional[tuple]:
    v = getattr(env, "action_names", None)
    if callable(v):
        v = v()
    if v is None:
        return None
    if isinstance(v, str) or not all(isinstance(x, str) and x.strip() and "||" not in x for x in v) or not len(v):
        raise EnvError(f"environment {name!r}, instance with seed {seed}: action_names must be a non-empty sequence "
                       f"of non-empty str without '||' (or None for free-text answers), got {v!r:.80}")
    keys = [x.strip().lower() for x in v]
    if len(set(keys)) != len(keys):  # answers are matched case-insensitively: one name would hide another
        twice = sorted({x for x in v if keys.count(x.strip().lower()) > 1})
        raise EnvError(f"environment {name!r}, instance with seed {seed}: action_names holds the same name twice "
                       f"(matched ignoring case and spaces): {twice}")
    return tuple(v)


def _check_step(got, name: str, seed: int) -> tuple:
    """(observation, reward, done, success, valid) from one `step` return; EnvError naming
    the field that has the wrong type."""
    where = f"environment {name!r}, instance with seed {seed}: step() must return (observation: str, " \
            "reward: float, done: bool, info: dict)"
    if not isinstance(got, tuple) or len(got) != 4:
        raise EnvError(f"{where}, got {type(got).__name__} {got!r:.80}")
    obs, reward, done, info = got
    for field, ok, v in (("observation", isinstance(obs, str), obs),
                         ("reward", isinstance(reward, numbers.Real) and not isinstance(reward, (bool, np.bool_))
                          and np.isfinite(reward), reward),
                         ("done", isinstance(done, (bool, np.bool_)), done),
                         ("info", isinstance(info, dict), info)):
        if not ok:
            raise EnvError(f"{where}; its {field} is {type(v).__name__} {v!r:.60}")
    for key in ("success", "valid"):
        if key in info and not isinstance(info[key], (bool, np.bool_)):
            raise EnvError(f"{where}; its info[{key!r}] must be a bool, got {type(info[key]).__name__} "
                           f"{info[key]!r:.60}")
    return obs, float(reward), bool(done), bool(info.get("success", False)), bool(info.get("valid", True))


def _worker_main(conn, factory, options, name, start, n):  # pragma: no cover - runs in a child process
    # Ctrl-C reaches the whole process group: the trainer finishes its iteration and saves, and
    # needs its workers for that (SIGTERM still ends them; the trainer closes them in any case)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        shard = _Shard(factory, options, name, start, n)
        conn.send(("ok", None))
    except BaseException as e:
        conn.send(("error", str(e) if isinstance(e, EnvError) else f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        method, arg = msg
        try:
            conn.send(("ok", getattr(shard, method)(arg)))
        except BaseException as e:
            conn.send(("error", str(e) if isinstance(e, EnvError) else f"{type(e).__name__}: {e}"))


class _WorkerPool:
    """W spawned processes, each holding one contiguous shard of the B instances."""

    def __init__(self, factory, options, name, batch_size: int, workers: int):
        ctx = mp.get_context("spawn")
        bounds = np.linspace(0, batch_size, min(workers, batch_size) + 1).astype(int)
        self.ranges = [(int(a), int(z)) for a, z in zip(bounds[:-1], bounds[1:])]
        self.conns, self.procs = [], []
        for a, z in self.ranges:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(child, factory, options, name, a, z - a), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            self._answer(c)

    def _answer(self, conn):
        try:
            status, value = conn.recv()
        except EOFError:
            self.close()
            raise EnvError("an environment worker process died (see its error above)") from None
        if status != "ok":
            self.close()
            raise EnvError(value)
        return value

    def run(self, method: str, items: list) -> list:
        """Send each (b, ...) item to the worker owning b; results in the order of `items`."""
        per = [[] for _ in self.ranges]
        for it in items:
            w = next(k for k, (a, z) in enumerate(self.ranges) if a <= it[0] < z)
            per[w].append(it)
        busy = [w for w in range(len(per)) if per[w]]
        for w in busy:
            self.conns[w].send((method, per[w]))
        got = {}
        for w in busy:
            for it, r in zip(per[w], self._answer(self.conns[w])):
                got[it[0]] = r
        return [got[it[0]] for it in items]

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
                c.close()
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []

    def __del__(self):
        self.close()


class PythonBatchedEnv:
    """B instances of a plain-Python game (`fastpo.envs.interface`) as one batched env.

    Args:
        factory: the game class (or any callable taking the options as keywords).
        batch_size: B >= 1.
        options: keyword arguments of every instance.
        name: the env name, for error messages.
        workers: 0 (in process) or W worker processes.
    Raises EnvError (one line) when an instance cannot be built, and from reset/step when
    the game raises (naming the env, the call and the instance's seed) or returns a wrong
    type (naming the field).
    """

    def __init__(self, factory: Callable, batch_size: int, options: Optional[dict] = None, name: str = "env",
                 workers: int = 0):
        self.name = name
        self.batch_size = int(batch_size)
        self._factory, self._options = factory, dict(options or {})
        B = self.batch_size
        if workers > 0 and getattr(factory, "__module__", None) == "__main__":
            raise EnvError(f"environment {name!r}: with env.workers > 0 the game class must be importable by the "
                           f"worker processes; define {getattr(factory, '__qualname__', factory)!r} in a module, not "
                           f"in the script that is run (__main__)")
        self._pool = _WorkerPool(factory, self._options, name, B, workers) if workers > 0 else None
        self._local = None if self._pool else _Shard(factory, self._options, name, 0, B)
        self.done = np.ones(B, dtype=np.bool_)
        self.success = np.zeros(B, dtype=np.bool_)
        self.truncated = np.zeros(B, dtype=np.bool_)
        self._obs = [""] * B
        self._instr = [""] * B
        self._names: list = [None] * B
        self._lookup: list = [{}] * B
        self._was_reset = False
        probe = self._local.envs[0] if self._local else factory(**self._options)
        self._probe = probe
        self.free_text: Optional[bool] = None  # known at reset: the game names its moves or not

    def _run(self, method: str, items: list) -> list:
        if self._pool is not None:
            return self._pool.run(method, items)
        return getattr(self._local, method)(items)

    def close(self) -> None:
        """Stop the worker processes (if any)."""
        if self._pool is not None:
            self._pool.close()

    # -- the batched protocol ---------------------------------------------------------------
    def reset(self, seeds) -> list:
        """Reset the B instances from B non-negative integer seeds; the B observation texts.
        Raises ValueError for a wrong count or a bad seed, EnvError from the game."""
        seeds = [int(s) for s in np.asarray(seeds).reshape(-1).tolist()]
        if len(seeds) != self.batch_size or any(s < 0 for s in seeds):
            raise ValueError(f"expected {self.batch_size} non-negative integer seeds, got {seeds!r:.80}")
        got = self._run("reset", list(enumerate(seeds)))
        for b, (obs, instr, names) in enumerate(got):
            self._obs[b], self._instr[b], self._names[b] = obs, instr, names
            self._lookup[b] = {n.strip().lower(): k for k, n in enumerate(names)} if names else {}
        kinds = {n is None for n in self._names}
        if len(kinds) > 1:
            raise EnvError(f"environment {self.name!r}: some instances name their moves (action_names) and some "
                           "take free text; a game must do one or the other")
        self.free_text = kinds.pop()
        self.done[:] = False
        self.success[:] = False
        self.truncated[:] = False
        self._was_reset = True
        return list(self._obs)

    def _require_reset(self):
        if not self._was_reset:
            raise RuntimeError(f"{self.name}: call reset(seeds) before this")

    def render(self) -> list:
        """The B current observation texts (each the last one its game returned)."""
        self._require_reset()
        return list(self._obs)

    def instructions(self) -> list:
        """The B rules texts."""
        self._require_reset()
        return list(self._instr)

    def action_names(self, i: int) -> list:
        """Move names of instance i ([] for a free-text game)."""
        self._require_reset()
        return list(self._names[i] or ())

    def parse_actions(self, answers: Sequence[str], max_actions: int):
        """Parse B answers into move ids (as `BatchedTextEnv.parse_actions`); a free-text
        game has no moves: every non-empty answer is one piece with action id 0."""
        # numba: `import fastpo.envs` loads none (the Numba games load on first use)
        from fastpo.envs_native._core import ParsedActions
        from fastpo.envs_native.python_reference import parse_answer

        self._require_reset()
        B = self.batch_size
        acts = np.full((B, max_actions), -1, dtype=np.int64)
        num = np.zeros(B, dtype=np.int64)
        invalid = []
        for b, text in enumerate(answers):
            a, bad = parse_answer(text or "", self._lookup[b], max_actions)
            acts[b, :len(a)] = a
            num[b] = len(a)
            invalid.append(tuple(bad))
        all_valid = np.array([num[b] > 0 and not invalid[b] for b in range(B)], dtype=np.bool_)
        return ParsedActions(acts, num, invalid, all_valid)

    def step(self, actions, active=None):
        """Run each active instance's move ids ([B, A], -1 = none) in order until its game
        ends: one `step(name)` call per move. Returns a StepResult (effective: the
        observation changed)."""
        self._require_reset()
        acts = np.asarray(actions)
        if acts.ndim == 1:
            acts = acts[:, None]
        B, A = acts.shape
        act = np.ones(B, dtype=np.bool_) if active is None else np.asarray(active, dtype=np.bool_)
        jobs, ids = [], {}
        for b in range(B):
            if not act[b] or self.done[b]:
                continue
            names = self._names[b] or ()
            run = [int(a) for a in acts[b] if 0 <= a < len(names)]
            if run:
                jobs.append((b, [names[a] for a in run]))
                ids[b] = [j for j in range(A) if 0 <= acts[b, j] < len(names)]
        return self._finish(self._run("step", jobs) if jobs else [], jobs, ids, A)

    def step_text(self, answers: Sequence[Optional[str]], active=None):
        """The free-text path: answers[b] (the whole `<answer>` content, or None: no step)
        goes to instance b's `step` once. Returns a StepResult with A = 1: valid[b, 0] is
        the game's `info["valid"]` (the answer was accepted), num_executed 1 per step call,
        effective: the observation changed."""
        self._require_reset()
        B = self.batch_size
        act = np.ones(B, dtype=np.bool_) if active is None else np.asarray(active, dtype=np.bool_)
        jobs = [(b, [answers[b]]) for b in range(B) if act[b] and not self.done[b] and answers[b] is not None]
        return self._finish(self._run("step", jobs) if jobs else [], jobs, {b: [0] for b, _ in jobs}, 1)

    def _finish(self, results, jobs, cols, A):
        # numba: `import fastpo.envs` loads none (the Numba games load on first use)
        from fastpo.envs_native._core import StepResult

        B = self.batch_size
        reward = np.zeros(B, dtype=np.float32)
        executed = np.zeros(B, dtype=np.int32)
        valid = np.zeros((B, A), dtype=np.bool_)
        effective = np.zeros((B, A), dtype=np.bool_)
        for (b, _), res in zip(jobs, results):
            for k, (obs, r, done, success, ok) in enumerate(res):
                j = cols[b][k]
                reward[b] += np.float32(r)
                executed[b] += 1
                valid[b, j] = ok
                effective[b, j] = obs != self._obs[b]
                self._obs[b] = obs
                self.done[b], self.success[b] = done, success
        return StepResult(reward, self.done.copy(), self.success.copy(), executed, valid, effective)

    def probe(self, bounds: Optional[tuple] = None) -> None:
        """The game played once at set-up, before any model loads, so that a broken definition
        is found then: a reset (seed 0), one step (its first move, or a free-text answer), a
        second reset of seed 0 (a warning when its observation differs: a reset that does not
        depend on its seed alone), and, with `bounds` = (seeds, horizon), its reference lines on
        those seeds. Leaves the instances to be reset again. Raises EnvError naming what is
        wrong."""
        first = self.reset([0] * self.batch_size)
        if self.free_text:
            self.step_text(["1"] * self.batch_size)
        else:
            self.step(np.zeros((self.batch_size, 1), dtype=np.int64))
        again = self.reset([0] * self.batch_size)
        if again != first:  # not an error: some games mean it, but env groups then mislead
            # torch: `import fastpo.envs` loads none
            from fastpo.report.metrics import warn_user

            warn_user(f"environment {self.name!r}: reset(0) after a game gave another first observation "
                      f"({again[0]!r:.60} vs {first[0]!r:.60}): the trajectories of an env group start from "
                      f"different states and GRPO's group baseline compares unlike games; make reset depend "
                      f"on its seed alone (the instance's `random` is seeded for you; own a NumPy generator)")
        for which in ("optimal_success", "random_success"):
            if bounds is not None and self.has_bound(which):
                self._bound(which, *bounds)
        self._was_reset = False

    # -- the expert (SFT data) ------------------------------------------------------------
    def has_expert(self) -> bool:
        """Whether the game defines `expert()` (the answer a good player gives now)."""
        return callable(getattr(self._probe, "expert", None))

    #: A game's `expert()` answers with text, played as written: no per-turn move count of its own.
    expert_moves_per_turn = None

    def expert_answers(self, indices: Sequence[int], actions_left=None) -> list:
        """The answer texts (the `<answer>` content) the games of instances `indices` give as
        experts in their current states (the batched protocol's expert; `actions_left` is not
        read: a game's `expert()` knows its own state). Raises EnvError naming the seed when
        `expert()` raises or returns something other than a str."""
        self._require_reset()
        return self._run("expert", [(int(b),) for b in indices]) if len(indices) else []

    # -- reference lines -----------------------------------------------------------------
    def has_bound(self, which: str) -> bool:
        """Whether the game defines `random_success` / `optimal_success` (which)."""
        return callable(getattr(self._probe, which, None))

    def random_success(self, seeds, horizon: int) -> np.ndarray:
        """Per seed, the uniformly random policy's success probability (the game's own)."""
        return self._bound("random_success", seeds, horizon)

    def optimal_success(self, seeds, horizon: int) -> np.ndarray:
        """Per seed, the best policy's success probability (the game's own)."""
        return self._bound("optimal_success", seeds, horizon)

    def _bound(self, which, seeds, horizon):
        fn = getattr(self._probe, which, None)
        if not callable(fn):
            raise AttributeError(f"environment {self.name!r} has no {which}")
        try:
            v = np.asarray(fn(list(seeds), horizon), dtype=np.float64).reshape(-1)
        except BaseException as e:
            said = user_code_failure(e)
            if said is None:
                raise
            raise EnvError(f"environment {self.name!r}: {which}(seeds, {horizon}) {said}") from None
        if v.size != len(seeds) or not np.all((v >= 0) & (v <= 1)):
            raise EnvError(f"environment {self.name!r}: {which} must return one probability in [0, 1] per seed "
                           f"({len(seeds)} seeds, horizon {horizon}), got {v.tolist()!r:.80}")
        return v
