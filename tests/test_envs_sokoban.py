"""Sokoban: hand-made rule cases, generated levels solvable within max_steps, the BFS solver
against an independent search, XSB round trip and errors, dynamics against the reference."""
from collections import deque

import numpy as np
import pytest

from fastpo.envs_native import make_env
from fastpo.envs_native.reference import RefSokoban, reference_envs, reference_turn
from fastpo.envs_native.sokoban import ACTIONS, TARGET, WALL, SokobanLevel, parse_xsb, solve_level, to_xsb

UP, DOWN, LEFT, RIGHT = range(4)


def _env(xsb, **kw):
    env = make_env("sokoban", 1, levels=xsb, **kw)
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
    env = _env("#######\n#@$$ .#\n#    .#\n#######")
    res = _step(env, RIGHT)
    assert res.reward[0] == pytest.approx(-0.1) and not res.effective[0, 0]
    env = _env("#####\n#@$.#\n#####")
    _step(env, RIGHT)
    res = _step(env, RIGHT)  # box already on target against the wall
    assert not res.effective[0, 0]


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
    env = make_env("sokoban", count, size=size, num_boxes=num_boxes)
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


def test_bfs_solver_is_shortest():
    env = make_env("sokoban", 16, size=7, num_boxes=2)
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
    env = make_env("sokoban", 4, levels=XSB)
    obs = env.reset([0, 1, 2, 4])
    assert [env.to_xsb(i) for i in range(4)] == [originals[0], originals[1], originals[2], originals[1]]
    assert obs[1].splitlines() == ["#######", "###__##", "#__X_##", "#_#O_##", "#P_√__#", "#######"]  # outside: wall
    assert obs[0] == "#####\n#PXO#\n#####"
    assert parse_xsb(env.to_xsb())[3].to_xsb() == originals[1]


def test_levels_file(tmp_path):
    path = tmp_path / "levels.xsb"
    path.write_text(XSB)
    env = make_env("sokoban", 1, levels_file=str(path))
    env.reset([2])
    assert env.solve(0) is not None


@pytest.mark.parametrize("text,match", [
    ("#####\n#@$.#\n##x##\n", "line 3, column 3: unexpected character 'x'"),
    ("Title\n\n  #####\n  #@$.#\n  ###%#\n", "line 5, column 6: unexpected character '%'"),
    ("\n\n#####\n#@$.#\n#####\n\n####\n#$.#\n####", "level starting at line 7: expected one player"),
    ("#####\n#@$ #\n#####", "1 boxes and 0 goals"),
    ("#####\n#@$.#\n#  ##\n", "not enclosed"),
])
def test_malformed_xsb_names_line_and_character(text, match):
    with pytest.raises(ValueError, match=match):
        parse_xsb(text)
    with pytest.raises(ValueError):
        make_env("sokoban", 1, levels=text)


def test_dynamics_match_reference():
    B = 32
    env = make_env("sokoban", B, size=7, num_boxes=2, max_steps=20)
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
    ({"num_boxes": 20}, "num_boxes"), ({"search_depth": 0}, "search_depth"), ({"max_steps": -2}, "max_steps"),
    ({"p_change_directions": 2.0}, "p_change_directions"), ({"levels_file": "/nonexistent.xsb"}, "nonexistent"),
    ({"symbols": {"box": ""}}, "box"), ({"finish_reward": float("nan")}, "finish_reward"),
])
def test_bad_config_is_a_value_error_naming_it(kwargs, word):
    with pytest.raises(ValueError, match=word):
        make_env("sokoban", 2, **kwargs)
