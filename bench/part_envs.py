"""Environment benchmarks, fastpo's Numba envs side by side with the usual baselines.

    python bench/throughput.py --part envs [--quick] [--json PATH]

- Sokoban level generation (levels/s) at (6x6, 1 box), (6x6, 3 boxes), (8x8, 2 boxes) vs
  gym-sokoban's `room_utils.generate_room` (loaded from its file: the package __init__
  needs pkg_resources). Same room size, box count, walk length int(1.7 * (rows + cols)) and
  search depth 300; a room that scores 0 counts as time spent, not as a level. Target 50x.
- FrozenLake steps/s, batch of 1024 on gymnasium's 4x4 map (slippery), vs gymnasium's
  `FrozenLake-v1` stepped one instance at a time (the unwrapped env, the faster baseline).
  Both reset every 10 turns; only executed steps are counted. Target 100x.
- One whole turn for 128 instances (parse the answer texts, step, render the texts) vs the
  plain-Python reference turn in fastpo.envs_native.python_reference, same answers, same states:
  5 turns of Sokoban (6x6, 1 box) and FrozenLake (4x4), Bandit's single turn: target 10x.
- Numba's first-call compile time in a fresh process with an empty cache, and the same
  first calls in a second process that loads the cache written by the first (cache=True).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchContext, Record, measure  # noqa: E402

PART = "envs"


def _gym_sokoban_room_utils():
    spec = importlib.util.find_spec("gym_sokoban")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("gym_sokoban (pip install --no-deps gym-sokoban==0.0.6)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "envs", "room_utils.py")
    s = importlib.util.spec_from_file_location("gym_sokoban_room_utils", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def bench_sokoban_generation(ctx: BenchContext) -> list[Record]:
    from fastpo.envs_native import make_native_env

    try:
        room_utils = _gym_sokoban_room_utils()
        missing = ""
    except Exception as e:  # e.g. an image without gym-sokoban: fastpo's figures alone
        room_utils, missing = None, f"baseline unavailable ({type(e).__name__}: {e})"
    out = []
    for size, nb in ((6, 1), (6, 3), (8, 2)):
        B = 100 if ctx.quick else 2000
        # generator="gym" runs the baseline's own search (like for like); "ragen", the default,
        # the paper environment's, timed against the same baseline figure
        fast = {}
        for generator in ("gym", "ragen"):
            env = make_native_env("sokoban", B, size=size, num_boxes=nb, search_depth=300, generator=generator)
            env.reset(np.arange(B))  # compile / load outside the timing
            offset = [0]

            def ours():
                offset[0] += B
                env.reset(np.arange(B) + offset[0])

            t, spread = measure(ours, repeats=ctx.repeats)
            fast[generator] = (B / t, B * spread / t**2)
        name = f"sokoban generation {size}x{size} {nb} box{'es' if nb > 1 else ''}"
        if room_utils is None:
            for generator, (rate, _) in fast.items():
                out.append(Record(PART, f"{name}, generator={generator}", "levels/s", rate, None, True,
                                  baseline_name="gym-sokoban generate_room", target=50.0, notes=missing))
            continue
        # gym-sokoban: time a fixed budget, count the levels it produced
        random.seed(ctx.seed)
        np.random.seed(ctx.seed)
        budget = 1.0 if ctx.quick else 8.0
        levels, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < budget or levels == 0:
            try:
                room_utils.generate_room(dim=(size, size), p_change_directions=0.35, num_steps=int(1.7 * 2 * size),
                                         num_boxes=nb)
                levels += 1
            except (RuntimeWarning, RuntimeError):  # score 0 after its 4 tries, or no room for the boxes
                pass
        base = levels / (time.perf_counter() - t0)
        for generator, (rate, rate_spread) in fast.items():
            out.append(Record(PART, f"{name}, generator={generator}", "levels/s", rate, base, True,
                              fastpo_spread=rate_spread, baseline_name="gym-sokoban generate_room", target=50.0,
                              notes=f"fastpo: batch of {B}; gym-sokoban: {levels} levels"
                                    + ("" if generator == "gym" else "; RAGEN's search (fastpo's default) against "
                                       "gym-sokoban's, which RAGEN's derives from")))
    return out


def bench_frozenlake_steps(ctx: BenchContext) -> list[Record]:
    """Steps/s counting only executed steps and timing only step calls on both sides
    (resets, which for fastpo also render B texts, are outside the clock)."""
    from fastpo.envs_native import make_native_env

    B, T = 1024, (100 if ctx.quick else 400)
    rng = np.random.default_rng(ctx.seed)
    acts = rng.integers(0, 4, size=(T, B, 1)).astype(np.int64)
    env = make_native_env("frozenlake", B, desc="4x4", is_slippery=True, max_steps=100)
    seeds = np.arange(B)
    env.reset(seeds)
    env.step(acts[0])

    def ours():
        n, spent = 0, 0.0
        for t in range(T):
            if t % 10 == 0:
                env.reset(seeds + t)
            t0 = time.perf_counter()
            res = env.step(acts[t])
            spent += time.perf_counter() - t0
            n += int(res.num_executed.sum())
        return n / spent

    reps = max(ctx.repeats, 3)
    fast = sorted(ours() for _ in range(reps))
    name, base_name = "frozenlake steps, batch 1024", "gymnasium FrozenLake-v1 (unwrapped), one instance at a time"
    try:
        import gymnasium as gym
    except ImportError as e:  # fastpo's figure alone
        return [Record(PART, name, "steps/s", fast[reps // 2], None, True, baseline_name=base_name, target=100.0,
                       notes=f"baseline unavailable ({e})")]
    genv = gym.make("FrozenLake-v1", map_name="4x4", is_slippery=True).unwrapped
    n_base = 3000 if ctx.quick else 20000
    gacts = rng.integers(0, 4, size=n_base).tolist()

    def base():
        genv.reset(seed=ctx.seed)
        spent, k = 0.0, 0
        for a in gacts:
            t0 = time.perf_counter()
            _, _, term, _, _ = genv.step(a)
            spent += time.perf_counter() - t0
            k += 1
            if term or k % 10 == 0:
                genv.reset()
        return n_base / spent

    slow = sorted(base() for _ in range(reps))
    return [Record(PART, name, "steps/s", fast[reps // 2], slow[reps // 2], True,
                   fastpo_spread=fast[-1] - fast[0], baseline_spread=slow[-1] - slow[0],
                   baseline_name=base_name, target=100.0,
                   notes=f"{T} turns of one action; both reset every 10 steps/turns, resets not timed; "
                         "done instances are not stepped and not counted")]


def _answers(name, env, rng, n_turns):
    out = []
    for _ in range(n_turns):
        turn = []
        for i in range(env.batch_size):
            names = env.action_names(i)
            k = int(rng.integers(1, 4))
            words = [names[int(rng.integers(len(names)))] for _ in range(k)]
            if rng.random() < 0.1:
                words.append("jump")
            turn.append(" || ".join(w.lower() if rng.random() < 0.3 else w for w in words))
        out.append(turn)
    return out


def bench_turn(ctx: BenchContext, name: str, config: dict, turns: int = 5, target: float = 10.0) -> Record:
    """Seconds per turn of 128 instances: K batches (different seeds) played back to back,
    `turns` turns each, the same answers for both sides. Every turn is timed on its own and
    the median over all turns of all repetitions is reported (robust to a busy machine)."""
    from fastpo.envs_native import make_native_env
    from fastpo.envs_native.python_reference import reference_envs, reference_turn

    B, M = 128, 5
    K = 4 if ctx.quick else 16
    rng = np.random.default_rng(ctx.seed)
    envs = [make_native_env(name, B, **config) for _ in range(K)]
    seeds = [np.arange(B) + k * B for k in range(K)]
    answers = []
    for env, s in zip(envs, seeds):
        env.reset(s)
        answers.append(_answers(name, env, rng, turns))
    reps = max(ctx.repeats, 3) * (2 if ctx.quick else 4)
    clock = time.perf_counter

    def time_fastpo(out):
        for env, s in zip(envs, seeds):
            env.reset(s)
        for env, ans in zip(envs, answers):
            for a in ans:
                t0 = clock()
                env.step(env.parse_actions(a, M).actions)
                env.render()
                out.append(clock() - t0)

    def time_reference(out):
        refs = []
        for env, s in zip(envs, seeds):
            env.reset(s)
            refs.append(reference_envs(env))
        for ref, ans in zip(refs, answers):
            for a in ans:
                t0 = clock()
                reference_turn(ref, a, M)
                out.append(clock() - t0)

    time_fastpo([])
    tf, tb = [], []
    for _ in range(reps):
        time_fastpo(tf)
        time_reference(tb)
    qf, qb = np.percentile(tf, [10, 50, 90]), np.percentile(tb, [10, 50, 90])
    return Record(PART, f"{name} turn (parse+step+render), 128 instances", "s/turn", float(qf[1]), float(qb[1]), False,
                  fastpo_spread=float(qf[2] - qf[0]), baseline_spread=float(qb[2] - qb[0]),
                  baseline_name="plain-Python reference turn", target=target,
                  notes=f"{K} batches x {turns} turn{'s' if turns > 1 else ''} x {reps} repetitions, up to {M} "
                        "actions per answer; median turn, spread = 90th - 10th percentile")


_COMPILE_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
from fastpo.envs_native import make_native_env
t1 = time.perf_counter()
for name in sys.argv[1].split(","):
    env = make_native_env(name, 4)
    env.reset([0, 1, 2, 3])
    env.step(env.parse_actions(["Up || Left"] * 4, 2).actions)
    env.render()
    if name == "sokoban":
        env.solve(0)
print(json.dumps({"import_s": t1 - t0, "first_calls_s": time.perf_counter() - t1}))
"""


def bench_compile(ctx: BenchContext) -> list[Record]:
    # one env is what a training run compiles (the kernels compile on first use); all three
    # when this part runs alone, FrozenLake (the default) in the full 10-minute run
    names = "bandit" if ctx.quick else ("frozenlake" if len(ctx.parts) > 1 else "frozenlake,bandit,sokoban")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        runs = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, names], env=env, capture_output=True, text=True,
                               timeout=600, encoding="utf-8")
            if r.returncode != 0:
                raise RuntimeError(f"compile-time probe failed: {r.stderr[-2000:]}")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold, warm = runs[0]["first_calls_s"], runs[1]["first_calls_s"]
    return [
        Record(PART, f"numba first-call compile ({names})", "s", cold, None, False,
               notes="fresh process, empty NUMBA_CACHE_DIR: reset+parse+step+render of each env"),
        Record(PART, f"first calls in a second process, cache=True ({names})", "s", warm, cold, False,
               baseline_name="first process (compiling)",
               notes=f"same calls, cache written by the first process; import {runs[1]['import_s']:.2f}s"),
    ]


def run(ctx: BenchContext) -> list[Record]:
    records = []
    records += bench_sokoban_generation(ctx)
    records += bench_frozenlake_steps(ctx)
    records.append(bench_turn(ctx, "sokoban", {}))
    records.append(bench_turn(ctx, "frozenlake", {}))
    records.append(bench_turn(ctx, "bandit", {}, turns=1))
    records += bench_compile(ctx)
    return records
