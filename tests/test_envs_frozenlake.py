"""FrozenLake: transition probabilities against gymnasium's own table, map generation,
dynamics against the plain-Python reference, fixed maps, rewards and errors."""
from collections import deque

import numpy as np
import pytest

from fastpo.envs_native import make_env
from fastpo.envs_native.frozenlake import MAPS, parse_map
from fastpo.envs_native.reference import RefFrozenLake, reference_envs, reference_turn

gym = pytest.importorskip("gymnasium")

# Samples per (state, action). The empirical frequency of an outcome with probability p has
# standard deviation sqrt(p(1-p)/N) <= 0.0079 for N = 4000; TOL is about 5 of those, and the
# seeds are fixed, so the test is deterministic.
N_SAMPLES = 4000
TOL = 0.04


def _gym_table(map_name, **kw):
    env = gym.make("FrozenLake-v1", map_name=map_name, **kw)
    return env.unwrapped.P, env.unwrapped.desc


@pytest.mark.parametrize("map_name", ["4x4", "8x8"])
@pytest.mark.parametrize("slippery,success_prob", [(True, 1.0 / 3.0), (True, 0.75), (False, 1.0)])
def test_transition_probabilities_match_gymnasium(map_name, slippery, success_prob):
    if slippery:
        P, desc = _gym_table(map_name, is_slippery=True, success_rate=success_prob)
    else:
        P, desc = _gym_table(map_name, is_slippery=False)
    n = len(MAPS[map_name])
    N = N_SAMPLES if slippery else 8
    env = make_env("frozenlake", 4 * N, desc=map_name, is_slippery=slippery, success_prob=success_prob, max_steps=0)
    actions = np.repeat(np.arange(4, dtype=np.int64), N)[:, None]
    checked = 0
    for s in range(n * n):
        if desc.flat[s] in (b"H", b"G"):
            continue  # terminal: gymnasium's table is absorbing there, ours does not step
        env.reset(np.arange(4 * N) + 100_003 * s)
        env._pos[:] = s
        res = env.step(actions)
        for a in range(4):
            expected = {}
            for prob, nxt, reward, term in P[s][a]:
                if prob > 0:
                    e = expected.setdefault(nxt, [0.0, reward, term])
                    e[0] += prob
            sel = slice(a * N, (a + 1) * N)
            got_pos = env._pos[sel]
            outcomes, counts = np.unique(got_pos, return_counts=True)
            assert set(outcomes.tolist()) == set(expected), (s, a, outcomes, expected)
            for nxt, cnt in zip(outcomes.tolist(), counts.tolist()):
                prob, reward, term = expected[nxt]
                assert abs(cnt / N - prob) < TOL, (map_name, s, a, nxt, cnt / N, prob)
                m = got_pos == nxt
                assert np.all(res.reward[sel][m] == reward)
                assert np.all(res.done[sel][m] == term)
                assert np.all(res.success[sel][m] == (reward > 0))
            checked += 1
    assert checked > 0


def _solvable(rows):
    n, m = len(rows), len(rows[0])
    queue, seen = deque([(0, 0)]), {(0, 0)}
    while queue:
        r, c = queue.popleft()
        if rows[r][c] == "G":
            return True
        for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= rr < n and 0 <= cc < m and (rr, cc) not in seen and rows[rr][cc] != "H":
                seen.add((rr, cc))
                queue.append((rr, cc))
    return False


@pytest.mark.parametrize("size,p,count", [(4, 0.8, 2000), (8, 0.8, 500), (6, 0.5, 500)])
def test_generated_maps_are_solvable(size, p, count):
    env = make_env("frozenlake", count, size=size, p=p)
    obs = env.reset(np.arange(count))
    holes = 0
    for i in range(count):
        rows = env.tiles(i)
        assert rows[0][0] == "S" and rows[-1][-1] == "G"
        assert _solvable(rows), rows
        holes += sum(r.count("H") for r in rows)
        assert obs[i].splitlines()[0][0] == "P"
    # conditioning on solvability lowers the hole rate somewhat, never raises it
    assert holes / (count * (size * size - 2)) < (1 - p) + 0.02
    assert len(set(obs)) > count // 10  # maps differ between seeds


def test_generation_and_dynamics_match_reference():
    B = 48
    env = make_env("frozenlake", B, size=5, p=0.7)
    obs = env.reset(np.arange(B) * 7 + 1)
    for i in range(B):
        assert RefFrozenLake.generate(i * 7 + 1, size=5, p=0.7).render() == obs[i]
    refs = reference_envs(env)
    rng = np.random.default_rng(0)
    names = ["Left", "down", "RIGHT", " Up ", "jump"]
    for _ in range(12):
        answers = [" || ".join(rng.choice(names, size=rng.integers(0, 5))) for _ in range(B)]
        res = env.step(env.parse_actions(answers, 3).actions)
        ref_obs, ref_rew, ref_done = reference_turn(refs, answers, 3)
        assert env.render() == ref_obs
        np.testing.assert_allclose(res.reward, ref_rew)
        assert res.done.tolist() == ref_done
    assert env.done.any()


def test_fixed_map_in_gymnasium_notation():
    env = make_env("frozenlake", 3, desc="SFFF/FHFH/FFFH/HFFG", is_slippery=False)
    obs = env.reset([0, 1, 2])
    assert obs[0] == obs[2] == "P___\n_O_O\n___O\nO__G"
    assert env.tiles(1) == MAPS["4x4"]
    grid, start = parse_map(["FFS", "HFG"])
    assert start == 2 and grid.shape == (2, 3)


def test_goal_hole_rewards_and_symbols():
    env = make_env("frozenlake", 2, desc=["SH", "FG"], is_slippery=False, symbols={"player_on_goal": "*"})
    env.reset([0, 1])
    res = env.step(np.array([[2, -1], [1, 2]]))  # Right into the hole; Down then Right to the goal
    assert res.reward.tolist() == [0.0, 1.0]
    assert res.done.tolist() == [True, True] and res.success.tolist() == [False, True]
    assert res.num_executed.tolist() == [1, 2]
    assert env.render() == ["_X\n_G", "_O\n_*"]
    again = env.step(np.array([[0], [0]]))  # done instances are not stepped
    assert again.reward.tolist() == [0.0, 0.0] and again.num_executed.tolist() == [0, 0]


def test_max_steps_truncates_and_moves_off_grid_are_not_effective():
    env = make_env("frozenlake", 1, desc="SFF/FFF/FFG", is_slippery=False, max_steps=3)
    env.reset([0])
    res = env.step(np.array([[0, 3, 2, 2]]))  # Left, Up hit the edge; Right moves; the cap ends it
    assert res.valid.tolist() == [[True, True, True, False]]
    assert res.effective.tolist() == [[False, False, True, False]]
    assert res.done[0] and not res.success[0] and env.truncated[0]


def test_active_mask():
    env = make_env("frozenlake", 2, desc="SFF/FFF/FFG", is_slippery=False)
    env.reset([0, 0])
    res = env.step(np.array([[2], [2]]), active=np.array([True, False]))
    assert res.num_executed.tolist() == [1, 0]
    assert env.render() == ["_P_\n___\n__G", "P__\n___\n__G"]


@pytest.mark.parametrize("kwargs,word", [
    ({"size": 1}, "size"), ({"p": 0.0}, "p"), ({"p": 1.5}, "p"), ({"success_prob": -0.1}, "success_prob"),
    ({"max_steps": -1}, "max_steps"), ({"desc": "SFX/FFG"}, "'X'"), ({"desc": "FF/FG"}, "start"),
    ({"desc": "SF/FF"}, "goal"), ({"desc": "SFF/FG"}, "length"), ({"symbols": {"hole": "OO"}}, "hole"),
    ({"symbols": {"lava": "L"}}, "lava"), ({"colour": 1}, "colour"),
])
def test_bad_config_is_a_value_error_naming_it(kwargs, word):
    with pytest.raises(ValueError, match=word):
        make_env("frozenlake", 2, **kwargs)
