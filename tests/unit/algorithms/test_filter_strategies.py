"""RAGEN head's rollout-filter strategies against selections worked out by hand.

The group stds below (G = 5, sum 1.0) are used throughout:
    group: 0    1    2    3    4
    std:   0.0  0.4  0.1  0.3  0.2
"""
import math

import pytest
import torch

from fastpo.algorithms import filter_groups, select_groups, soft_advantage_weights
from fastpo.config import load_config
from fastpo.config.fields import ConfigError

STDS = {0: 0.0, 1: 0.4, 2: 0.1, 3: 0.3, 4: 0.2}


def sel(**kw):
    return select_groups(STDS, **kw)


def test_top_k_fraction_of_all_groups_floor_and_zero_std():
    # k = int(0.4 * 5) = 2: the two highest (0.4, 0.3), or the two lowest (0.0, 0.1)
    assert sel(strategy="top_k", mode="top", ratio=0.4) == [1, 3]
    assert sel(strategy="top_k", mode="bottom", ratio=0.4) == [0, 2]
    # zero-std group 0 not a candidate: the two lowest of the rest (0.1, 0.2); k still counts all 5 groups
    assert sel(strategy="top_k", mode="bottom", ratio=0.4, keep_zero_std=False) == [2, 4]
    # int(0.1 * 5) = 0 -> at least one
    assert sel(strategy="top_k", mode="top", ratio=0.1) == [1]
    assert sel(strategy="top_k", mode="none", ratio=0.1) == [0, 1, 2, 3, 4]


def test_top_p_linear_cumulative_std_threshold():
    # threshold 0.6 * 1.0 - 0.01 = 0.59: 0.4 (< 0.59, go on), + 0.3 = 0.7 (reached)
    assert sel(strategy="top_p", top_p_mode="linear", ratio=0.6) == [1, 3]
    # threshold 0.74: 0.4, 0.7, then + 0.2 = 0.9
    assert sel(strategy="top_p", top_p_mode="linear", ratio=0.75) == [1, 3, 4]
    # eps 0.2 lowers the threshold to 0.4: the first group reaches it
    assert sel(strategy="top_p", top_p_mode="linear", ratio=0.6, eps=0.2) == [1]
    # bottom: ascending, the zero std comes first and stops the walk before the threshold -> nothing kept
    assert sel(strategy="top_p", top_p_mode="linear", mode="bottom", ratio=0.6) == []
    # without zero-std candidates: 0.1, 0.3, then 0.6 >= 0.59
    assert sel(strategy="top_p", top_p_mode="linear", mode="bottom", ratio=0.6, keep_zero_std=False) == [2, 3, 4]
    # ratio 1 keeps every candidate
    assert sel(strategy="top_p", ratio=1.0) == [0, 1, 2, 3, 4]
    assert sel(strategy="top_p", ratio=1.0, keep_zero_std=False) == [1, 2, 3, 4]


def test_top_p_linear_without_reward_spread_keeps_nothing():
    flat = {0: 0.0, 1: 0.0, 2: 0.0}
    # threshold 0.9 * 0 - 0.01 < 0 is "reached" before any group: an empty selection, the update is skipped
    assert select_groups(flat, "top_p", "top", 0.9) == []
    assert select_groups(flat, "top_p", "top", 0.9, keep_zero_std=False) == []
    assert select_groups(flat, "top_k", "top", 0.5, keep_zero_std=False) == []
    assert select_groups(flat, "top_p", "top", 1.0) == [0, 1, 2]


def test_top_p_softmax_mass():
    e = {g: math.exp(s) for g, s in STDS.items()}
    z = sum(e.values())
    # by hand: p(1) = 0.2419, p(3) = 0.2188, p(4) = 0.1980 -> cumulative 0.2419, 0.4607, 0.6587
    assert e[1] / z == pytest.approx(0.2419, abs=1e-4) and (e[1] + e[3] + e[4]) / z == pytest.approx(0.6587, abs=1e-4)
    assert sel(strategy="top_p", top_p_mode="softmax", ratio=0.5) == [1, 3, 4]
    assert sel(strategy="top_p", top_p_mode="softmax", ratio=0.2) == [1]  # 0.2419 >= 0.2 already
    # bottom: softmax(-std), smallest first: p(0) = 1 / sum(exp(-s)) = 0.2419, then 0.1 -> 0.4607, 0.2 -> 0.6587
    assert sel(strategy="top_p", top_p_mode="softmax", mode="bottom", ratio=0.5) == [0, 2, 4]


def test_min_p_relative_to_the_best():
    # top: std >= 0.5 * 0.4 = 0.2
    assert sel(strategy="min_p", ratio=0.5) == [1, 3, 4]
    assert sel(strategy="min_p", ratio=1.0) == [1]
    # bottom: std <= min / 0.5; min 0 -> only the zero group; without it min 0.1 -> std <= 0.2
    assert sel(strategy="min_p", mode="bottom", ratio=0.5) == [0]
    assert sel(strategy="min_p", mode="bottom", ratio=0.5, keep_zero_std=False) == [2, 4]


def test_filter_groups_from_scores_and_defaults_unchanged():
    # pairs of rewards; std of (0, a) = a / sqrt(2): groups 0..4 have std 0, 0.4, 0.1, 0.3, 0.2 (x sqrt 2 / sqrt 2)
    r = math.sqrt(2)
    scores = torch.tensor([1.0, 1.0, 0, 0.4 * r, 0, 0.1 * r, 0, 0.3 * r, 0, 0.2 * r])
    gid = torch.arange(5).repeat_interleave(2)
    res = filter_groups(scores, gid, 0.6, "top", strategy="top_p")
    assert res.kept_groups == [1, 3] and res.indices.tolist() == [2, 3, 6, 7] and res.kept_ratio == 0.4
    assert res.zero_std_groups == 1 and res.std_after == pytest.approx(0.35, abs=1e-6)
    empty = filter_groups(torch.full((6,), -0.1), torch.arange(3).repeat_interleave(2), 0.9, "top", strategy="top_p")
    assert empty.indices.numel() == 0 and empty.kept_groups == [] and empty.kept_ratio == 0 and empty.std_after == 0
    # the paper's StarPO-S is the default strategy: positional (scores, groups, ratio, mode) calls are unchanged
    assert filter_groups(scores, gid, 0.4, "top").kept_groups == [1, 3]
    with pytest.raises(ValueError, match="strategy"):
        filter_groups(scores, gid, 0.4, "top", strategy="top_q")
    with pytest.raises(ValueError, match="top_p mode"):
        filter_groups(scores, gid, 0.4, "top", strategy="top_p", top_p_mode="cubic")


def test_soft_advantage_weights_std_over_max_std():
    # groups: (0, 1) std 0.7071, (0, 2) std 1.4142, (1, 1) std 0 -> weights 0.5, ~1, 0
    w = soft_advantage_weights(torch.tensor([0.0, 1.0, 0.0, 2.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1, 2, 2]))
    torch.testing.assert_close(w, torch.tensor([0.5, 0.5, 1.0, 1.0, 0.0, 0.0]), atol=1e-6, rtol=0)
    assert soft_advantage_weights(torch.zeros(4), torch.tensor([0, 0, 1, 1])).abs().max() == 0


def test_config_keys_validated():
    cfg = load_config(env="frozenlake", preset="paper", overrides=[
        "algorithm.filter_strategy=top_p", "algorithm.filter_ratio=0.9", "algorithm.filter_keep_zero_std=false",
        "algorithm.filter_top_p_mode=softmax", "algorithm.soft_advantage_reweight=true"])
    a = cfg.algorithm
    assert (a.filter_strategy, a.filter_ratio, a.filter_keep_zero_std, a.filter_top_p_mode) == ("top_p", 0.9, False, "softmax")
    assert cfg.kept_groups == 8  # top_p's count depends on the batch: the mini-batch check takes the most
    for bad, words in (("algorithm.filter_strategy=top_q", "one of"), ("algorithm.filter_eps=-0.1", ">= 0"),
                       ("algorithm.filter_top_p_mode=cubic", "one of"), ("trainer.collapse_every=-1", ">= 0")):
        with pytest.raises(ConfigError, match=words) as e:
            load_config(env="frozenlake", preset="paper", overrides=[bad])
        assert bad.split("=")[0] in str(e.value)


def test_dynamic_sampling_keeps_the_first_varying_groups_by_hand():
    from fastpo.algorithms import dynamic_sampling_filter

    # groups 0..4 of two trajectories: 0 and 3 score alike (std 0), 1, 2 and 4 vary
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0])
    gids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    f = dynamic_sampling_filter(scores, gids, target=2)
    assert f.kept_groups == [1, 2] and f.indices.tolist() == [2, 3, 4, 5]
    assert f.zero_std_groups == 2 and f.kept_ratio == pytest.approx(0.4)
    assert f.std_after == pytest.approx((math.sqrt(0.5) + math.sqrt(0.125)) / 2)
    assert dynamic_sampling_filter(scores, gids, target=10).kept_groups == [1, 2, 4]  # fewer than asked: all
    assert dynamic_sampling_filter(torch.zeros(4), torch.tensor([0, 0, 1, 1]), 2).kept_groups == []
    with pytest.raises(ValueError, match="at least 1"):
        dynamic_sampling_filter(scores, gids, target=0)


def test_dynamic_draw_seeds_are_a_function_of_seed_iteration_and_draw():
    from fastpo.seeds import dynamic_draw_seeds, iteration_seeds

    a = dynamic_draw_seeds(0, 3, 1, 4)
    assert a == dynamic_draw_seeds(0, 3, 1, 4) and len(a[0]) == 4
    assert a != dynamic_draw_seeds(0, 3, 2, 4) and a != dynamic_draw_seeds(0, 4, 1, 4) and a != dynamic_draw_seeds(1, 3, 1, 4)
    assert set(a[0]).isdisjoint(iteration_seeds(0, 3, 4))



@pytest.mark.parametrize("size", [8, 16])
@pytest.mark.parametrize("value", [0.1, -0.1, 1 / 3])
def test_equal_scores_that_are_not_binary_fractions_have_zero_spread_everywhere(value, size):
    """Groups of 8 or 16 equal scores such as Sokoban's -0.1 or the Bandit's 0.1: in float32 their
    std came out near 1e-8, above the 1e-10 zero-spread threshold, so they counted as varying
    (StarPO-S's zero-std count, filter_keep_zero_std=false, DAPO's dynamic sampling, the soft
    reweighting and the in-group reward std metric all read `group_reward_std`)."""
    from fastpo.algorithms import dynamic_sampling_filter, grpo_advantages, group_reward_std

    # group 0: all equal; group 1: a real spread
    scores = torch.tensor([value] * size + [value] * (size - 1) + [1.0], dtype=torch.float32)
    gids = torch.tensor([0] * size + [1] * size)
    stds = group_reward_std(scores, gids)
    assert stds[0] == 0.0 and stds[1] > 0.1
    res = filter_groups(scores, gids, ratio=1.0, keep_zero_std=False)
    assert res.zero_std_groups == 1 and res.kept_groups == [1]
    assert dynamic_sampling_filter(scores, gids, target=2).kept_groups == [1]
    w = soft_advantage_weights(scores, gids)
    assert w[:size].tolist() == [0.0] * size and bool((w[size:] > 0.9).all())
    assert grpo_advantages(scores, gids)[:size].tolist() == [0.0] * size
