"""FrozenLake: transition probabilities against gymnasium's own table, map generation,
dynamics against the plain-Python reference, fixed maps, rewards and errors."""
import math
from collections import deque

import numpy as np
import pytest

from fastpo.envs_native import make_native_env
from fastpo.envs_native.frozenlake import MAPS, parse_map
from fastpo.envs_native.python_reference import RefFrozenLake, reference_envs, reference_turn

gym = pytest.importorskip("gymnasium")

_M64 = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _unxorshift(y, k):
    x = y
    for _ in range(64 // k + 1):
        x = y ^ (x >> k)
    return x


def _state_giving_uniform(m):
    """An RNG state whose next uniform draw (rng_next: state += GOLDEN, output mix64(state);
    rng_uniform: top 53 bits / 2**53) is m / 2**53: SplitMix64's output function inverted."""
    z = (m << 11) & _M64
    z = _unxorshift(z, 31)
    z = (z * pow(_M2, -1, 1 << 64)) & _M64
    z = _unxorshift(z, 27)
    z = (z * pow(_M1, -1, 1 << 64)) & _M64
    z = _unxorshift(z, 30)
    return (z - _GOLDEN) & _M64


# Each (state, action) is stepped from K draws u ~ (k + 1/2) / K, k < K, placed by setting the
# instance's RNG state. Every slip outcome takes a union of intervals of u whose ends are
# multiples of 1/24 for the success probabilities tested (1/3: thirds; 3/4: 3/4 and 7/8), so
# the share of the K draws that land on an outcome is exactly its probability: the test
# compares probabilities with gymnasium's table exactly (to float rounding), no sampling.
K = 24
DRAWS = [round((k + 0.5) / K * 2**53) for k in range(K)]  # u * 2**53, u of at most 53 bits


def test_forced_draws_come_out_as_asked():
    from fastpo.envs_native._core import rng_uniform

    state = np.array([_state_giving_uniform(m) for m in DRAWS], dtype=np.uint64)
    assert [rng_uniform(state, i) for i in range(K)] == [m / 2**53 for m in DRAWS]


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
    cells = [s for s in range(n * n) if desc.flat[s] not in (b"H", b"G")]  # gym's table is absorbing there
    B = len(cells) * 4 * K
    env = make_native_env("frozenlake", B, desc=map_name, is_slippery=slippery, success_prob=success_prob, max_steps=0)
    env.reset(np.arange(B))
    cell = np.repeat(cells, 4 * K)
    action = np.tile(np.repeat(np.arange(4), K), len(cells))
    draw = np.tile(np.arange(K), 4 * len(cells))
    env._pos[:] = cell
    env._rng[:] = np.array([_state_giving_uniform(m) for m in DRAWS], dtype=np.uint64)[draw]
    res = env.step(action[:, None].astype(np.int64))
    for i, s in enumerate(cells):
        for a in range(4):
            expected = {}
            for prob, nxt, reward, term in P[s][a]:
                e = expected.setdefault(nxt, [0.0, reward, term])
                e[0] += prob
            sel = slice((i * 4 + a) * K, (i * 4 + a + 1) * K)
            got = env._pos[sel]
            for nxt in set(expected) | set(got.tolist()):
                prob, reward, term = expected.get(nxt, (0.0, None, None))
                assert np.mean(got == nxt) == pytest.approx(prob, abs=1e-12), (map_name, s, a, nxt)
                m = got == nxt
                if m.any():
                    assert np.all(res.reward[sel][m] == reward) and np.all(res.done[sel][m] == term)
                    assert np.all(res.success[sel][m] == (reward > 0))
    assert (res.num_executed == 1).all()


@pytest.mark.parametrize("success_prob", [1.0 / 3.0, 0.75, 0.6])
def test_slip_thresholds_are_exact(success_prob):
    # the grid above pins each outcome's interval of u to 1/48; here the draws sit on either
    # side of each threshold (one 2**-53 step apart): intended below success_prob, the
    # direction counter-clockwise below success_prob + (1 - success_prob) / 2, clockwise above
    t1 = success_prob
    t2 = success_prob + (1.0 - success_prob) / 2.0
    m1, m2 = math.ceil(t1 * 2**53), math.ceil(t2 * 2**53)
    draws = [0, m1 - 1, m1, m2 - 1, m2, 2**53 - 1]
    turned = [0, 0, -1, -1, 1, 1]  # direction offset (mod 4) each draw gives
    B = 4 * len(draws)
    env = make_native_env("frozenlake", B, desc="FFF/FSF/FFG", is_slippery=True, success_prob=success_prob)
    env.reset(np.arange(B))
    env._rng[:] = [_state_giving_uniform(m) for m in draws] * 4
    env.step(np.repeat(np.arange(4), len(draws))[:, None])
    cell_of_direction = {0: 3, 1: 7, 2: 5, 3: 1}  # Left, Down, Right, Up from the centre
    expected = [cell_of_direction[(a + t) % 4] for a in range(4) for t in turned]
    assert env._pos.tolist() == expected


def test_slip_frequencies_with_real_draws():
    # the draws themselves: from state 5 of an open 3x3 map, action Down (1), 30000 instances;
    # each outcome's share has standard deviation <= 0.0029, the tolerance is 4.5 of those
    N = 30000
    env = make_native_env("frozenlake", N, desc="FFF/FSF/FFG", is_slippery=True, success_prob=0.6)
    env.reset(np.arange(N))
    env.step(np.ones((N, 1), dtype=np.int64))
    shares = {p: np.mean(env._pos == p) for p in (7, 3, 5)}  # down, left (Down - 1), right (Down + 1)
    assert set(np.unique(env._pos).tolist()) == {3, 5, 7}
    assert abs(shares[7] - 0.6) < 0.013 and abs(shares[3] - 0.2) < 0.013 and abs(shares[5] - 0.2) < 0.013


def _cells(rows, ch):
    return [(r, c) for r, row in enumerate(rows) for c, x in enumerate(row) if x == ch]


def _solvable(rows):
    """A 4-connected path over non-hole cells from S to G (breadth-first, written here)."""
    n, m = len(rows), len(rows[0])
    (start,) = _cells(rows, "S")
    queue, seen = deque([start]), {start}
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
def test_generated_maps_are_solvable_with_start_and_goal_anywhere(size, p, count):
    # RAGEN's rule (the default layout): a start and a goal on random distinct cells, a path between them
    env = make_native_env("frozenlake", count, size=size, p=p)
    obs = env.reset(np.arange(count))
    holes, starts, goals = 0, set(), set()
    for i in range(count):
        rows = env.tiles(i)
        (s,) = _cells(rows, "S")
        (g,) = _cells(rows, "G")
        assert s != g and _solvable(rows), rows
        starts.add(s)
        goals.add(g)
        holes += sum(r.count("H") for r in rows)
        assert obs[i].splitlines()[s[0]][s[1]] == "P" and obs[i].count("P") == 1
    assert len(starts) == len(goals) == size * size  # every cell serves as start and as goal
    assert holes / (count * (size * size - 2)) < (1 - p) + 0.02
    assert len(set(obs)) > count // 10  # maps differ between seeds


@pytest.mark.parametrize("size,p,count", [(4, 0.8, 2000), (6, 0.5, 500)])
def test_gymnasium_layout_keeps_the_corners(size, p, count):
    env = make_native_env("frozenlake", count, size=size, p=p, layout="gymnasium")
    obs = env.reset(np.arange(count))
    for i in range(count):
        rows = env.tiles(i)
        assert rows[0][0] == "S" and rows[-1][-1] == "G" and _solvable(rows), rows
        assert obs[i].splitlines()[0][0] == "P"


def _ragen_rule_maps(count, size, p, rng):
    """RAGEN's map rule written out here (ragen/env/frozen_lake/utils.py at 540ab84, read, not
    copied): each cell frozen with probability p, then start (row, col) and goal (row, col)
    uniform; everything redrawn while they coincide or no path joins them."""
    out = []
    while len(out) < count:
        rows = [["F" if rng.random() < p else "H" for _ in range(size)] for _ in range(size)]
        s, g = tuple(rng.integers(size, size=2)), tuple(rng.integers(size, size=2))
        if s == g:
            continue
        rows[s[0]][s[1]], rows[g[0]][g[1]] = "S", "G"
        rows = ["".join(r) for r in rows]
        if _solvable(rows):
            out.append(rows)
    return out


def _map_stats(maps):
    holes = np.mean([sum(r.count("H") for r in m) for m in maps])
    dist = np.mean([abs(s[0] - g[0]) + abs(s[1] - g[1]) for m in maps for s in _cells(m, "S") for g in _cells(m, "G")])
    corner = np.mean([_cells(m, "S")[0] in ((0, 0), (0, 3), (3, 0), (3, 3)) for m in maps])
    return holes, dist, corner


def test_default_maps_have_the_distribution_of_ragens_rule():
    # the env's maps against an independent simulation of RAGEN's rule: the mean hole count,
    # start-goal distance and share of corner starts agree within about 4 standard errors
    n = 4000
    env = make_native_env("frozenlake", n, size=4, p=0.8)
    env.reset(np.arange(n))
    ours = _map_stats([env.tiles(i) for i in range(n)])
    ref = _map_stats(_ragen_rule_maps(n, 4, 0.8, np.random.default_rng(0)))
    assert abs(ours[0] - ref[0]) < 0.08, (ours, ref)  # holes: sd ~1.3 -> se of the difference ~0.03
    assert abs(ours[1] - ref[1]) < 0.12, (ours, ref)  # distance: sd ~1.7 -> ~0.04
    assert abs(ours[2] - ref[2]) < 0.04, (ours, ref)  # corner starts: ~0.25 -> ~0.01
    assert ours[2] < 0.4  # the gymnasium layout would give 1.0


@pytest.mark.parametrize("layout", ["ragen", "gymnasium"])
def test_generation_and_dynamics_match_reference(layout):
    B = 48
    env = make_native_env("frozenlake", B, size=5, p=0.7, layout=layout)
    obs = env.reset(np.arange(B) * 7 + 1)
    for i in range(B):
        assert RefFrozenLake.generate(i * 7 + 1, size=5, p=0.7, layout=layout).render() == obs[i]
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


def _value_iteration(rows, horizon, slippery, success_prob, best=True):
    """Success probability within `horizon` actions from S, by finite-horizon value iteration
    over gymnasium's own transition table P[s][a] = [(prob, next, reward, terminated)]."""
    kw = {"success_rate": success_prob} if slippery else {}
    P = gym.make("FrozenLake-v1", desc=rows, is_slippery=slippery, **kw).unwrapped.P
    n = len(rows) * len(rows[0])
    v = [0.0] * n
    for _ in range(horizon):
        q = [[sum(pr * (rew + (0.0 if term else v[nxt])) for pr, nxt, rew, term in P[s][a]) for a in range(4)]
             for s in range(n)]
        v = [max(qs) if best else sum(qs) / 4 for qs in q]
    (s0,) = _cells(rows, "S")
    return v[s0[0] * len(rows[0]) + s0[1]]


@pytest.mark.parametrize("layout,slippery,success_prob,horizon", [
    ("ragen", True, 1 / 3, 10), ("gymnasium", True, 1 / 3, 10), ("ragen", True, 0.8, 4), ("ragen", False, 1.0, 3)])
def test_optimal_and_random_success_match_an_independent_value_iteration(layout, slippery, success_prob, horizon):
    seeds = list(range(100, 124))
    kw = dict(layout=layout, is_slippery=slippery, success_prob=success_prob)
    env = make_native_env("frozenlake", len(seeds), **kw)
    env.reset(seeds)
    best = make_native_env("frozenlake", 1, **kw).optimal_success(seeds, horizon)  # another env: any count of seeds
    rand = make_native_env("frozenlake", 1, **kw).random_success(np.array(seeds), horizon)
    assert best.shape == rand.shape == (len(seeds),)
    for i in range(len(seeds)):
        rows = env.tiles(i)
        assert best[i] == pytest.approx(_value_iteration(rows, horizon, slippery, success_prob), abs=1e-12)
        assert rand[i] == pytest.approx(_value_iteration(rows, horizon, slippery, success_prob, best=False), abs=1e-12)
    assert (rand <= best + 1e-12).all() and best.max() > 0
    if not slippery:
        assert set(best.tolist()) <= {0.0, 1.0}  # deterministic: reachable within the horizon or not


def test_policy_success_evaluates_a_given_stochastic_policy():
    """policy_success: the uniform policy is random_success and the one-hot optimal table
    optimal_success; a fixed stochastic policy on a 3x3 map
    (slippery) matches 20,000 played episodes within 4 SE; bad tables are refused by name."""
    seeds, h = list(range(100, 124)), 10
    env = make_native_env("frozenlake", len(seeds))
    env.reset(seeds)
    n = env.size[0] * env.size[1]
    np.testing.assert_allclose(env.policy_success(np.full((len(seeds), h + 1, n, 4), 0.25)),
                               env.random_success(seeds, h), rtol=0, atol=1e-12)
    table = env.optimal_policy(h).astype(np.int64)
    onehot = np.zeros(table.shape + (4,))
    np.put_along_axis(onehot, table[..., None], 1.0, axis=-1)
    np.testing.assert_allclose(env.policy_success(onehot), env.optimal_success(seeds, h), rtol=0, atol=1e-12)

    N, probs = 20000, np.array([0.1, 0.4, 0.4, 0.1])  # Left, Down, Right, Up in every cell
    played = make_native_env("frozenlake", N, desc="SFF/FHF/FFG")
    played.reset(np.arange(N))  # one map, each instance its own slips
    exact = played.policy_success(np.broadcast_to(probs, (N, h + 1, 9, 4)))
    assert np.ptp(exact) == 0 and 0.05 < exact[0] < 0.95
    rng = np.random.default_rng(0)
    for _ in range(h):
        actions = rng.choice(4, size=N, p=probs)
        played.step(actions[:, None], active=~played.done)
    got = played.success.mean()
    assert abs(got - exact[0]) < 4 * math.sqrt(exact[0] * (1 - exact[0]) / N), (got, exact[0])

    with pytest.raises(ValueError, match=r"pi of shape \(24, 11, 16\)"):
        env.policy_success(np.full((len(seeds), h + 1, n), 0.25))
    bad = np.full((len(seeds), h + 1, n, 4), 0.25)
    bad[3, 2, 5, 0] = 0.5
    with pytest.raises(ValueError, match=r"pi\[3, 2, 5\] sums to 1.25, not 1"):
        env.policy_success(bad)
    bad[3, 2, 5, 0] = -0.25
    with pytest.raises(ValueError, match=r"pi\[3, 2, 5, 0\] = -0.25: must be finite and >= 0"):
        env.policy_success(bad)
    bad[3, 2, 5, 0] = np.nan
    with pytest.raises(ValueError, match=r"pi\[3, 2, 5, 0\] = nan"):
        env.policy_success(bad)
    with pytest.raises(RuntimeError):
        make_native_env("frozenlake", 1).policy_success(np.full((1, 2, 16, 4), 0.25))


def _shortest_path(rows) -> int:
    """Moves from S to G over frozen cells (breadth-first), -1 when there is no route."""
    R, C = len(rows), len(rows[0])
    (start,) = _cells(rows, "S")
    dist, todo = {start: 0}, deque([start])
    while todo:
        r, c = todo.popleft()
        if rows[r][c] == "G":
            return dist[(r, c)]
        for dr, dc in ((0, -1), (1, 0), (0, 1), (-1, 0)):
            nr, nc = r + dr, c + dc
            if 0 <= nr < R and 0 <= nc < C and rows[nr][nc] != "H" and (nr, nc) not in dist:
                dist[(nr, nc)] = dist[(r, c)] + 1
                todo.append((nr, nc))
    return -1


def test_expert_without_slip_walks_a_shortest_path():
    """Without slip every action that still reaches the goal in time has success 1; the expert
    (`optimal_policy`) takes the shortest route among them, not the lowest action id (which
    bumped into walls until the last moment: 8.96 turns a level on seeds 0..767, where the
    shortest routes average 2.70)."""
    n, h = 300, 10
    env = make_native_env("frozenlake", n, is_slippery=False)
    env.reset(np.arange(n))
    want = np.array([_shortest_path(env.tiles(i)) for i in range(n)])
    table = env.optimal_policy(h)
    steps = np.zeros(n, dtype=np.int64)
    for k in range(h, 0, -1):
        active = ~env.done
        steps += active
        env.step(table[np.arange(n), k, env.positions()].astype(np.int64)[:, None], active=active)
    reach = (want >= 0) & (want <= h)
    assert reach.mean() > 0.9 and env.success[reach].all()
    assert (steps[reach] == want[reach]).all()


def test_success_bounds_on_a_hand_map_and_the_step_cap():
    # S G on one row, no slip: Right reaches the goal in one action
    env = make_native_env("frozenlake", 1, desc="SG", is_slippery=False)
    assert env.optimal_success([0], 1).tolist() == [1.0]
    assert env.random_success([0], 1).tolist() == [0.25]
    assert env.random_success([0], 2).tolist() == [1 - 0.75**2]  # Left/Down/Up stay put
    # 1x3 S F G, slippery 1/3: the goal is two cells away; max_steps=1 caps any horizon at 1
    capped = make_native_env("frozenlake", 1, desc="SFG", max_steps=1)
    assert capped.optimal_success([0], 10).tolist() == [0.0]


def test_paper_frozenlake_ceiling_ragen_maps_versus_the_corners():
    # the figures: 10 actions, slip 1/3, the 256 eval seeds; an optimal policy succeeds
    # on about half of RAGEN-style maps and about a tenth with gymnasium's corners
    seeds = range(1_000_000, 1_000_256)
    ragen = make_native_env("frozenlake", 1).optimal_success(seeds, 10).mean()
    corners = make_native_env("frozenlake", 1, layout="gymnasium").optimal_success(seeds, 10).mean()
    assert 0.4 < ragen < 0.6 and 0.05 < corners < 0.15, (ragen, corners)


@pytest.mark.parametrize("seeds,horizon,exc,word", [
    ([1, 2], 0, ValueError, "horizon"), ([1], 2.5, ValueError, "horizon"), ([1], True, ValueError, "horizon"),
    (5, 3, TypeError, "seeds"), ("12", 3, TypeError, "seeds"), ({1, 2}, 3, TypeError, "seeds"),
    ([], 3, ValueError, "seeds"), ([1.5], 3, TypeError, "seeds"), ([-1], 3, ValueError, "seeds"),
])
@pytest.mark.parametrize("name", ["frozenlake", "sokoban", "bandit"])
def test_success_bounds_refuse_bad_arguments(name, seeds, horizon, exc, word):
    env = make_native_env(name, 1)
    for fn in (env.optimal_success, env.random_success):
        with pytest.raises(exc, match=word):
            fn(seeds, horizon)


def test_fixed_map_in_gymnasium_notation():
    env = make_native_env("frozenlake", 3, desc="SFFF/FHFH/FFFH/HFFG", is_slippery=False)
    obs = env.reset([0, 1, 2])
    assert obs[0] == obs[2] == "P___\n_O_O\n___O\nO__G"
    assert env.tiles(1) == MAPS["4x4"]
    grid, start = parse_map(["FFS", "HFG"])
    assert start == 2 and grid.shape == (2, 3)


def test_goal_hole_rewards_and_symbols():
    env = make_native_env("frozenlake", 2, desc=["SH", "FG"], is_slippery=False, symbols={"player_on_goal": "*"})
    env.reset([0, 1])
    res = env.step(np.array([[2, -1], [1, 2]]))  # Right into the hole; Down then Right to the goal
    assert res.reward.tolist() == [0.0, 1.0]
    assert res.done.tolist() == [True, True] and res.success.tolist() == [False, True]
    assert res.num_executed.tolist() == [1, 2]
    assert env.render() == ["_X\n_G", "_O\n_*"]
    again = env.step(np.array([[0], [0]]))  # done instances are not stepped
    assert again.reward.tolist() == [0.0, 0.0] and again.num_executed.tolist() == [0, 0]


def test_max_steps_truncates_and_moves_off_grid_are_not_effective():
    env = make_native_env("frozenlake", 1, desc="SFF/FFF/FFG", is_slippery=False, max_steps=3)
    env.reset([0])
    res = env.step(np.array([[0, 3, 2, 2]]))  # Left, Up hit the edge; Right moves; the cap ends it
    assert res.valid.tolist() == [[True, True, True, False]]
    assert res.effective.tolist() == [[False, False, True, False]]
    assert res.done[0] and not res.success[0] and env.truncated[0]


def test_active_mask():
    env = make_native_env("frozenlake", 2, desc="SFF/FFF/FFG", is_slippery=False)
    env.reset([0, 0])
    res = env.step(np.array([[2], [2]]), active=np.array([True, False]))
    assert res.num_executed.tolist() == [1, 0]
    assert env.render() == ["_P_\n___\n__G", "P__\n___\n__G"]


@pytest.mark.parametrize("kwargs,word", [
    ({"size": 1}, "size"), ({"p": 0.0}, "p"), ({"p": 1.5}, "p"), ({"success_prob": -0.1}, "success_prob"),
    ({"max_steps": -1}, "max_steps"), ({"desc": "SFX/FFG"}, "'X'"), ({"desc": "FF/FG"}, "start"),
    ({"desc": "SF/FF"}, "goal"), ({"desc": "SFF/FG"}, "length"), ({"symbols": {"hole": "OO"}}, "hole"),
    ({"symbols": {"lava": "L"}}, "lava"), ({"colour": 1}, "colour"), ({"layout": "corners"}, "layout"),
])
def test_bad_config_is_a_value_error_naming_it(kwargs, word):
    with pytest.raises(ValueError, match=word):
        make_native_env("frozenlake", 2, **kwargs)
