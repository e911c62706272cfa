"""The probe games (fastpo.envs.probes) played by hand: each one's rewards, success, turn limits,
random and optimal lines, and its uniformly random expert; `--env probe:NAME` resolution and
its one-line errors. (Whether the trainer learns them: tests/integration/test_probes_learning.py.)"""
import collections

import pytest

from fastpo.envs import EnvError, env_preset, make_env, resolve_env
from fastpo.envs.probes import PROBES


def play(name, answers, seed=0):
    """(observations after each answer, rewards, final success) of one game played with `answers`."""
    env = make_env(f"probe:{name}", 1)
    first = env.reset([seed])[0]
    obs, rewards = [first], []
    for a in answers:
        acts = env.parse_actions([a], 1).actions
        res = env.step(acts)
        rewards.append(float(res.reward[0]))
        obs.append(env.render()[0])
        if res.done[0]:
            break
    return obs, rewards, bool(env.success[0])


def test_choice_pays_b_only():
    assert play("choice", ["B"])[1:] == ([1.0], True)
    assert play("choice", ["A"])[1:] == ([0.0], False)


def test_constant_pays_the_same_for_every_answer():
    assert play("constant", ["A"])[1:] == play("constant", ["B"])[1:] == ([0.5], True)


def test_delayed_pays_at_the_end_for_the_first_answer():
    for first, second in (("A", "A"), ("A", "B"), ("B", "A"), ("B", "B")):
        obs, rewards, won = play("delayed", [first, second])
        assert rewards == [0.0, float(first == "B")] and won == (first == "B")
        assert obs[1] == obs[0]  # the second observation does not tell how the first answer did


def test_recall_asks_back_the_letter_shown_after_the_first_answer():
    letters = collections.Counter()
    for seed in range(40):
        obs, _, _ = play("recall", ["A", "A", "A"], seed)
        letter = obs[1].split("letter: ")[1][0]
        assert letter in "AB" and "letter" not in obs[0]
        letters[letter] += 1
        for answer in "AB":
            _, rewards, won = play("recall", ["B", "A", answer], seed)
            assert rewards == [0.0, 0.0, float(answer == letter)] and won == (answer == letter)
        assert play("recall", ["A", "A", "A"], seed)[0][1] == obs[1]  # the letter is the seed's
    assert min(letters.values()) >= 10  # both letters drawn


def test_discount_a_now_or_b_for_twice_as_much_a_turn_later():
    assert play("discount", ["A", "B"])[1:] == ([1.0], False)  # A ends the game
    assert play("discount", ["B", "A"])[1:] == ([0.0, 2.0], True)
    assert play("discount", ["B", "B"])[1:] == ([0.0, 2.0], True)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_limits_lines_and_a_uniformly_random_expert(name):
    turns = {"choice": 1, "constant": 1, "delayed": 2, "recall": 3, "discount": 2}[name]
    assert env_preset(f"probe:{name}") == {"rollout": {"max_turns": turns, "max_actions_per_turn": 1,
                                                       "max_actions_per_traj": turns}}
    env = make_env(f"probe:{name}", 4)
    seeds = list(range(4))
    assert env.optimal_success(seeds, turns).tolist() == [1.0] * 4
    assert env.random_success(seeds, turns).tolist() == [1.0 if name == "constant" else 0.5] * 4
    game = resolve_env(f"probe:{name}").factory()
    game.reset(0)
    import random

    random.seed(0)
    picks = collections.Counter(game.expert() for _ in range(200))
    assert set(picks) == {"A", "B"} and min(picks.values()) > 70  # no preference: SFT teaches the format only


@pytest.mark.parametrize("bad,match", [("probe:nosuch", "unknown probe game 'nosuch'; choose one of choice, constant"),
                                       ("probe:", "give the game id after 'probe:', e.g. probe:choice")])
def test_bad_probe_names_are_one_line_errors(bad, match):
    resolve_env.cache_clear()
    with pytest.raises(EnvError, match=match) as e:
        resolve_env(bad)
    assert "\n" not in str(e.value)


def test_the_cli_refuses_an_unknown_probe_before_loading_a_model(capsys, no_model):
    from fastpo.cli import main

    assert main(["train", "--env", "probe:nosuch", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "unknown probe game 'nosuch'" in err and len(err.strip().splitlines()) == 1

