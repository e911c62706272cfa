"""Issue 13's pure pieces: RLOO and REINFORCE++ advantages, the importance-sampling
correction (tis / mis, token / sequence), the replay buffer and the config keys, each
against values computed by hand."""
import math
import subprocess
import sys

import pytest
import torch

from fastpo.algorithms import (reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages,
                               rollout_correction)
from fastpo.config import load_config
from fastpo.config.fields import ConfigError
from fastpo.trainer.replay import ReplayBuffer

# ---- estimators ----


def test_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    # group 0 (sum 2, n 4): A = R - (2 - R) / 3; group 1: R minus the other one; group 2 alone: 0
    want = torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0.3, -0.3, 0.0])
    torch.testing.assert_close(rloo_advantages(scores, groups), want)
    # equal scores carry no signal; n/(n-1) times GRPO's centring without the std
    assert rloo_advantages(torch.full((4,), -0.1), torch.zeros(4, dtype=torch.long)).abs().max() == 0
    with pytest.raises(ValueError, match="must both be"):
        rloo_advantages(scores, groups[:3])


def test_reinforce_pp_by_hand():
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.zeros(2, 5)
    rewards[0, 2], rewards[0, 4], rewards[1, 1] = 0.5, 1.0, -1.0
    rewards[0, 3] = 7.0  # off the mask (an observation token): never counted
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # returns over model tokens only: row 0: G(4) = 1, G(2) = 0.5 + 0.5 * 1, G(1) = 0 + 0.5 * 1.0; row 1: -1, -0.5
    want_ret = torch.tensor([[0.0, 0.5, 1.0, 0.0, 1.0], [-0.5, -1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ret, want_ret)
    # batch whitening over the 5 model tokens: mean 0.2, sample variance 3.3 / 4
    std = math.sqrt(3.3 / 4 + 1e-8)
    want = torch.where(mask, (want_ret - 0.2) / std, torch.zeros(2, 5))
    torch.testing.assert_close(adv, want)
    with pytest.raises(ValueError, match="gamma"):
        reinforce_pp_advantages(rewards, mask, gamma=1.5)


def test_reinforce_pp_baseline_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    lengths = [2, 1, 3, 1, 2]
    mask = torch.zeros(5, 4, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 4 - n:] = True
    adv = reinforce_pp_baseline_advantages(scores, groups, mask)
    # centred: 0.5, -0.5, 0, 0 and 2 (a group of one: baseline 0); per token (9 tokens) mean 0.5,
    # deviations 0, 0, -1, -.5, -.5, -.5, -.5, 1.5, 1.5: sample variance 6.5 / 8
    std = math.sqrt(6.5 / 8 + 1e-8)
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0, 2.0])
    want = torch.where(mask, (centred[:, None] - 0.5) / std, torch.zeros(5, 4))
    torch.testing.assert_close(adv, want)
    with pytest.raises(ValueError, match="rows"):
        reinforce_pp_baseline_advantages(scores, groups, mask[:4])


# ---- importance-sampling correction ----

def _correction_case():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    rho = torch.tensor([[3.0, 0.25, 1.5, 1.0], [0.9, 1.1, 1.0, 1.0]])
    sample = torch.full((2, 4), -2.0)
    old = sample + torch.log(rho)
    old[0, 3] = math.nan  # off the mask: may hold anything
    sample[1, 3] = -math.inf
    return old, sample, mask, rho


def test_tis_token_by_hand():
    old, sample, mask, rho = _correction_case()
    c = rollout_correction(old, sample, mask, "tis", "token", cap=2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[2.0, 0.25, 1.5, 0.0], [0.9, 1.1, 0.0, 0.0]]))
    assert torch.equal(c.keep, mask)
    m = c.metrics
    assert m["is_ratio_mean"] == pytest.approx((3 + 0.25 + 1.5 + 0.9 + 1.1) / 5, rel=1e-6)
    assert m["is_ratio_max"] == pytest.approx(3.0, rel=1e-6) and m["is_ratio_min"] == pytest.approx(0.25, rel=1e-6)
    assert m["is_weight_mean"] == pytest.approx((2 + 0.25 + 1.5 + 0.9 + 1.1) / 5, rel=1e-6)
    assert m["is_truncated_frac"] == pytest.approx(1 / 5)
    k3 = [r - 1 - math.log(r) for r in (3.0, 0.25, 1.5, 0.9, 1.1)]
    assert m["mismatch_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert all(math.isfinite(v) for v in m.values())


def test_mis_token_by_hand():
    old, sample, mask, _ = _correction_case()
    c = rollout_correction(old, sample, mask, "mis", "token", cap=2.0)
    # the band [0.5, 2] drops the tokens with ratio 3 and 0.25 from the loss
    torch.testing.assert_close(c.weights, torch.tensor([[0.0, 0.0, 1.5, 0.0], [0.9, 1.1, 0.0, 0.0]]))
    assert c.keep.tolist() == [[False, False, True, False], [True, True, False, False]]
    assert c.metrics["is_truncated_frac"] == pytest.approx(2 / 5)
    assert c.metrics["is_weight_mean"] == pytest.approx((1.5 + 0.9 + 1.1) / 5, rel=1e-6)


def test_sequence_level_by_hand():
    old, sample, mask, _ = _correction_case()
    # trajectory ratios: 3 * 0.25 * 1.5 = 1.125 and 0.9 * 1.1 = 0.99
    c = rollout_correction(old, sample, mask, "tis", "sequence", cap=2.0)
    torch.testing.assert_close(c.weights, torch.tensor([[1.125] * 3 + [0.0], [0.99] * 2 + [0.0] * 2]))
    assert c.metrics["is_ratio_mean"] == pytest.approx((1.125 + 0.99) / 2, rel=1e-6)
    assert c.metrics["is_truncated_frac"] == 0.0
    t = rollout_correction(old, sample, mask, "tis", "sequence", cap=1.1)
    torch.testing.assert_close(t.weights[0, :3], torch.full((3,), 1.1))
    assert t.metrics["is_truncated_frac"] == pytest.approx(0.5)
    # mis with cap 1.1: band [0.909, 1.1]; trajectory 0 (1.125) is dropped whole
    m = rollout_correction(old, sample, mask, "mis", "sequence", cap=1.1)
    assert m.keep.tolist() == [[False] * 4, [True, True, False, False]]
    torch.testing.assert_close(m.weights[1], torch.tensor([0.99, 0.99, 0.0, 0.0]))
    assert m.metrics["is_truncated_frac"] == pytest.approx(0.5)
    # the mismatch KL is per token whatever the level
    assert m.metrics["mismatch_kl"] == pytest.approx(c.metrics["mismatch_kl"])


def test_none_and_identical_logprobs_are_a_no_op():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 6, generator=g) * 5
    mask = torch.rand(3, 6, generator=g) > 0.3
    for mode in ("none", "tis", "mis"):
        for level in ("token", "sequence"):
            c = rollout_correction(lp, lp.clone(), mask, mode, level, cap=2.0)
            assert torch.equal(c.weights, mask.float()) and torch.equal(c.keep, mask), (mode, level)
            assert c.metrics["mismatch_kl"] == 0.0 and c.metrics["is_truncated_frac"] == 0.0
            assert c.metrics["is_ratio_mean"] == 1.0
    # "none" ignores the gap, but still measures it
    c = rollout_correction(lp + 0.5, lp, mask, "none", "token")
    assert torch.equal(c.weights, mask.float()) and c.metrics["is_ratio_mean"] == pytest.approx(math.exp(0.5))
    assert c.metrics["mismatch_kl"] == pytest.approx(math.exp(0.5) - 1 - 0.5, rel=1e-6)


def test_long_sequence_ratio_does_not_overflow():
    mask = torch.ones(1, 400, dtype=torch.bool)
    c = rollout_correction(torch.zeros(1, 400), torch.full((1, 400), -1.0), mask, "tis", "sequence", cap=2.0)
    assert torch.isfinite(c.weights).all() and c.weights.max() == 2.0
    assert math.isfinite(c.metrics["is_ratio_max"])


def test_correction_bad_arguments():
    lp, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="'clip'"):
        rollout_correction(lp, lp, mask, "clip")
    with pytest.raises(ValueError, match="'trajectory'"):
        rollout_correction(lp, lp, mask, "tis", "trajectory")
    with pytest.raises(ValueError, match="cap must be a finite number > 1, got 1.0"):
        rollout_correction(lp, lp, mask, "tis", cap=1.0)
    with pytest.raises(ValueError, match="sample_logprob has shape"):
        rollout_correction(lp, lp[:, :2], mask)


def test_weights_enter_the_loss_as_is_weights():
    """tis weights and the mis keep mask, fed to the fused loss, equal the loss written out."""
    from fastpo.kernels import linear_policy_loss, reference_logprob_entropy

    g = torch.Generator().manual_seed(3)
    n, h, v = 12, 8, 40
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 3
    targets = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():
        lp, _ = reference_logprob_entropy(hidden, weight, targets)
    sample = (lp + 0.8 * torch.randn(n, generator=g))[None]
    mask = torch.ones(1, n, dtype=torch.bool)
    adv = torch.randn(n, generator=g)
    for mode in ("tis", "mis"):
        c = rollout_correction(lp[None], sample, mask, mode, "token", cap=1.5)
        assert 0 < c.metrics["is_truncated_frac"] < 1, mode
        out = linear_policy_loss(hidden, weight, targets, lp, adv, c.keep[0], is_weights=c.weights[0],
                                 impl="chunked")
        k = c.keep[0]
        # on-policy trainer ratio 1: the loss is -mean over kept tokens of w * A
        want = -(c.weights[0][k] * adv[k]).sum() / k.sum()
        torch.testing.assert_close(out.loss, want)


# ---- replay buffer ----

def _items(start, n):
    return [{"input_ids": torch.arange(i, i + 3), "sample_logprobs": torch.full((3,), -float(i)), "iteration": i}
            for i in range(start, start + n)]


def test_replay_buffer_bounded_oldest_dropped():
    buf = ReplayBuffer(5)
    assert buf.add(_items(0, 3)) == 0 and len(buf) == 3
    assert buf.add(_items(3, 4)) == 2  # 7 added, capacity 5: items 0 and 1 dropped
    assert [it["iteration"] for it in buf.items()] == [2, 3, 4, 5, 6]
    assert (buf.added, buf.dropped, buf.capacity) == (7, 2, 5)
    assert ReplayBuffer(0).add(_items(0, 2)) == 2


def test_replay_buffer_stores_copies_and_samples_reproducibly():
    buf = ReplayBuffer(10)
    src = _items(0, 6)
    buf.add(src)
    src[0]["input_ids"][0] = 99  # the caller's tensors can change; the buffer's do not
    assert buf.items()[0]["input_ids"][0] == 0
    a = buf.sample(4, torch.Generator().manual_seed(7))
    b = buf.sample(4, torch.Generator().manual_seed(7))
    assert [x["iteration"] for x in a] == [x["iteration"] for x in b]
    assert len({x["iteration"] for x in a}) == 4  # distinct
    assert len(buf.sample(50, torch.Generator().manual_seed(1))) == 6 and buf.sample(0, torch.Generator()) == []
    # uniform: over many draws every item comes up about equally often
    g = torch.Generator().manual_seed(2)
    counts = [0] * 6
    for _ in range(600):
        for x in buf.sample(2, g):
            counts[x["iteration"]] += 1
    assert min(counts) > 150 and max(counts) < 250, counts


def test_replay_buffer_state_dict_round_trip(tmp_path):
    buf = ReplayBuffer(4)
    buf.add(_items(0, 6))
    path = tmp_path / "state.pt"
    torch.save(buf.state_dict(), path)
    other = ReplayBuffer(4)
    other.load_state_dict(torch.load(path, weights_only=True))  # plain containers and tensors
    assert [it["iteration"] for it in other.items()] == [2, 3, 4, 5]
    assert (other.added, other.dropped) == (6, 2)
    for x, y in zip(buf.items(), other.items()):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["sample_logprobs"], y["sample_logprobs"])
    # the same draws after the round trip
    assert ([x["iteration"] for x in buf.sample(3, torch.Generator().manual_seed(5))]
            == [x["iteration"] for x in other.sample(3, torch.Generator().manual_seed(5))])
    # a smaller buffer keeps the newest
    small = ReplayBuffer(2)
    small.load_state_dict(buf.state_dict())
    assert [it["iteration"] for it in small.items()] == [4, 5]


def test_replay_buffer_bad_input():
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(-1)
    buf = ReplayBuffer(3)
    with pytest.raises(TypeError, match="dict"):
        buf.add([torch.zeros(3)])
    with pytest.raises(TypeError, match="'x'"):
        buf.add([{"x": [1, 2]}])
    with pytest.raises(ValueError, match=">= 0"):
        buf.sample(-1, torch.Generator())
    with pytest.raises(ValueError, match="state_dict"):
        buf.load_state_dict({"items": []})


# ---- configuration ----

def test_config_defaults_and_estimators():
    cfg = load_config(env="bandit", preset="paper")
    r, a = cfg.rollout, cfg.algorithm
    assert (r.reuse, r.replay, r.replay_fraction) == (1, 0, 0.5)
    assert (a.ratio_level, a.is_correction, a.is_level, a.is_cap) == ("token", "none", "token", 2.0)
    for est, kl_reward in (("rloo", False), ("reinforce_pp", True), ("reinforce_pp_baseline", False)):
        cfg = load_config(env="bandit", preset="paper", overrides=[f"algorithm.adv_estimator={est}"])
        assert cfg.kl_in_reward is kl_reward, est
    cfg = load_config(env="bandit", preset="paper", overrides=[
        "algorithm.ratio_level=sequence", "algorithm.is_correction=mis", "algorithm.is_level=sequence",
        "algorithm.is_cap=1.5", "rollout.reuse=4", "rollout.replay=3", "rollout.replay_fraction=1"])
    assert cfg.rollout.reuse == 4 and cfg.algorithm.is_cap == 1.5


@pytest.mark.parametrize("override, words", [
    (["algorithm.is_cap=1.0"], ["algorithm.is_cap", "must be > 1"]),
    (["algorithm.is_cap=0.5", "algorithm.is_correction=tis"], ["algorithm.is_cap"]),
    (["rollout.reuse=0"], ["rollout.reuse", ">= 1"]),
    (["rollout.replay=-1"], ["rollout.replay", ">= 0"]),
    (["rollout.replay_fraction=1.5"], ["rollout.replay_fraction", "[0, 1]"]),
    (["rollout.replay_fraction=-0.1"], ["rollout.replay_fraction"]),
    (["algorithm.ratio_level=sequence", "algorithm.is_correction=tis"], ["algorithm.is_level", "contradicts",
                                                                         "ratio_level='sequence'"]),
    (["algorithm.ratio_level=sequence", "algorithm.is_correction=mis", "algorithm.is_level=token"],
     ["algorithm.is_level"]),
    (["algorithm.adv_estimator=rloo", "rollout.group_size=1"], ["rollout.group_size", "'rloo'"]),
    (["algorithm.adv_estimator=reinforce_pp_baseline", "rollout.group_size=1"], ["rollout.group_size"]),
    (["algorithm.adv_estimator=reinforce"], ["algorithm.adv_estimator", "reinforce_pp"]),
    (["algorithm.is_correction=is"], ["algorithm.is_correction", "'tis'"]),
    (["rollout.reuse=1.5"], ["rollout.reuse", "expected int"]),
])
def test_config_errors_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(env="bandit", preset="paper", overrides=override)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_sequence_ratio_without_correction_or_with_sequence_level_is_fine():
    for extra in ([], ["algorithm.is_correction=tis", "algorithm.is_level=sequence"]):
        load_config(env="bandit", preset="paper", overrides=["algorithm.ratio_level=sequence", *extra])
    # reinforce_pp needs no group (it normalises over the batch)
    load_config(env="bandit", preset="paper", overrides=["algorithm.adv_estimator=reinforce_pp",
                                                         "rollout.group_size=1", "optim.mini_batch_size=1"])


def test_cli_refuses_bad_off_policy_keys_before_loading():
    check = ("import sys\nfrom fastpo.cli import main\nrc = main(sys.argv[1:])\n"
             "assert 'fastpo.model_loading' not in sys.modules and 'fastpo.rollout' not in sys.modules\nsys.exit(rc)\n")
    p = subprocess.run([sys.executable, "-c", check, "train", "--env", "bandit", "algorithm.is_cap=1",
                        "algorithm.is_correction=tis"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "algorithm.is_cap" in p.stderr and "must be > 1" in p.stderr


def test_rollout_schedule_reuse_and_replay():
    from fastpo.trainer.replay import RolloutSchedule

    s = RolloutSchedule(reuse=3, replay=2, fraction=0.5, batch_size=4, seed=1)
    rolled = []
    for it in range(1, 11):
        fresh = s.needs_rollout(it)
        if fresh:
            rolled.append(it)
        assert s.reuse_index(it, fresh) == (it - 1) % 3
        # drawn before `start` takes the new batch: the batch it replaces is already replayable
        rep = s.replayed(it, 4, fresh)
        assert len(rep) == (0 if it < 4 else 2) and len(s.pool(fresh)) == (0 if it < 4 else 4 if it < 7 else 8)
        if fresh:
            s.start(it, _items(10 * it, 4), {"train/success_rate": it / 10})
        # the replayed are from earlier batches only, never the one being trained on
        assert all(x["iteration"] < 10 * s.started for x in rep)
    assert rolled == [1, 4, 7, 10]
    # 2 batches x 4 kept: the batches of iterations 4 and 7 (1's was dropped)
    assert sorted({x["iteration"] // 10 for x in s.buffer.items()}) == [4, 7]
    # a resumed schedule continues the cycle and draws the same
    t = RolloutSchedule(reuse=3, replay=2, fraction=0.5, batch_size=4, seed=1)
    t.load_state_dict(torch.load(_save(s.state_dict()), weights_only=True))
    assert not t.needs_rollout(11) and t.needs_rollout(13) and t.reuse_index(11) == 1
    assert t.metrics == {"train/success_rate": 1.0}
    assert [x["iteration"] for x in t.replayed(11, 4)] == [x["iteration"] for x in s.replayed(11, 4)]
    # reuse 1 and no replay: a rollout every iteration, nothing replayed
    u = RolloutSchedule()
    for it in (1, 2, 3):
        assert u.needs_rollout(it)
        u.start(it, _items(it, 2))
        assert u.replayed(it, 2) == [] and len(u.buffer) == 0
    with pytest.raises(ValueError, match="reuse"):
        RolloutSchedule(reuse=0)
    with pytest.raises(ValueError, match="fraction"):
        RolloutSchedule(replay=1, fraction=1.5)


def _save(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf
