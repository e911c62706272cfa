"""Sokoban: hand-made rule cases, generated levels solvable within max_steps, the BFS solver
against an independent search, XSB round trip and errors, dynamics against the reference."""
import importlib.util
import os
from collections import deque

import numpy as np
import pytest

from fastpo.envs_native import make_native_env
from fastpo.envs_native.python_reference import RefSokoban, reference_envs, reference_turn, reverse_search
from fastpo.envs_native.sokoban import (ACTIONS, FLOOR, GENERATORS, TARGET, WALL, SokobanLevel, _reverse_search,
                                        _table_size, parse_xsb, solve_level, to_xsb)

UP, DOWN, LEFT, RIGHT = range(4)


def _env(xsb, **kw):
    env = make_native_env("sokoban", 1, levels=xsb, **kw)
    env.reset([0])
    return env


def _step(env, *actions):
    return env.step(np.array([list(actions)], dtype=np.int64))


def test_push_into_wall_and_solved_bonus():
    env = _env("######\n#@$ .#\n######")
    res = _step(env, LEFT)  # walks into the wall: a step, no change
    assert res.reward[0] == pytest.approx(-0.1) and not res.effective[0, 0] and res.valid[0, 0]
    res = _step(env, RIGHT)  # pushes the box onto floor
    assert res.reward[0] == pytest.approx(-0.1) and res.effective[0, 0]
    assert env.render() == ["######\n#_PXO#\n######"]
    res = _step(env, RIGHT, LEFT, LEFT)  # box onto the last target: +1 and +10; stops there
    assert res.reward[0] == pytest.approx(-0.1 + 1 + 10)
    assert res.done[0] and res.success[0] and not env.truncated[0]
    assert res.num_executed[0] == 1 and res.valid[0].tolist() == [True, False, False]
    assert env.render() == ["######\n#__P√#\n######"]


def test_push_box_into_box_and_box_against_wall():
    # a refused push is a step (-0.1, valid) that changes nothing and does not end the episode
    env = _env("#######\n#@$$ .#\n#    .#\n#######")
    before = env.render()
    res = _step(env, RIGHT)
    assert res.reward[0] == pytest.approx(-0.1) and res.valid[0, 0] and not res.effective[0, 0]
    assert env.render() == before and not res.done[0]
    env = _env("#####\n#@ $#\n#.  #\n#####")
    assert _step(env, RIGHT).effective[0, 0]  # up to the box, which stands against the wall
    before = env.render()
    res = _step(env, RIGHT, RIGHT)  # pushing it into the wall, twice
    assert res.reward[0] == pytest.approx(-0.2) and res.valid[0].tolist() == [True, True]
    assert res.effective[0].tolist() == [False, False] and res.num_executed[0] == 2
    assert env.render() == before == ["#####\n#_PX#\n#O__#\n#####"] and not res.done[0]


def test_box_onto_and_off_target():
    env = _env("#######\n#@$. .#\n#   $ #\n#######")
    res = _step(env, RIGHT)
    assert res.reward[0] == pytest.approx(-0.1 + 1.0) and not res.done[0]
    assert env.render()[0].splitlines()[1] == "#_P√_O#"
    res = _step(env, RIGHT)
    assert res.reward[0] == pytest.approx(-0.1 - 1.0)
    assert env.render()[0].splitlines()[1] == "#__SXO#"


def test_max_steps_truncates():
    env = _env("######\n#@$ .#\n######", max_steps=3)
    res = _step(env, LEFT, LEFT)
    assert not res.done[0]
    res = _step(env, LEFT, LEFT)
    assert res.num_executed[0] == 1 and res.done[0] and not res.success[0] and env.truncated[0]
    res = _step(env, RIGHT)
    assert res.num_executed[0] == 0 and res.reward[0] == 0.0


def _python_bfs(level):
    """Independent shortest-solution search on RefSokoban (returns the length or None)."""
    R, C = level.shape
    walls = {(r, c) for r in range(R) for c in range(C) if level.tiles[r, c] in (WALL, 3)}
    targets = frozenset((r, c) for r in range(R) for c in range(C) if level.tiles[r, c] == TARGET)
    start = (tuple(level.player), frozenset(map(tuple, np.argwhere(level.boxes).tolist())))
    seen, queue = {start}, deque([(start, 0)])
    while queue:
        (player, boxes), d = queue.popleft()
        if boxes == targets:
            return d
        for a in range(4):
            ref = RefSokoban((R, C), walls, targets, boxes, player, max_steps=0)
            ref.step(a)
            key = (ref.player, frozenset(ref.boxes))
            if key not in seen:
                seen.add(key)
                queue.append((key, d + 1))
    return None


@pytest.mark.parametrize("size,num_boxes,count", [(6, 1, 300), (8, 2, 60), (6, 3, 20)])
def test_generated_levels_are_solvable_within_max_steps(size, num_boxes, count):
    env = make_native_env("sokoban", count, size=size, num_boxes=num_boxes)
    obs = env.reset(np.arange(count) + 1000)
    lengths = []
    for i in range(count):
        lv = env.level(i)
        assert lv.num_boxes == num_boxes == int((lv.tiles == TARGET).sum())
        assert not (lv.boxes & (lv.tiles == TARGET)).any()  # no box starts on a target
        assert (lv.tiles[[0, -1], :] == WALL).all() and (lv.tiles[:, [0, -1]] == WALL).all()
        sol = env.solve(i)
        assert sol is not None and 0 < len(sol) <= env.max_steps, (obs[i], sol)
        lengths.append(len(sol))
    # play every solution in the batched env: all solved, with the solved bonus
    answers = [" || ".join(env.solve(i)) for i in range(count)]
    res = env.step(env.parse_actions(answers, max(lengths)).actions)
    assert res.success.all()
    # boxes start off their targets and end on them: net +1 per box, +10 once, -0.1 per move
    np.testing.assert_allclose(res.reward, 10.0 + num_boxes - 0.1 * np.array(lengths), atol=1e-4)
    assert len(set(obs)) > count // 3  # levels differ between seeds


# ---------------------------------------------------------------------------------------
# The reverse-play search itself, on fixed rooms: "#" wall, "." target (a box starts on
# it), "@" the player, " " floor.
# ---------------------------------------------------------------------------------------
FIXED_ROOMS = [
    ["#######", "#     #", "#     #", "#  .@ #", "#     #", "#     #", "#######"],
    ["#######", "#     #", "# .#. #", "#  @  #", "#     #", "#######"],
    ["#######", "##   ##", "#  .  #", "# .#@ #", "#   . #", "#######"],
    ["########", "#   #  #", "# .   .#", "#  @## #", "#      #", "########"],
]


def _random_room(rng, rows, cols, nb):
    while True:
        grid = [["#"] * cols for _ in range(rows)]
        cells = [(r, c) for r in range(1, rows - 1) for c in range(1, cols - 1) if rng.random() > 0.2]
        if len(cells) >= nb + 2:
            break
    order = rng.permutation(len(cells))
    for i, j in enumerate(order):
        r, c = cells[j]
        grid[r][c] = "." if i < nb else ("@" if i == nb else " ")
    return ["".join(r) for r in grid]


def _cells(room, ch):
    return [(r, c) for r, row in enumerate(room) for c, x in enumerate(row) if x == ch]


def _numba_search(room, depth, generator, max_states=300_000):
    """(best score, player, box cells in target order) from the compiled search."""
    C = len(room[0])
    tiles = np.array([[WALL if x == "#" else TARGET if x == "." else FLOOR for x in row] for row in room], np.int8)
    targets = np.array([r * C + c for r, c in _cells(room, ".")], dtype=np.int64)
    (pr, pc), = _cells(room, "@")
    nb, cap = len(targets), max_states + 1
    bits = _table_size(cap).bit_length() - 1
    best = np.empty(nb, dtype=np.int64)
    pull_only, count_pulls, _ = GENERATORS[generator]
    score, player = _reverse_search(tiles, targets, nb, pr * C + pc, depth, max_states, pull_only, count_pulls,
                                    np.full(1 << bits, -1, dtype=np.int64), (1 << bits) - 1,
                                    np.empty(cap, dtype=np.int64), np.empty((cap, nb), dtype=np.int64), best)
    return int(score), divmod(int(player), C), [divmod(int(b), C) for b in best]


def _python_search(room, depth, generator):
    free = {(r, c) for r, row in enumerate(room) for c, x in enumerate(row) if x != "#"}
    return reverse_search(free, _cells(room, "."), _cells(room, "@")[0], depth, generator)


def _gym_sokoban_search(room_utils, room, depth):
    """gym-sokoban 0.0.6's own depth_first_search on the room, with ttl = depth."""
    structure = np.array([[{"#": 0, ".": 2}.get(x, 1) for x in row] for row in room])
    state = structure.copy()
    state[state == 2] = 4
    state[_cells(room, "@")[0]] = 5
    mapping = {t: t for t in _cells(room, ".")}
    room_utils.explored_states, room_utils.num_boxes = set(), len(mapping)
    room_utils.best_room_score, room_utils.best_room, room_utils.best_box_mapping = -1, None, mapping
    room_utils.depth_first_search(state, structure, mapping, box_swaps=0, last_pull=(-1, -1), ttl=depth)
    (pr, pc), = np.argwhere(room_utils.best_room == 5).tolist()
    boxes = room_utils.best_box_mapping
    return int(room_utils.best_room_score), (pr, pc), [tuple(int(v) for v in boxes[t]) for t in _cells(room, ".")]


def _gym_room_utils():
    """gym-sokoban's room_utils loaded from its file (its package __init__ needs old gym),
    or None when gym-sokoban is not installed."""
    spec = importlib.util.find_spec("gym_sokoban")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "envs", "room_utils.py")
    s = importlib.util.spec_from_file_location("gym_sokoban_room_utils_test", path)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def test_reverse_search_picks_the_same_state_as_plain_python_and_gym_sokoban():
    room_utils = _gym_room_utils()
    rng = np.random.default_rng(7)
    rooms = [(room, depth) for room in FIXED_ROOMS for depth in (3, 6, 15, 40)]
    rooms += [(_random_room(rng, 6 + i % 2, 6, 1 + i % 3), (5, 12, 40)[i % 3]) for i in range(24)]
    rooms += [(FIXED_ROOMS[0], 300), (FIXED_ROOMS[1], 300)]  # the default depth: searched to the end
    scores = {"gym": [], "ragen": []}
    for room, depth in rooms:
        for gen in GENERATORS:
            got = _numba_search(room, depth, gen)
            assert got == _python_search(room, depth, gen), (gen, depth, room)
            scores[gen].append(got[0])
        if room_utils is not None:
            assert _numba_search(room, depth, "gym") == _gym_sokoban_search(room_utils, room, depth), (depth, room)
    # the two scores really differ (gym counts every pull as a swap), and many rooms score
    assert sum(g > r for g, r in zip(scores["gym"], scores["ragen"])) >= 8
    assert sum(r > 0 for r in scores["ragen"]) >= len(rooms) // 3


def test_search_depth_bounds_the_search():
    # a corridor: every reverse path pulls the box one cell right per move, at most 6 cells
    corridor = ["##########", "#.@      #", "##########"]
    for depth in range(2, 12):
        moves = min(depth - 2, 6)  # the ttl explores paths of up to depth - 2 moves
        for gen, expected in (("ragen", moves), ("gym", moves * moves)):
            score, player, boxes = _numba_search(corridor, depth, gen)
            assert score == expected and boxes == [(1, 1 + moves)], (gen, depth)
            assert (score, player, boxes) == _python_search(corridor, depth, gen)
    # the state cap bounds it too: one explored state (the solved one) scores 0
    assert _numba_search(FIXED_ROOMS[0], 300, "gym", max_states=1)[0] == 0
    with pytest.raises(RuntimeError, match="no 6x6 level"):
        make_native_env("sokoban", 2, max_states=1, max_tries=20).reset([0, 1])
    # generated levels: with search_depth d every box is at most d - 2 cells from its target
    for gen in GENERATORS:
        for depth in (3, 4, 6):
            env = make_native_env("sokoban", 200, search_depth=depth, generator=gen)
            env.reset(np.arange(200))
            disp = []
            for i in range(200):
                lv = env.level(i)
                (br, bc), = np.argwhere(lv.boxes).tolist()
                (tr, tc), = np.argwhere(lv.tiles == TARGET).tolist()
                disp.append(abs(br - tr) + abs(bc - tc))
            assert 1 <= min(disp) and max(disp) <= depth - 2, (gen, depth, sorted(set(disp)))
            if depth < 6:  # in a 6x6 room deeper searches do not always reach the bound
                assert max(disp) == depth - 2, (gen, depth, sorted(set(disp)))


def test_ragen_generator_walks_the_player_away_from_the_box():
    # after its search RAGEN walks the player 1-3 steps with probability 0.5-0.8; gym-sokoban
    # leaves the player where the best state has it, nearly always next to the pulled box
    adjacent = {}
    for gen in GENERATORS:
        env = make_native_env("sokoban", 400, generator=gen)
        env.reset(np.arange(400))
        near = 0
        for i in range(400):
            lv = env.level(i)
            (br, bc), = np.argwhere(lv.boxes).tolist()
            near += abs(lv.player[0] - br) + abs(lv.player[1] - bc) == 1
        adjacent[gen] = near / 400
    assert adjacent["gym"] > 0.9 and adjacent["ragen"] < 0.75, adjacent


def test_bfs_solver_is_shortest():
    env = make_native_env("sokoban", 16, size=7, num_boxes=2)
    env.reset(np.arange(16))
    for i in range(16):
        lv = env.level(i)
        assert len(env.solve(i)) == _python_bfs(lv)
    two = parse_xsb("#####\n#@$.#\n# $.#\n#####\n")[0]
    assert solve_level(two) == ["Right", "Left", "Down", "Right"]
    stuck = parse_xsb("#####\n#@ .#\n#$  #\n#####\n")[0]  # box in a corner can never move
    assert solve_level(stuck) is None
    assert solve_level(parse_xsb("####\n#@*#\n####")[0]) == []


ORIGINALS = [
    "#####\n#@$.#\n#####",
    # non-rectangular, with floor outside the walls
    "  ####\n###  #\n#  $ #\n# #. ##\n#@ *  #\n#######",
    "######\n#+ $ #\n#  $.#\n#    #\n######",
]
# comment lines, a blank line, a bare ";" and trailing spaces separate and pad the levels
XSB = ("; first level\n" + ORIGINALS[0] + "\nTitle: two\n; a non-rectangular one\n" + ORIGINALS[1].replace("##\n#@", "##   \n#@")
       + "\n;\n" + ORIGINALS[2] + "\n")


def test_xsb_round_trip_and_env_import_export():
    levels = parse_xsb(XSB)
    assert len(levels) == 3
    text = to_xsb(levels)
    again = parse_xsb(text)
    for a, b in zip(levels, again):
        assert np.array_equal(a.tiles, b.tiles) and np.array_equal(a.boxes, b.boxes) and a.player == b.player
    originals = ORIGINALS
    assert SokobanLevel.from_xsb(originals[1]).to_xsb() == originals[1]
    with pytest.raises(ValueError, match="expected one XSB level"):
        SokobanLevel.from_xsb(XSB)
    assert [lv.to_xsb() for lv in levels] == originals
    # the env picks level seed % 3 and exports it unchanged
    env = make_native_env("sokoban", 4, levels=XSB)
    obs = env.reset([0, 1, 2, 4])
    assert [env.to_xsb(i) for i in range(4)] == [originals[0], originals[1], originals[2], originals[1]]
    assert obs[1].splitlines() == ["#######", "###__##", "#__X_##", "#_#O_##", "#P_√__#", "#######"]  # outside: wall
    assert obs[0] == "#####\n#PXO#\n#####"
    assert parse_xsb(env.to_xsb())[3].to_xsb() == originals[1]


def test_levels_file(tmp_path):
    path = tmp_path / "levels.xsb"
    path.write_text(XSB)
    env = make_native_env("sokoban", 1, levels_file=str(path))
    env.reset([2])
    assert env.solve(0) is not None


@pytest.mark.parametrize("text,match", [
    ("#####\n#@$.#\n##x##\n", "line 3, column 3: unexpected character 'x'"),
    ("Title\n\n  #####\n  #@$.#\n  ###%#\n", "line 5, column 6: unexpected character '%'"),
    ("\n\n#####\n#@$.#\n#####\n\n####\n#$.#\n####", "level starting at line 7: expected one player"),
    ("#####\n#@$ #\n#####", "1 boxes and 0 goals"),
    ("#####\n#@$.#\n#  ##\n", "not enclosed"),
    # a row without a wall inside a level is a broken row, not a separator
    ("#####\n#@$.#\n x   \n#####\n", "line 3, column 2: unexpected character 'x'"),
    ("Title: one\n#####\n#@$.#\n#   ~\n#####\n", "line 4, column 5: unexpected character '~'"),
])
def test_malformed_xsb_names_line_and_character(text, match):
    with pytest.raises(ValueError, match=match):
        parse_xsb(text)
    with pytest.raises(ValueError):
        make_native_env("sokoban", 1, levels=text)


def test_header_lines_separate_levels_even_with_a_hash():
    text = ("Title: Level #1\nAuthor: A. #Nobody\n#####\n#@$.#\n#####\nTitle: Level #2\n"
            "Level 2 of 2\n######\n#@$ .#\n######\n")
    levels = parse_xsb(text)
    assert [lv.to_xsb() for lv in levels] == ["#####\n#@$.#\n#####", "######\n#@$ .#\n######"]


def test_dynamics_match_reference():
    B = 32
    env = make_native_env("sokoban", B, size=7, num_boxes=2, max_steps=20)
    obs = env.reset(np.arange(B))
    refs = reference_envs(env)
    assert [r.render() for r in refs] == obs
    rng = np.random.default_rng(1)
    names = list(ACTIONS) + ["up", "noop"]
    for _ in range(15):
        answers = [" || ".join(rng.choice(names, size=rng.integers(0, 5))) for _ in range(B)]
        res = env.step(env.parse_actions(answers, 4).actions)
        ref_obs, ref_rew, ref_done = reference_turn(refs, answers, 4)
        assert env.render() == ref_obs
        np.testing.assert_allclose(res.reward, ref_rew, atol=1e-5)
        assert res.done.tolist() == ref_done
    assert env.truncated.any()


@pytest.mark.parametrize("kwargs,word", [
    ({"size": 4}, "size"), ({"size": (6, "a")}, "size"), ({"num_boxes": 0}, "num_boxes"),
    ({"num_boxes": 20}, "num_boxes"), ({"search_depth": 0}, "search_depth"), ({"search_depth": 2}, "search_depth"),
    ({"generator": "gym-sokoban"}, "generator"), ({"max_steps": -2}, "max_steps"),
    ({"p_change_directions": 2.0}, "p_change_directions"), ({"levels_file": "/nonexistent.xsb"}, "nonexistent"),
    ({"symbols": {"box": ""}}, "box"), ({"finish_reward": float("nan")}, "finish_reward"),
])
def test_bad_config_is_a_value_error_naming_it(kwargs, word):
    with pytest.raises(ValueError, match=word):
        make_native_env("sokoban", 2, **kwargs)


@pytest.mark.parametrize("size,num_boxes,horizon", [(6, 1, 10), (7, 2, 12), (6, 1, 3)])
def test_optimal_success_is_solvable_within_the_horizon(size, num_boxes, horizon):
    # against the independent breadth-first search above: 1.0 iff the shortest solution has
    # at most `horizon` moves
    seeds = list(range(500, 540))
    env = make_native_env("sokoban", len(seeds), size=size, num_boxes=num_boxes)
    env.reset(seeds)
    best = make_native_env("sokoban", 1, size=size, num_boxes=num_boxes).optimal_success(seeds, horizon)
    expected = [float(_python_bfs(env.level(i)) <= horizon) for i in range(len(seeds))]
    assert best.tolist() == expected
    assert 0 < sum(expected)  # the case is not all zeros


def test_optimal_success_respects_max_steps():
    level = "#######\n#@  $.#\n#######"  # Right x3: two steps, then the push onto the target
    assert make_native_env("sokoban", 1, levels=level, max_steps=2).optimal_success([0], 10).tolist() == [0.0]
    assert make_native_env("sokoban", 1, levels=level).optimal_success([0], 2).tolist() == [0.0]
    assert make_native_env("sokoban", 1, levels=level).optimal_success([0], 3).tolist() == [1.0]


def test_random_success_on_a_corridor_by_hand():
    # "#@$.#": only Right moves (Up, Down, Left hit walls), and one Right solves it, so the
    # random policy succeeds within h moves with probability 1 - (3/4)**h
    env = make_native_env("sokoban", 1, levels="#####\n#@$.#\n#####")
    for h, samples in ((1, 4000), (3, 4000)):
        est = env.random_success([0, 1], h, samples=samples, seed=h)
        assert est.shape == (2,)
        # 4000 samples: standard error <= 0.0079; 4 of them
        assert np.abs(est - (1 - 0.75**h)).max() < 0.032, (h, est)
    assert env.random_success([0], 2, samples=64, seed=5).tolist() == env.random_success([0], 2, samples=64,
                                                                                          seed=5).tolist()
    with pytest.raises(ValueError, match="samples"):
        env.random_success([0], 2, samples=0)
