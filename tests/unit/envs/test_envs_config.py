"""Bad configuration and bad seeds across the environments: each is refused with an error
that names the bad value (never a bare TypeError from deep inside, never silently coerced)."""
import numpy as np
import pytest

from fastpo.envs_native import make_native_env
from fastpo.envs_native._core import symbol_table
from fastpo.envs_native.frozenlake import DEFAULT_SYMBOLS as FL_SYMBOLS


@pytest.mark.parametrize("symbols,match", [
    ({"goal": "\x00"}, "'goal'"),  # NUL would vanish from the text (trailing NULs are padding)
    ({"hole": "\t"}, "'hole'"), ({"frozen": "\n"}, "'frozen'"), ({"player": "\x1b"}, "'player'"),
    ({"hole": "_"}, "'frozen' and 'hole'"),  # holes would render as ice
    ({"player": "X"}, "'player'.*'player_in_hole'|'player_in_hole'.*'player'"),
    ({"hole": "OO"}, "'hole'"), ({"lava": "L"}, "lava"),
])
def test_symbol_tables_refuse_control_characters_and_duplicates(symbols, match):
    with pytest.raises(ValueError, match=match):
        symbol_table(FL_SYMBOLS, symbols)
    with pytest.raises(ValueError, match=match):
        make_native_env("frozenlake", 2, symbols=symbols)


def test_symbol_tables_accept_distinct_printable_overrides():
    sym = symbol_table(FL_SYMBOLS, {"hole": "#", "player_on_goal": "*"})
    assert sym["hole"] == "#" and sym["player_on_goal"] == "*" and sym["frozen"] == "_"
    env = make_native_env("sokoban", 1, levels="#####\n#@$.#\n#####", symbols={"wall": "W", "floor": " "})
    assert env.reset([0]) == ["WWWWW\nWPXOW\nWWWWW"]
    with pytest.raises(ValueError, match="dict"):
        symbol_table(FL_SYMBOLS, [("hole", "#")])


@pytest.mark.parametrize("name", ["frozenlake", "sokoban", "bandit"])
def test_bad_seeds_are_named(name):
    env = make_native_env(name, 2)
    for bad, exc, match in [([0, 2**64], ValueError, "below 2\\*\\*64, got 18446744073709551616"),
                            ([0, -3], ValueError, "non-negative.*got -3"),
                            ([0, 2**70 + 1], ValueError, "got 1180591620717411303425"),
                            ([0, "7"], TypeError, "integers"), ([0, 1.5], TypeError, "integers"),
                            ([2**64, None], TypeError, "got None"), ([0], ValueError, "expected 2 seeds")]:
        with pytest.raises(exc, match=match):
            env.reset(bad)
    # the largest seed is fine, as a Python int or as uint64
    assert len(env.reset([0, 2**64 - 1])) == 2
    assert env.reset(np.array([5, 2**64 - 1], dtype=np.uint64)) == env.reset([5, 2**64 - 1])


@pytest.mark.parametrize("kwargs,match", [
    ({"desc": 5}, "desc must be .* got 5"), ({"desc": [1, 2]}, "got \\[1, 2\\]"), ({"desc": "4X5"}, "unknown.*'4X5'"),
    ({"desc": "5x5"}, "unknown.*'5x5'"), ({"is_slippery": "no"}, "is_slippery.*'no'"),
    ({"is_slippery": 1}, "is_slippery.*1"), ({"is_slippery": None}, "is_slippery.*None"),
])
def test_frozenlake_config_types_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_native_env("frozenlake", 2, **kwargs)


def test_frozenlake_map_names_ignore_case_and_rows_may_be_lists():
    a = make_native_env("frozenlake", 1, desc="8X8").reset([0])
    b = make_native_env("frozenlake", 1, desc="8x8").reset([0])
    c = make_native_env("frozenlake", 1, desc=[list("SF"), list("FG")], is_slippery=np.bool_(False)).reset([0])
    assert a == b and c == ["P_\n_G"]


def test_sokoban_from_levels_has_num_boxes():
    env = make_native_env("sokoban", 2, levels="#####\n#@$.#\n#####\n\n#######\n#@$.$.#\n#######")
    assert env.num_boxes == 2  # the most boxes any level has
    env.reset([0, 1])
    assert env.level(0).num_boxes == 1 and env.level(1).num_boxes == 2
