"""The grid games' observation formats (`observation` = grid | cells | coords | cells+coords):
every format reads back to the game's state, the per-cell format is exactly one token per cell
with the embedded tokenizer (the paper's run-together grid is not), and the legend follows."""
import re

import numpy as np
import pytest

from fastpo.envs_native import make_native_env
from fastpo.envs_native._core import OBSERVATIONS
from fastpo.envs_native.sokoban import TARGET, WALL

SEEDS = list(range(40))
COORD = re.compile(r"\((\d+), (\d+)\)")


def _played(name, observation, seeds=SEEDS, turns=3, **config):
    """The env after a fixed schedule of random moves, and its observation texts after each turn."""
    env = make_native_env(name, len(seeds), observation=observation, **config)
    texts = [env.reset(seeds)]
    rng = np.random.default_rng(0)
    for _ in range(turns):
        env.step(rng.integers(0, 4, size=(len(seeds), 1)))
        texts.append(env.render())
    return env, texts


def _split(text, observation, rows):
    """(grid rows as lists of one-character cells, coordinate lines) of an observation text."""
    lines = text.split("\n")
    grid, rest = lines[:rows], lines[rows:]
    if "cells" in observation:
        assert all(len(row) % 2 == 1 and row[1::2] == " " * (len(row) // 2) for row in grid), grid
        cells = [list(row[0::2]) for row in grid]
    else:
        cells = [list(row) for row in grid]
    assert bool(rest) == ("coords" in observation), text
    return cells, rest


def _coords(line):
    return [(int(r), int(c)) for r, c in COORD.findall(line)]


@pytest.mark.parametrize("observation", OBSERVATIONS)
def test_sokoban_every_format_reads_back_to_the_state(observation):
    env, texts = _played("sokoban", observation)
    s = env.symbols
    meaning = {s["wall"]: (WALL, 0, 0), s["floor"]: (1, 0, 0), s["target"]: (TARGET, 0, 0), s["box"]: (1, 1, 0),
               s["box_on_target"]: (TARGET, 1, 0), s["player"]: (1, 0, 1), s["player_on_target"]: (TARGET, 0, 1)}
    text = texts[-1]
    for i in range(len(SEEDS)):
        lv = env.level(i)
        R, C = lv.shape
        cells, rest = _split(text[i], observation, R)
        assert [len(r) for r in cells] == [C] * R
        decoded = np.array([[meaning[ch] for ch in row] for row in cells])
        tiles = np.where(lv.tiles == 3, WALL, lv.tiles)  # outside cells are drawn as walls
        assert (decoded[..., 0] == tiles).all() and (decoded[..., 1] == lv.boxes).all()
        assert list(zip(*np.nonzero(decoded[..., 2]))) == [lv.player]
        if rest:
            assert _coords(rest[0]) == [lv.player]
            assert _coords(rest[1]) == [tuple(int(x) for x in p) for p in zip(*np.nonzero(lv.boxes))]
            assert _coords(rest[2]) == [tuple(int(x) for x in p) for p in zip(*np.nonzero(lv.tiles == TARGET))]


@pytest.mark.parametrize("observation", OBSERVATIONS)
def test_frozenlake_every_format_reads_back_to_the_state(observation):
    env, texts = _played("frozenlake", observation, is_slippery=False, size=5)
    s = env.symbols
    tile_of = {s["frozen"]: "F", s["hole"]: "H", s["goal"]: "G", s["player"]: "F", s["player_in_hole"]: "H",
               s["player_on_goal"]: "G"}
    players = {s["player"], s["player_in_hole"], s["player_on_goal"]}
    pos = env.positions()
    for i in range(len(SEEDS)):
        cells, rest = _split(texts[-1][i], observation, 5)
        start = env.tiles(i)
        truth = [row.replace("S", "F") for row in start]
        assert ["".join(tile_of[ch] for ch in row) for row in cells] == truth
        assert [(r, c) for r, row in enumerate(cells) for c, ch in enumerate(row) if ch in players] == \
            [divmod(int(pos[i]), 5)]
        if rest:
            assert _coords(rest[0]) == [divmod(int(pos[i]), 5)]
            cells_of = lambda t: [(r, c) for r, row in enumerate(truth) for c, ch in enumerate(row) if ch == t]  # noqa: E731
            assert _coords(rest[1]) == cells_of("G")
            assert _coords(rest[2]) == cells_of("H")


def _tokens_per_row(tok, text):
    return [len(tok.encode(row, add_special_tokens=False)) for row in text.split("\n")]


@pytest.mark.parametrize("name", ["sokoban", "frozenlake"])
def test_the_per_cell_format_is_one_embedded_token_per_cell(name):
    """Each cell one token of SmolLM2's tokenizer, rows and whole grids alike; the paper's
    run-together grid merges runs of cells (this check fails on it)."""
    from fastpo.model_loading import load_tokenizer

    tok = load_tokenizer()
    for observation in ("cells", "cells+coords"):
        env, texts = _played(name, observation, seeds=list(range(64)), turns=6)
        R, C = env.size
        for text in (t for step in texts for t in step):
            grid = "\n".join(text.split("\n")[:R])
            ids = tok.encode(grid, add_special_tokens=False)
            pieces = [tok.decode([t]) for t in ids]
            assert len(ids) == R * C + R - 1, pieces
            assert all(p == "\n" or len(p.strip()) == 1 for p in pieces), pieces
    _, texts = _played(name, "grid", seeds=list(range(64)), turns=0)
    merged = sum(sum(_tokens_per_row(tok, t)) < env.size[0] * env.size[1] for t in texts[0])
    assert merged == 64  # every run-together grid has fewer tokens than cells


@pytest.mark.parametrize("name", ["sokoban", "frozenlake"])
def test_the_legend_follows_the_format(name):
    grid = make_native_env(name, 1).instructions()[0]
    cells = make_native_env(name, 1, observation="cells").instructions()[0]
    both = make_native_env(name, 1, observation="cells+coords").instructions()[0]
    assert "√" in grid and "√" not in cells and "* " in cells
    assert "separated by spaces" in cells and "(row, column)" not in cells
    assert "separated by spaces" in both and "(row, column)" in both
    assert "separated by spaces" not in grid and "(row, column)" not in grid
    # a symbol the user chose stays, in every format
    own = make_native_env(name, 1, observation="cells", symbols={"box_on_target" if name == "sokoban" else
                                                          "player_on_goal": "√"})
    assert "√" in own.instructions()[0]


def test_symbols_you_set_in_the_per_cell_formats():
    env = make_native_env("sokoban", 1, observation="cells", symbols={"wall": "*"})  # '*' taken: '√' becomes '+'
    assert env.symbols["wall"] == "*" and env.symbols["box_on_target"] == "+"
    with pytest.raises(ValueError, match=r"symbol for 'frozen' is ' ': a blank symbol cannot be told"):
        make_native_env("frozenlake", 1, observation="cells", symbols={"frozen": " "})
    assert make_native_env("frozenlake", 1, symbols={"frozen": " "}).symbols["frozen"] == " "  # the paper's grid: fine


@pytest.mark.parametrize("bad", ["Cells", "ascii", "", None, 3])
def test_a_bad_format_is_refused_in_one_line(bad):
    for name in ("sokoban", "frozenlake"):
        with pytest.raises(ValueError, match=r"observation must be one of .*got"):
            make_native_env(name, 1, observation=bad)


def test_frozenlake_without_slip_is_gymnasiums_deterministic_game():
    env = make_native_env("frozenlake", 1, desc="4x4", is_slippery=False)
    env.reset([0])
    for a in (1, 1, 2, 2, 1, 2):  # Down Down Right Right Down Right: gymnasium's 4x4 solution
        env.step(np.array([[a]]))
    assert env.success[0] and env.optimal_success([0], 6)[0] == 1.0
    assert "slippery" not in env.instructions()[0]
