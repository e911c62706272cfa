"""Advantages, filtering, aggregation and the value loss against values computed by hand."""
import math

import pytest
import torch

from fastpo.algorithms import (aggregate_loss, clipped_value_loss, compute_gae, filter_groups, grpo_advantages,
                               masked_whiten, place_rewards)


def test_gae_skips_observation_tokens_hand_values():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[9.0, 0.5, 0.2, 9.0, 0.1, 9.0]])  # 9.0 off the mask must be ignored
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # i=2: 1 - 0.1 = 0.9; i=1: (0.09 - 0.2) + 0.72*0.9 = 0.538; i=0: (0.18 - 0.5) + 0.72*0.538 = 0.06736
    expect = torch.tensor([[0.0, 0.06736, 0.538, 0.0, 0.9, 0.0]])
    torch.testing.assert_close(adv, expect, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, (expect + values) * mask, atol=1e-6, rtol=0)


def test_gae_gamma_lambda_one_is_reward_to_go_minus_value():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    values = torch.tensor([[0.1, 0.2, 0.0, 0.3, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    scores = torch.tensor([2.0, -1.0])
    rewards = place_rewards(mask, scores, "last_token")
    assert rewards[0, 3] == 2.0 and rewards[1, 4] == -1.0 and rewards.sum() == 1.0
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv[0], torch.tensor([1.9, 1.8, 0.0, 1.7, 0.0]))
    torch.testing.assert_close(adv[1], torch.tensor([0.0, -2.0, -3.0, -4.0, -5.0]))
    torch.testing.assert_close(ret, scores[:, None].expand(2, 5) * mask)


def test_turn_rewards_placement():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    turn = torch.tensor([[-1, 0, 0, -1, 1, 1, -1]])
    r = place_rewards(mask, torch.tensor([0.0]), "turn", turn, torch.tensor([[0.5, -0.1, 7.0]]))
    assert r.tolist() == [[0.0, 0.0, 0.5, 0.0, 0.0, pytest.approx(-0.1), 0.0]]
    with pytest.raises(ValueError, match="turn"):
        place_rewards(mask, torch.tensor([0.0]), "turn")
    with pytest.raises(ValueError, match="unknown reward mode"):
        place_rewards(mask, torch.tensor([0.0]), "first")


def test_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    w = masked_whiten(x, m)
    sd = math.sqrt(2 / 3)  # values 1, 2, 3: mean 2, biased var 2/3
    torch.testing.assert_close(w, torch.tensor([[-1 / sd, 0.0, 0.0], [1 / sd, 0.0, 0.0]]), atol=1e-5, rtol=0)


def test_grpo_and_drgrpo_hand_values():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    a = grpo_advantages(scores, groups)
    # group 0: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5; group 1: all equal -> 0
    torch.testing.assert_close(a, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0]) / (0.5 + 1e-6))
    d = grpo_advantages(scores, groups, scale_by_std=False)
    torch.testing.assert_close(d, torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0]))
    with pytest.raises(ValueError):
        grpo_advantages(scores, groups[:3])
    # all format penalties: exactly no signal (float32 statistics left ~0.007 here)
    same = torch.full((8,), -0.1)
    assert grpo_advantages(same, torch.zeros(8, dtype=torch.long)).abs().max() == 0


def test_filter_top_bottom_none():
    # group std: g0 = 0, g1 = std(0, 1) = 0.7071, g2 = std(0, 2) = 1.414, g3 = std(1, 1.5) = 0.3536
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 1.0, 1.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    top = filter_groups(scores, groups, 0.25, "top")
    assert top.kept_groups == [2] and top.indices.tolist() == [4, 5] and top.kept_ratio == 0.25
    assert top.std_after == pytest.approx(math.sqrt(2))
    top2 = filter_groups(scores, groups, 0.5, "top")
    assert top2.kept_groups == [1, 2] and top2.indices.tolist() == [2, 3, 4, 5]
    bottom = filter_groups(scores, groups, 0.5, "bottom")
    assert bottom.kept_groups == [0, 3] and bottom.indices.tolist() == [0, 1, 6, 7]
    none = filter_groups(scores, groups, 0.25, "none")
    assert none.indices.tolist() == list(range(8)) and none.kept_ratio == 1.0
    with pytest.raises(ValueError, match="filter mode"):
        filter_groups(scores, groups, 0.25, "middle")


def test_aggregation_modes_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert aggregate_loss(x, m, "token-mean").item() == pytest.approx(7 / 3)
    assert aggregate_loss(x, m, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert aggregate_loss(x, m, "seq-mean-token-mean").item() == pytest.approx(2.75)
    flat = x.flatten()
    ids = torch.arange(3).repeat_interleave(3)
    assert aggregate_loss(flat, m.flatten(), "seq-mean-token-mean", ids).item() == pytest.approx(2.75)
    with pytest.raises(ValueError):
        aggregate_loss(x, m, "sum")


def test_clipped_value_loss_hand_values():
    v = torch.tensor([1.0, 0.1], requires_grad=True)
    old = torch.tensor([0.0, 0.0])
    ret = torch.tensor([2.0, 0.0])
    m = torch.tensor([True, True])
    loss, met = clipped_value_loss(v, old, ret, m, clip=0.5)
    # tok0: unclipped (1-2)^2=1, clipped (0.5-2)^2=2.25 -> 2.25; tok1: 0.01 both -> 0.01
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.01) / 2)
    assert met["value_clipfrac"] == 0.5
    loss.backward()
    assert v.grad[0].item() == 0.0  # the clipped branch has no gradient wrt V


def test_value_loss_through_the_shared_aggregation_keeps_the_default():
    """The trainer's value loss goes through the policy loss's aggregation (fastpo.kernels.aggregate)
    with the mini-batch denominator; for algorithm.value_loss_agg=token-mean (the default) it equals
    the hand rescale the trainer used before: the micro-batch token mean x (count / mini-batch tokens)."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(7, generator=g, requires_grad=True)
    old, ret = torch.randn(7, generator=g), torch.randn(7, generator=g)
    ones = torch.ones(7, dtype=torch.bool)
    n_tok = 19  # the mini-batch's scored tokens over all its micro-batches
    new, met = clipped_value_loss(v, old, ret, ones, clip=0.2, mode="token-mean", denominator=float(n_tok))
    (g_new,) = torch.autograd.grad(new, v)
    before, _ = clipped_value_loss(v, old, ret, ones, clip=0.2)
    hand = before * (7 / n_tok)
    (g_hand,) = torch.autograd.grad(hand, v)
    torch.testing.assert_close(new, hand, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_new, g_hand, rtol=1e-6, atol=0)
    # seq-mean-token-mean over two sequences of 3 and 4 tokens, 5 sequences in the mini-batch
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    per_seq, _ = clipped_value_loss(v, old, ret, ones, clip=0.2, mode="seq-mean-token-mean", seq_ids=seq,
                                    denominator=5.0)
    worst = torch.maximum((v - ret) ** 2, (old + (v - old).clamp(-0.2, 0.2) - ret) ** 2)
    torch.testing.assert_close(per_seq, 0.5 * (worst[:3].mean() + worst[3:].mean()) / 5)
    # the logged critic/value_loss is still the micro-batch token mean, computed as before
    assert met["value_loss"] == float(0.5 * (worst.detach().sum() / 7.0))


def test_bilevel_gae_by_hand():
    """RAGEN head's own example (core_algos.py's __main__: two turns of five tokens, a reward of
    1 at each turn's end, values 0.1..1.0, gamma = lam = 1, high_level_gamma = 0.95), worked
    out by hand: high level A_2 = 1 + 0 - 1.0 = 0 and A_1 = 1 + 0.95 * 1.0 - 0.5 = 1.45; inside
    each turn the token GAE runs back from A_k at its end."""
    from fastpo.algorithms import compute_bilevel_gae

    rewards = torch.tensor([[0, 0, 0, 0, 1, 0, 0, 0, 0, 1.0]])
    values = torch.arange(1, 11, dtype=torch.float32)[None] / 10
    mask = torch.ones(1, 10, dtype=torch.bool)
    turn = torch.tensor([[0] * 5 + [1] * 5])
    adv, ret = compute_bilevel_gae(rewards, values, mask, turn, 1.0, 1.0, 0.95)
    assert adv[0].tolist() == pytest.approx([1.85, 1.75, 1.65, 1.55, 1.45, 0.4, 0.3, 0.2, 0.1, 0.0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([1.95] * 5 + [1.0] * 5, abs=1e-6)
    # a turn that earned 0 still ends (RAGEN's code would run it into the next): the first
    # turn's end sees the second's reward through the turn-level discount, 0 + 0.95 * 1.0 - 0.5
    adv0, _ = compute_bilevel_gae(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0]]), values, mask, turn, 1.0, 1.0, 0.95)
    assert adv0[0, 4].item() == pytest.approx(0.45)
    # observation tokens between turns and padding are skipped; high_level_gamma = 1 with
    # gamma = lam = 1 is plain GAE over the model tokens (the sum of rewards to come minus V)
    m2 = torch.tensor([[False, True, True, False, False, True, True, False]])
    r2 = torch.tensor([[0, 0, 0.5, 0, 0, 0, 2.0, 0]])
    v2 = torch.tensor([[9, 0.3, 0.2, 9, 9, 0.7, 0.1, 9]])
    t2 = torch.tensor([[-1, 0, 0, -1, -1, 1, 1, -1]])
    a2, _ = compute_bilevel_gae(r2, v2, m2, t2, 1.0, 1.0, 1.0)
    g2, _ = compute_gae(r2, v2, m2, 1.0, 1.0)
    assert a2[0].tolist() == pytest.approx(g2[0].tolist(), abs=1e-6)
    assert a2[0, [0, 3, 4, 7]].tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="high_level_gamma"):
        compute_bilevel_gae(r2, v2, m2, t2, 1.0, 1.0, 1.5)


def test_turn_rloo_by_hand():
    """Each turn's reward-to-go minus the leave-one-out mean of the group's at that turn index.
    Group 0: A (turn rewards 1, 2: to-go 3, 2), B (one turn, 0.5), C (0, 4: to-go 4, 4);
    group 1: D alone (7: no other member, baseline 0)."""
    from fastpo.algorithms import rloo_advantages, turn_rloo_advantages

    turn = torch.tensor([[-1, 0, 0, -1, 1, 1]] * 4)
    mask = turn >= 0
    mask[1, 3:] = False  # B and D stop after one turn
    mask[3, 3:] = False
    rewards = torch.zeros(4, 6)
    rewards[0, 2], rewards[0, 5] = 1.0, 2.0
    rewards[1, 2] = 0.5
    rewards[2, 2], rewards[2, 5] = 0.0, 4.0
    rewards[3, 2] = 7.0
    adv = turn_rloo_advantages(rewards, mask, turn, torch.tensor([0, 0, 0, 1]))
    expect = {0: (0.75, -2.0), 1: (-3.0, None), 2: (2.25, 2.0), 3: (7.0, None)}
    for b, (a0, a1) in expect.items():
        assert adv[b, 1:3].tolist() == pytest.approx([a0, a0])
        assert adv[b, 4:6].tolist() == pytest.approx([a1, a1] if a1 is not None else [0.0, 0.0])
        assert adv[b, [0, 3]].tolist() == [0.0, 0.0]
    # with one turn each it is RLOO on the scores
    one = turn_rloo_advantages(rewards[:, :3], mask[:, :3], turn[:, :3], torch.tensor([0, 0, 0, 0]))
    scores = torch.tensor([1.0, 0.5, 0.0, 7.0])
    assert one[:, 1].tolist() == pytest.approx(rloo_advantages(scores, torch.zeros(4, dtype=torch.long)).tolist())


def test_turn_rloo_is_unbiased_when_the_policy_chooses_to_stop():
    """A two-turn game where the policy decides the length: at turn 0 it stops (reward 1, done)
    with probability 1 - p, or goes on (intermediate reward c = 0.5, then a turn worth 0) with
    p = sigmoid(theta). J = p c + (1 - p), dJ/dtheta = p (1 - p) (c - 1). The turn-level
    estimator's mean policy gradient over many groups matches it within 4 standard errors, as
    does plain RLOO on the scores (both unbiased); the per-turn-index normalised sum (MT-GRPO
    style, the construction verl RFC #7244 warns about) is off by many standard errors."""
    from fastpo.algorithms import rloo_advantages, turn_rloo_advantages

    g = torch.Generator().manual_seed(0)
    theta, c, n, groups = 0.3, 0.5, 4, 6000
    p = torch.sigmoid(torch.tensor(theta)).item()
    exact = p * (1 - p) * (c - 1)
    B = n * groups
    go = torch.rand(B, generator=g) < p
    turn = torch.tensor([0, -1, 1]).repeat(B, 1)
    mask = torch.ones(B, 3, dtype=torch.bool)
    mask[:, 1] = False
    mask[~go, 2] = False
    rewards = torch.zeros(B, 3)
    rewards[:, 0] = torch.where(go, c, 1.0)
    gids = torch.arange(B) // n
    score_fn = torch.where(go, 1 - p, -p)  # d log pi(a_0) / d theta; turn 1 has one action
    adv = turn_rloo_advantages(rewards, mask, turn, gids)
    est = score_fn * adv[:, 0]
    rloo = score_fn * rloo_advantages(rewards.sum(1), gids)
    def off_by(x):  # |mean - exact| in standard errors, over independent groups (members share baselines)
        per_group = x.view(groups, n).mean(1)
        return abs(per_group.mean().item() - exact) / (per_group.std().item() / groups ** 0.5)

    assert off_by(est) < 4 and off_by(rloo) < 4
    # per turn index: rewards normalised (minus the group mean of that index), then summed over the turns taken
    r0 = rewards[:, 0].view(groups, n)
    norm0 = (r0 - r0.mean(1, keepdim=True)).view(-1)
    r1 = torch.where(go, 0.0, float("nan")).view(groups, n)
    m1 = torch.nan_to_num(r1.nansum(1, keepdim=True) / (~r1.isnan()).sum(1, keepdim=True).clamp(min=1))
    norm1 = torch.where(go, (r1 - m1).view(-1), 0.0)
    assert off_by(score_fn * (norm0 + norm1)) > 6
