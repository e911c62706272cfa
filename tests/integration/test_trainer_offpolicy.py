"""Issue 13 in the training loop, on the random tiny model and the real Bandit / FrozenLake:
each new estimator and the off-policy tools (GSPO, IS correction, rollout reuse, replay)
run without NaN and log their metrics; the correction is a no-op on the native CPU engine;
reuse keeps the sampler's old log-probs; a resumed run with reuse and replay continues
identically.

The random model never writes a well-formed answer, so every Bandit reward would be the
same format penalty and every advantage 0. Where a test needs a learning signal, the
`varied_rewards` fixture replaces each rollout's rewards by Bandit-like values drawn from
the rollout's seed (everything else, model, engine, env, trainer, stays real); the
estimators themselves are checked by hand in test_offpolicy.py, and with the embedded model
in the runs of docs/algorithms.md."""
import json
import math
import os

import pytest
import torch
from rich.console import Console

from fastpo.config import load_config
from fastpo.trainer import Trainer
from run_helpers import stable as _stable

pytestmark = pytest.mark.slow

IS_KEYS = ("actor/is_ratio_mean", "actor/is_ratio_max", "actor/is_ratio_min", "actor/is_weight_mean",
           "actor/is_truncated_frac", "rollout/mismatch_kl")


def _cfg(env, out, *overrides):
    return load_config(env=env, preset="tiny", overrides=[
        f"trainer.output_dir={out}", "model.name=random:tiny-llama", "trainer.eval_every=0", "trainer.plots=false",
        *overrides])


def _run(env, out, *overrides, **kw):
    Trainer(_cfg(env, out, *overrides), console=Console(quiet=True), **kw).run()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


BANDIT = ("rollout.group_size=4", "optim.mini_batch_size=4", "optim.actor_lr=1e-3")


@pytest.fixture
def varied_rewards(monkeypatch):
    """Each rollout's turn rewards replaced by Bandit-like values (0.1, 1, 0, -0.1) drawn from
    the rollout's seed (deterministic, so resumed runs see the same)."""
    from fastpo.trainer.sampler import Sampler

    original = Sampler.generate

    def generate(self, seeds, group_size, temperature, seed, **kw):
        batch = original(self, seeds, group_size, temperature, seed, **kw)
        g = torch.Generator().manual_seed(seed)
        pick = torch.tensor([0.1, 1.0, 0.0, -0.1])[torch.randint(0, 4, (len(batch.scores),), generator=g)]
        batch.turn_rewards = torch.zeros_like(batch.turn_rewards)
        batch.turn_rewards[:, 0] = pick
        batch.scores = batch.turn_rewards.sum(1)
        return batch

    monkeypatch.setattr(Sampler, "generate", generate)


@pytest.mark.parametrize("overrides", [
    ("algorithm.adv_estimator=rloo", "algorithm.ratio_level=sequence", "algorithm.is_correction=tis",
     "algorithm.is_level=sequence"),
    ("algorithm.adv_estimator=reinforce_pp", "algorithm.is_correction=mis", "rollout.reuse=2",
     "algorithm.old_logprob=recompute"),
    ("algorithm.adv_estimator=reinforce_pp_baseline", "algorithm.is_correction=tis", "rollout.replay=2",
     "rollout.replay_fraction=0.5", "algorithm.kl_coef=0.01"),
], ids=["rloo-gspo-seq_tis", "reinforce_pp-mis-reuse", "reinforce_pp_baseline-replay-kl"])
def test_bandit_estimators_and_off_policy_tools_run_without_nan(tmp_path, overrides, varied_rewards):
    recs = _run("bandit", str(tmp_path / "run"), *BANDIT, "trainer.iterations=3", *overrides)
    assert [r["iteration"] for r in recs] == [1, 2, 3]
    for r in recs:
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (r["iteration"], k)
        for k in IS_KEYS + ("actor/pg_loss", "actor/grad_norm", "train/advantage_std"):
            assert k in r, (r["iteration"], k)
        assert r["actor/updates"] >= 1 and r["actor/skipped_updates"] == 0
    assert all(r["train/advantage_std"] > 0 and r["actor/grad_norm"] > 0 for r in recs)


def test_correction_is_a_no_op_on_the_native_cpu_engine(tmp_path):
    """With the native engine on the CPU the sampler's log-probs are the trainer's (within
    float rounding when recomputed): TIS changes the training metrics by < 1e-6."""
    common = ("algorithm.adv_estimator=grpo", "rollout.max_turns=1", "trainer.iterations=2",
              "algorithm.old_logprob=recompute")
    base = _run("frozenlake", str(tmp_path / "none"), *common)
    tis = _run("frozenlake", str(tmp_path / "tis"), *common, "algorithm.is_correction=tis")
    for ra, rb in zip(base, tis):
        assert rb["rollout/mismatch_kl"] < 1e-6 and abs(rb["actor/is_weight_mean"] - 1) < 1e-5
        sa = _stable(ra)
        for k, v in sa.items():
            if isinstance(v, float) and not k.startswith("ema/"):
                assert rb[k] == pytest.approx(v, abs=1e-6, rel=1e-6), k


def test_reuse_trains_again_on_the_sampled_batch(tmp_path, varied_rewards):
    recs = _run("bandit", str(tmp_path / "run"), *BANDIT, "trainer.iterations=4", "rollout.reuse=2",
                "algorithm.clip_high=0.2")
    assert [r["rollout/reuse_index"] for r in recs] == [0, 1, 0, 1]
    assert [r["time/rollout_s"] == 0.0 for r in recs] == [False, True, False, True]
    # the reused iteration logs its batch's rollout metrics again
    for a, b in ((recs[0], recs[1]), (recs[2], recs[3])):
        for k in ("train/success_rate", "train/score_mean", "train/response_length", "train/advantage_std"):
            assert a[k] == b[k], k
    # on-policy at the batch's first update; its reuse keeps the sampler's old log-probs, so
    # the ratio has moved away from 1 after the first update (when there was a gradient)
    assert recs[0]["actor/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    for r in (recs[1], recs[3]):
        assert abs(r["actor/ratio_max"] - 1) > 1e-6 or abs(r["actor/ratio_min"] - 1) > 1e-6


def test_resume_with_reuse_and_replay_reproduces_the_uninterrupted_run(tmp_path, varied_rewards):
    common = (*BANDIT, "trainer.iterations=4", "trainer.save_every=1", "rollout.reuse=2", "rollout.replay=1",
              "rollout.replay_fraction=1", "algorithm.is_correction=tis", "algorithm.adv_estimator=rloo")
    full = _run("bandit", str(tmp_path / "a"), *common)
    assert [r["replay/trajectories"] for r in full] == [0, 0, 4, 4]
    assert [r["replay/age_mean"] for r in full[2:]] == [2.0, 3.0]
    b = str(tmp_path / "b")
    # stopped after iteration 1 (mid reuse cycle: iteration 2 needs the held batch)
    _run("bandit", b, *common, stop_after=1)
    Trainer(_cfg("bandit", b, *common), resume=True, console=Console(quiet=True)).run()
    with open(os.path.join(b, "metrics.jsonl")) as f:
        resumed = [json.loads(line) for line in f]
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4]
    for ra, rb in zip(full, resumed):
        sa, sb = _stable(ra), _stable(rb)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert sb[k] == sa[k], (ra["iteration"], k)
    state = torch.load(os.path.join(b, "checkpoints", "iter_000004", "state.pt"), weights_only=True)  # plain data
    sched = state["rollout_schedule"]
    assert len(sched["current"]) == 4 and len(sched["buffer"]["items"]) == 4 and sched["started"] == 3
