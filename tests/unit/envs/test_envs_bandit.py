"""Bandit: arm names and positions, payout statistics, success, single turn, errors."""
import numpy as np
import pytest

from fastpo.envs_native import make_native_env
from fastpo.envs_native.bandit import TEST_PAIRS, TRAIN_PAIRS
from fastpo.envs_native.python_reference import reference_envs, reference_turn


@pytest.mark.parametrize("split,pairs", [("train", TRAIN_PAIRS), ("test", TEST_PAIRS)])
def test_names_come_from_the_split_and_positions_are_randomised(split, pairs):
    B = 400
    env = make_native_env("bandit", B, split=split)
    obs = env.reset(np.arange(B))
    allowed = {frozenset(p) for p in pairs}
    first_is_low = 0
    seen = set()
    for i in range(B):
        a, b = env.action_names(i)
        assert frozenset((a, b)) in allowed
        assert a in obs[i] and b in obs[i] and f"{a}, {b}" in env.instructions()[i]
        first_is_low += (a, b) in pairs
        seen.add(frozenset((a, b)))
    assert 0.4 * B < first_is_low < 0.6 * B  # both orders occur, about equally
    assert seen == allowed  # every pair is drawn
    assert set(TRAIN_PAIRS).isdisjoint(TEST_PAIRS)


def test_payouts_and_success():
    B = 20000
    env = make_native_env("bandit", B)
    env.reset(np.arange(B))
    high = env.high_risk_action()
    choose_high = np.arange(B) % 2 == 0
    acts = np.where(choose_high, high, 1 - high)[:, None]
    res = env.step(acts)
    r_high, r_low = res.reward[choose_high], res.reward[~choose_high]
    assert set(np.unique(r_high).tolist()) == {0.0, 1.0}
    assert np.all(r_low == np.float32(0.1))
    # 0.25 +- 4 standard deviations of the mean of 10000 Bernoulli(0.25) draws (0.0043)
    assert abs(r_high.mean() - 0.25) < 0.018
    assert np.array_equal(res.success, choose_high)  # EV 0.25 > 0.1: the high-risk arm is the right one
    assert res.done.all() and (res.num_executed == 1).all()
    again = env.step(acts)  # single turn: nothing more happens
    assert (again.reward == 0).all() and (again.num_executed == 0).all()
    assert "You pulled" in env.render()[0]


def test_configurable_payouts_flip_the_better_arm():
    env = make_native_env("bandit", 64, low_reward=0.5, high_reward=1.0, high_prob=0.25)
    env.reset(np.arange(64))
    res = env.step((1 - env.high_risk_action())[:, None])
    assert res.success.all() and np.all(res.reward == 0.5)


def test_parse_uses_this_instances_arm_names():
    env = make_native_env("bandit", 3)
    env.reset([5, 6, 7])
    names = [env.action_names(i) for i in range(3)]
    other = next(n for p in TRAIN_PAIRS for n in p if n not in names[2])
    p = env.parse_actions([names[0][1].upper(), f"  {names[1][0].lower()} ", other], 2)
    assert p.actions[:, 0].tolist()[:2] == [1, 0] and p.all_valid.tolist()[:2] == [True, True]
    assert p.invalid[2] == (other,) and p.num_actions[2] == 0 and not p.all_valid[2]


def test_matches_reference():
    B = 256
    env = make_native_env("bandit", B, split="test")
    env.reset(np.arange(B) + 77)
    refs = reference_envs(env)
    answers = [env.action_names(i)[(i // 3) % 2] if i % 5 else "pass" for i in range(B)]
    res = env.step(env.parse_actions(answers, 1).actions)
    obs, rew, done = reference_turn(refs, answers, 1)
    assert env.render() == obs and res.reward.tolist() == pytest.approx(rew) and res.done.tolist() == done


@pytest.mark.parametrize("kwargs,word", [
    ({"split": "val"}, "split"), ({"high_prob": 1.5}, "high_prob"), ({"low_reward": float("inf")}, "low_reward"),
    ({"pairs": [("A", "a")]}, "different"), ({"pairs": [("A||B", "C")]}, "A\\|\\|B"), ({"pairs": []}, "pairs"),
    # not a list of pairs: named, never unpacked character by character or iterated into a TypeError
    ({"pairs": 5}, "got 5"), ({"pairs": "AB"}, "got 'AB'"), ({"pairs": ["AB"]}, "'AB' is not a pair"),
    ({"pairs": [("A", "B", "C")]}, "is not a pair"), ({"pairs": [("A", 3)]}, "is not a pair"),
])
def test_bad_config_is_a_value_error_naming_it(kwargs, word):
    with pytest.raises(ValueError, match=word):
        make_native_env("bandit", 2, **kwargs)


def test_instructions_and_action_names_need_a_reset():
    # the arm names are drawn at reset, so unlike FrozenLake and Sokoban these raise before it
    env = make_native_env("bandit", 2)
    for call in (env.instructions, lambda: env.action_names(0), env.render, lambda: env.parse_actions(["a", "b"], 1)):
        with pytest.raises(RuntimeError, match="reset"):
            call()


def test_success_bounds_by_hand():
    # success = pulling the arm of higher expected reward: the best policy always does, a
    # uniformly random pull half the time; checked by pulling each arm of every seed
    env = make_native_env("bandit", 1, low_reward=0.3, high_reward=1.0, high_prob=0.25)  # low arm better here
    assert env.optimal_success(range(6), 1).tolist() == [1.0] * 6
    assert env.random_success([3, 4], 5).tolist() == [0.5, 0.5]
    pulls = make_native_env("bandit", 12, low_reward=0.3, high_reward=1.0, high_prob=0.25)
    pulls.reset(np.repeat(np.arange(6), 2))
    pulls.step(np.tile([0, 1], 6))
    assert pulls.success.reshape(6, 2).sum(axis=1).tolist() == [1] * 6  # one arm of two succeeds
