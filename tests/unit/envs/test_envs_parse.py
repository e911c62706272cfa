"""Answer parsing: property-based tests that no text raises, that the Numba parser equals
the plain-Python reference on any text, and that valid answers parse to the right ids."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpo.envs_native import make_native_env
from fastpo.envs_native._core import WHITESPACE
from fastpo.envs_native.python_reference import parse_answer

ENVS = {}


def _env(name):
    if name not in ENVS:
        env = make_native_env(name, 4)
        env.reset([0, 1, 2, 3])
        ENVS[name] = env
    return ENVS[name]


def test_whitespace_table_is_pythons():
    assert set(WHITESPACE) == {c for c in range(0x110000) if chr(c).isspace()}


# Text built from pieces that hit the parser's edges: separators, partial separators,
# action names in any case, whitespace of every kind, and arbitrary unicode.
_pieces = st.one_of(
    st.sampled_from(["||", "|", "|||", " ", "\t", "\n", "\u3000", "\x85", "\x00", "Up", "uP", "LEFT", "down ",
                     "Right", "Vault", "casino", "√", "Ünïcode", ""]),
    st.text(max_size=8),
)
_answer = st.lists(_pieces, max_size=12).map("".join)


def _reference(env, i, text, max_actions):
    names = {n.lower(): k for k, n in enumerate(env.action_names(i))}
    return parse_answer(text, names, max_actions)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["sokoban", "frozenlake", "bandit"]), answers=st.lists(_answer, min_size=4, max_size=4),
       max_actions=st.integers(1, 6))
def test_any_text_parses_like_the_reference_and_never_raises(name, answers, max_actions):
    env = _env(name)
    p = env.parse_actions(answers, max_actions)
    assert p.actions.shape == (4, max_actions) and p.actions.dtype == np.int64
    for i, text in enumerate(answers):
        acts, bad = _reference(env, i, text, max_actions)
        assert p.actions[i, : len(acts)].tolist() == acts and (p.actions[i, len(acts):] == -1).all()
        assert p.num_actions[i] == len(acts)
        assert p.invalid[i] == tuple(bad)
        assert p.all_valid[i] == (len(acts) > 0 and not bad)


_space = st.sampled_from(["", " ", "  ", "\t", "\n", " \u00a0"])


@settings(max_examples=100, deadline=None)
@given(name=st.sampled_from(["sokoban", "frozenlake", "bandit"]), data=st.data())
def test_valid_answers_parse_to_the_right_actions(name, data):
    env = _env(name)
    max_actions = data.draw(st.integers(1, 5))
    answers, expected = [], []
    for i in range(4):
        names = env.action_names(i)
        ids = data.draw(st.lists(st.integers(0, len(names) - 1), min_size=1, max_size=7))
        words = []
        for a in ids:
            case = data.draw(st.sampled_from([str.lower, str.upper, str.title, lambda s: s]))
            words.append(data.draw(_space) + case(names[a]) + data.draw(_space))
        answers.append("||".join(words))
        expected.append(ids[:max_actions])
    p = env.parse_actions(answers, max_actions)
    for i in range(4):
        assert p.actions[i, : len(expected[i])].tolist() == expected[i]
        assert p.num_actions[i] == len(expected[i]) and p.all_valid[i] and p.invalid[i] == ()


def test_odd_inputs_never_raise():
    env = _env("sokoban")
    p = env.parse_actions(["\ud800 Up", None, 12, "Up||\udfff"], 3)  # lone surrogates, non-strings
    assert p.num_actions.tolist() == [0, 0, 0, 1]
    assert p.invalid[0] == ("\ud800 Up",) and p.invalid[3] == ("\udfff",)
    assert not p.all_valid.any()
    p = env.parse_actions(["Up\x00 || Left", "\x00", "", "down||\x00||up"], 3)  # NUL is not whitespace
    assert p.num_actions.tolist() == [1, 0, 0, 2] and p.invalid == [("Up\x00",), ("\x00",), (), ("\x00",)]
    long = " || ".join(["Left"] * 10_000)
    assert env.parse_actions([long] * 4, 5).num_actions.tolist() == [5] * 4


def test_cut_to_max_actions_and_empty_pieces():
    env = _env("frozenlake")
    p = env.parse_actions(["Up || || Left || Down", "||", "up|| jump ||Down|| Right", "Right||Left"], 2)
    assert p.actions.tolist() == [[3, 0], [-1, -1], [3, -1], [2, 0]]
    assert p.invalid == [(), (), ("jump",), ()]
    assert p.all_valid.tolist() == [True, False, False, True]


@pytest.mark.parametrize("answers,max_actions,word", [(["Up"] * 3, 2, "4 answers"), ("UpUpUpUp", 2, "4 answers"),
                                                      (["Up"] * 4, 0, "max_actions"), (["Up"] * 4, 1.5, "max_actions")])
def test_bad_arguments_are_value_errors(answers, max_actions, word):
    with pytest.raises(ValueError, match=word):
        _env("frozenlake").parse_actions(answers, max_actions)
