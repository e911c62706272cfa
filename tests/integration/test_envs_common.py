"""What every environment shares: determinism across batch sizes, positions and
PYTHONHASHSEED, the step API's shapes and masks, make_native_env errors, the gymnasium wrapper,
and a cheap import."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fastpo.envs_native import ENV_NAMES, make_native_env

CONFIGS = {"bandit": {}, "sokoban": {"size": 7, "num_boxes": 2}, "frozenlake": {"size": 5}}


def _trajectory(name, seeds, turns=4):
    """Observations and rewards of a fixed action schedule, per instance."""
    env = make_native_env(name, len(seeds), **CONFIGS[name])
    obs = [env.reset(seeds)]
    rewards = []
    B = len(seeds)
    for t in range(turns):
        acts = (np.arange(3)[None, :] + t + np.asarray(seeds)[:, None]) % 2 if name == "bandit" else \
            (np.arange(3)[None, :] * (t + 1) + np.asarray(seeds)[:, None]) % 4
        res = env.step(acts.astype(np.int64))
        obs.append(env.render())
        rewards.append(res.reward.tolist())
    return [[o[i] for o in obs] for i in range(B)], [[r[i] for r in rewards] for i in range(B)]


@pytest.mark.parametrize("name", ENV_NAMES)
def test_same_seed_same_instance_whatever_batch_size_or_position(name):
    seeds = [11, 3, 2**40 + 5, 0, 7, 3, 99]
    obs, rew = _trajectory(name, seeds)
    for pos, s in enumerate(seeds):
        alone_obs, alone_rew = _trajectory(name, [s])
        assert obs[pos] == alone_obs[0] and rew[pos] == alone_rew[0]
    assert obs[1] == obs[5]  # the same seed twice in one batch
    rev_obs, rev_rew = _trajectory(name, seeds[::-1])
    assert rev_obs[::-1] == obs and rev_rew[::-1] == rew


def test_streams_of_nearby_seeds_are_disjoint_and_match_the_reference():
    """A state derived as seed * GOLDEN + salt made seed s+1's stream seed s's stream shifted
    by one draw; every draw of 2000 nearby seeds' streams must be distinct instead."""
    from fastpo.envs_native._core import rng_next, rng_seed_all
    from fastpo.envs_native.python_reference import SplitMix64

    seeds = np.concatenate([np.arange(1000), 2**40 + np.arange(1000)]).astype(np.uint64)
    for salt in (0xF20, 0x50C0BA, 0xBA4D17):
        state = np.zeros(seeds.shape[0], dtype=np.uint64)
        rng_seed_all(seeds, salt, state)
        draws = np.array([[rng_next(state, b) for _ in range(16)] for b in range(seeds.shape[0])], dtype=np.uint64)
        assert np.unique(draws).size == draws.size
        for b in (0, 1, 999, 1000, 1999):
            ref = SplitMix64(int(seeds[b]), salt)
            assert [ref.next() for _ in range(16)] == draws[b].tolist()


def test_frozenlake_maps_of_neighbouring_seeds_are_not_shifted_copies():
    # with shifted streams, 329 of 399 consecutive 4x4 maps were map s shifted by one cell
    N = 400
    env = make_native_env("frozenlake", N, size=4, p=0.8)
    env.reset(np.arange(N))
    cells = np.array([list("".join(env.tiles(i))) for i in range(N)])

    def shifted(a, b):  # cells 1..13 of map b are cells 2..14 of map a (0 and 15 are S and G)
        return bool((cells[b, 1:14] == cells[a, 2:15]).all())

    neighbours = sum(shifted(s, s + 1) for s in range(N - 1))
    perm = np.random.default_rng(0).permutation(N)
    random_pairs = sum(shifted(s, perm[s]) for s in range(N) if perm[s] != s)
    # independent maps agree on 13 cells by chance ~0.7**13, i.e. a few pairs in 400
    assert neighbours <= random_pairs + 10, (neighbours, random_pairs)


def test_bandit_draws_of_neighbouring_seeds_are_independent():
    # with shifted streams, pair(s + 1) % 2 equalled swapped(s) for every seed
    B = 2000
    env = make_native_env("bandit", B)
    env.reset(np.arange(B))
    pair, swapped = env._pair, env._swapped
    agree = np.mean(pair[1:] % 2 == swapped[:-1])
    same_swap = np.mean(swapped[1:] == swapped[:-1])
    same_pair = np.mean(pair[1:] == pair[:-1])
    # 0.5 (0.1 for one of 10 pairs) +- 4.5 standard deviations of a mean of 1999 draws
    assert abs(agree - 0.5) < 0.05 and abs(same_swap - 0.5) < 0.05 and abs(same_pair - 0.1) < 0.03


_SCRIPT = """
import json, sys
from fastpo.envs_native import make_native_env
out = {}
for name, cfg in json.loads(sys.argv[1]).items():
    env = make_native_env(name, 6, **cfg)
    out[name] = env.reset([0, 1, 2, 3, 4, 5])
print(json.dumps(out))
"""


def test_same_instances_whatever_pythonhashseed():
    outs = []
    for hs in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=hs)
        r = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CONFIGS)], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1]
    for name in ENV_NAMES:
        env = make_native_env(name, 6, **CONFIGS[name])
        assert env.reset(range(6)) == outs[0][name]


_CACHE_SCRIPT = """
import json
from numba.core.dispatcher import Dispatcher
from fastpo.envs_native import make_native_env, _core, bandit, frozenlake, sokoban
for name in ("bandit", "frozenlake", "sokoban"):
    env = make_native_env(name, 2)
    env.reset([0, 1])
    env.step(env.parse_actions(["Up || Left", "x"], 2).actions)
    env.render()
misses, hits = [], 0
for mod in (_core, bandit, frozenlake, sokoban):
    for k, v in vars(mod).items():
        if isinstance(v, Dispatcher) and v.signatures:
            misses += [k] * sum(v.stats.cache_misses.values())
            hits += sum(v.stats.cache_hits.values())
print(json.dumps([misses, hits]))
"""


def test_compiled_functions_come_from_the_cache_in_a_second_process():
    # the first process (compiling, writing the cache) may be this one or an earlier one
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        misses, hits = json.loads(r.stdout.strip().splitlines()[-1])
        if not misses:
            break
    assert misses == [] and hits >= 8


def test_import_is_cheap():
    code = "import sys, fastpo.envs_native; print(sorted(m for m in ('torch', 'transformers', 'gymnasium') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ENV_NAMES)
def test_step_api_shapes_and_masks(name):
    env = make_native_env(name, 3, **CONFIGS[name])
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros((3, 1), dtype=np.int64))
    env.reset([1, 2, 3])
    res = env.step(np.array([[-1, 0, 9], [-1, -1, -1], [0, -1, 1]]), active=np.array([True, True, False]))
    assert res.reward.dtype == np.float32 and res.reward.shape == (3,)
    assert res.done.dtype == np.bool_ and res.success.dtype == np.bool_ and res.num_executed.dtype == np.int32
    assert res.valid.shape == res.effective.shape == (3, 3)
    assert res.valid.tolist() == [[False, True, False], [False, False, False], [False, False, False]]
    assert res.num_executed.tolist() == [1, 0, 0] and res.reward[1] == res.reward[2] == 0
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros((2, 1), dtype=np.int64))
    with pytest.raises(TypeError, match="integer"):
        env.step(np.zeros((3, 1)))
    with pytest.raises(ValueError, match="active"):
        env.step(np.zeros((3, 1), dtype=np.int64), active=np.ones(2, dtype=bool))
    with pytest.raises(ValueError, match="seeds"):
        env.reset([1, 2])
    with pytest.raises(ValueError, match="non-negative"):
        env.reset([1, -2, 3])
    with pytest.raises(TypeError, match="integers"):
        env.reset([1.5, 2, 3])
    with pytest.raises(ValueError, match="instance index"):
        env.action_names(3)
    assert len(env.instructions()) == 3 and all(isinstance(t, str) and t for t in env.instructions())
    for i in range(3):
        for a in env.action_names(i):
            assert a in env.instructions()[i]
    assert env.batch_size == 3


def test_make_env_errors():
    with pytest.raises(ValueError, match="'chess'"):
        make_native_env("chess", 2)
    with pytest.raises(ValueError, match="'sizee'"):
        make_native_env("sokoban", 2, sizee=6)
    with pytest.raises(ValueError, match="batch_size"):
        make_native_env("bandit", 0)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_gymnasium_wrapper(name):
    gym = pytest.importorskip("gymnasium")
    from gymnasium.utils.env_checker import check_env

    from fastpo.envs_native.gym_registration import GYM_IDS

    env = gym.make(GYM_IDS[name], **CONFIGS[name])
    check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=4)
    batched = make_native_env(name, 5, **CONFIGS[name])
    assert batched.reset([0, 1, 2, 3, 4])[4] == obs
    assert info["action_names"] == batched.action_names(4)
    assert env.observation_space.contains(obs)
    obs2, reward, terminated, truncated, info = env.step(1)
    res = batched.step(np.array([[0], [0], [0], [0], [1]]))
    assert obs2 == batched.render()[4] and reward == pytest.approx(float(res.reward[4]))
    assert env.observation_space.contains(obs2) and isinstance(info["success"], bool)
    with pytest.raises(ValueError):
        env.step(7)


def test_the_built_in_games_declare_an_expert_as_user_games_do():
    """Issue 57: the built-in games had no `expert()` (SFT branched on their names); each now
    declares one on its class, found as a user game's is (`fastpo.envs.has_expert`), and the
    batched protocol asks it (`expert_answers`): Sokoban's shortest solution from the current
    state, FrozenLake's optimal move at the current cell for the actions left (one move: the
    ice decides where it lands), the Bandit's better arm."""
    from fastpo.envs import has_expert

    for name in ENV_NAMES:
        assert has_expert(name) and callable(getattr(make_native_env(name, 1, **CONFIGS[name]), "expert", None)), name
    assert has_expert("examples.guess_number:GuessNumber") and has_expert("probe:choice")
    seeds = list(range(6))
    env = make_native_env("sokoban", 6)
    env.reset(seeds)
    left = np.full(6, 10)
    plans = env.expert_answers(range(6), left)
    assert plans == [env.solve(b) for b in range(6)] and all(plans)
    env.step(np.array([[env.action_names(b).index(p[0])] for b, p in enumerate(plans)]))  # one move along it
    assert [len(p) for p in env.expert_answers(range(6), left)] == [len(p) - 1 for p in plans]
    for b, plan in enumerate(plans):  # played to the end, the plan solves the level
        for move in plan[1:]:
            acts = np.full((6, 1), -1)
            acts[b, 0] = env.action_names(b).index(move)
            env.step(acts)
    assert env.success.all()
    fl = make_native_env("frozenlake", 6)
    fl.reset(seeds)
    table = fl.optimal_policy(10)
    for k in (10, 3, 1):
        want = [[fl.action_names(b)[int(table[b, k, fl.positions()[b]])]] for b in range(6)]
        assert fl.expert_answers(range(6), np.full(6, k)) == want
    assert fl.expert_moves_per_turn == 1 and env.expert_moves_per_turn is None
    bandit = make_native_env("bandit", 6, low_reward=0.5)  # the low-risk arm is the better one here
    bandit.reset(seeds)
    assert bandit.expert_answers(range(6), np.ones(6)) == [[bandit.action_names(b)[1 - int(h)]]
                                                           for b, h in enumerate(bandit.high_risk_action())]
    with pytest.raises(RuntimeError):
        make_native_env("frozenlake", 1).expert_answers([0], [3])  # before the first reset
