"""End-to-end training at a tiny scale on the embedded model and real environments.

- Bandit with GRPO: one iteration, outputs (metrics, plots, samples, HF checkpoint) checked.
- FrozenLake with PPO (GAE, critic on the shared trunk): two iterations uninterrupted, then
  the same run stopped after one iteration (the Ctrl-C path) and resumed with
  `fastpo train --resume`: the metrics must match the uninterrupted run's.
- Bandit with plain StarPO (KL to a frozen reference, on the reward and in the loss) and a
  separate critic: one update each, on the random tiny model.
"""
import math
import os
import shutil

import pytest
import torch
from rich.console import Console

import fastpo.trainer.update
from fastpo.cli import main as cli_main
from fastpo.config import load_config
from fastpo.distributed.context import SINGLE
from fastpo.seeds import clip_cov_seed
from fastpo.trainer import Trainer, TrainBatch
from run_helpers import records as _records, stable as _stable

pytestmark = pytest.mark.slow



def _cfg(env, out, *overrides):
    return load_config(env=env, preset="tiny", overrides=[f"trainer.output_dir={out}", *overrides])


def test_bandit_grpo_one_iteration_writes_everything(tmp_path, capsys):
    out = str(tmp_path / "run")
    cfg = _cfg("bandit", out, "algorithm.adv_estimator=grpo", "trainer.iterations=1", "trainer.eval_every=1")
    tr = Trainer(cfg, console=Console(quiet=True))
    records = tr.run()
    assert len(records) == 1
    rec = records[0]
    for key in ("train/success_rate", "train/score_mean", "train/score_std", "train/in_group_reward_std",
                "train/rollout_entropy", "train/response_length", "train/tokens_per_trajectory", "actor/grad_norm",
                "actor/pg_loss", "actor/clipfrac_low", "actor/clipfrac_high", "actor/approx_kl",
                "train/filter_kept_ratio", "train/format_penalty_rate", "train/valid_action_rate",
                "train/effective_action_rate", "time/rollout_s", "time/update_s", "perf/train_tokens_per_s",
                "eval/success_rate", "eval/pass@1", "ema/train/success_rate", "echo_trap_warning"):
        assert key in rec, key
    # on-policy first step: the old log-probs are the sampler's (old_logprob=auto, fp32 native
    # engine), and the update's log-probs equal them: ratio 1
    assert rec["train/old_logprob_from_sampler"] == 1.0
    assert rec["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert rec["actor/updates"] == 1 and rec["actor/skipped_updates"] == 0
    assert math.isfinite(rec["actor/grad_norm"]) and rec["actor/grad_norm"] > 0
    assert os.path.getsize(os.path.join(out, "plots", "success_rate.png")) > 1000
    samples = os.listdir(os.path.join(out, "samples"))
    assert samples and "<|im_start|>assistant" in open(os.path.join(out, "samples", samples[0])).read()
    from transformers import AutoModelForCausalLM

    ckpt = os.path.join(out, "checkpoints", "iter_000001", "model")
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    live = tr.model.state_dict()
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, live[k], rtol=0, atol=0)

    # A NaN loss skips the update and leaves the weights untouched.
    ids = [torch.tensor(tr.tokenizer("You pull the Dragon arm. <answer> Dragon </answer>")["input_ids"])]
    masks = [torch.zeros(len(ids[0]), dtype=torch.bool)]
    masks[0][-4:] = True
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    nan_batch = TrainBatch(ids, masks, [torch.zeros(len(ids[0]))], [2], old_logprobs=[torch.zeros(len(ids[0]))],
                           advantages=[torch.full((len(ids[0]),), float("nan"))])
    res = tr.parts.updater.update(2, nan_batch).reduce(SINGLE)
    assert res["actor/skipped_updates"] == 1 and res["actor/updates"] == 0
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, before[k]), k

    # `fastpo eval` on the checkpoint folder: success rate and pass@k
    from fastpo.cli import main

    assert main(["eval", "--env", "bandit", "--preset", "tiny", "--model", ckpt, "--seeds", "2", "--k", "2"]) == 0
    out_text = capsys.readouterr().out
    assert "success_rate" in out_text and "pass@2" in out_text


def test_frozenlake_ppo_resume_reproduces_uninterrupted_run(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    # the random tiny model (same tokenizer and checkpoint code as the embedded one, which took
    # 84 s of the suite here) and the tiny preset's two turns: PPO with its critic, an evaluation
    # and a CLI resume on a multi-turn game
    common = ["model.name=random:tiny-llama", "trainer.iterations=2", "trainer.eval_every=2", "trainer.save_every=1",
              "trainer.plots=false", "trainer.keep_checkpoints=1"]
    Trainer(_cfg("frozenlake", a, *common), console=Console(quiet=True)).run()
    full = _records(a)
    shutil.rmtree(os.path.join(a, "checkpoints"))
    assert [r["iteration"] for r in full] == [1, 2]
    assert "critic/value_loss" in full[0] and "eval/success_rate" in full[1]
    # the interrupted run: stops after iteration 1 exactly as Ctrl-C would (checkpoint, exit)
    Trainer(_cfg("frozenlake", b, *common), console=Console(quiet=True), stop_after=1).run()
    assert [r["iteration"] for r in _records(b)] == [1]
    assert cli_main(["train", "--resume", b]) == 0
    _same_records(full, _records(b))


def _same_records(full: list, resumed: list) -> None:
    """The records of an interrupted and resumed run equal the uninterrupted run's (all but timings)."""
    assert [r["iteration"] for r in resumed] == [r["iteration"] for r in full]
    for ra, rb in zip(full, resumed):
        sa, sb = _stable(ra), _stable(rb)
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], float):
                assert sb[k] == pytest.approx(sa[k], rel=1e-5, abs=1e-6), (ra["iteration"], k)
            else:
                assert sb[k] == sa[k], (ra["iteration"], k)


@pytest.mark.parametrize("kl_in_reward, kl_estimator", [(True, "k1"), (False, "k3")])
def test_kl_runs_resume_against_the_starting_model(tmp_path, kl_in_reward, kl_estimator):
    """A run with a KL term, stopped after iteration 1 and resumed, measures KL against the run's
    starting model (not against the policy the checkpoint holds), as the uninterrupted run does:
    KL on the reward (PPO with the shared critic, k1) and in the loss (k3)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    # a large learning rate so that the policy leaves the reference at once (a KL of 0 would pass)
    common = ["model.name=random:tiny-llama", "algorithm.kl_coef=0.1", f"algorithm.kl_estimator={kl_estimator}",
              f"algorithm.kl_in_reward={str(kl_in_reward).lower()}", "optim.actor_lr=1e-3", "trainer.iterations=2",
              "trainer.eval_every=0", "trainer.plots=false"]
    Trainer(_cfg("bandit", a, *common), console=Console(quiet=True)).run()
    full = _records(a)
    kl = "train/kl_reward" if kl_in_reward else "actor/kl"
    assert abs(full[1][kl]) > 1e-4, full[1][kl]
    Trainer(_cfg("bandit", b, *common), console=Console(quiet=True), stop_after=1).run()
    assert cli_main(["train", "--resume", b]) == 0
    _same_records(full, _records(b))


@pytest.mark.parametrize("kl_in_reward", [True, False])
def test_bandit_starpo_kl_separate_critic(tmp_path, kl_in_reward):
    # the random tiny model: this checks the wiring (reference model, KL on the reward or in
    # the loss, separate critic), not what the model learns
    out = str(tmp_path / "run")
    cfg = _cfg("bandit", out, "model.name=random:tiny-llama", "algorithm.kl_coef=0.01", "algorithm.kl_estimator=k1",
               f"algorithm.kl_in_reward={str(kl_in_reward).lower()}", "algorithm.critic=separate",
               "algorithm.clip_high=0.2", "trainer.iterations=1", "trainer.eval_every=0", "trainer.plots=false")
    tr = Trainer(cfg, console=Console(quiet=True))
    rec = tr.run()[0]
    assert tr.parts.models.reference is not None and tr.parts.models.critic_body is not None
    if kl_in_reward:  # verl's apply_kl_penalty: the KL is in the advantages, the loss has none
        assert math.isfinite(rec["train/kl_reward"]) and rec.get("actor/kl", 0.0) == 0.0
    else:
        assert "actor/kl" in rec and "train/kl_reward" not in rec, sorted(rec)
    assert rec["critic/grad_norm"] >= 0 and math.isfinite(rec["critic/value_loss"])
    assert os.path.exists(os.path.join(out, "checkpoints", "iter_000001", "critic", "value_head.safetensors"))
    assert os.path.exists(os.path.join(out, "checkpoints", "iter_000001", "critic", "config.json"))


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo", "clip_cov", "kl_cov"])
def test_each_policy_loss_trains_through_the_trainer(tmp_path, policy_loss, monkeypatch):
    """algorithm.policy_loss reaches the fused loss: one GRPO update (two PPO epochs) on the
    random tiny model per loss, its own metrics logged (the covariance losses' covfrac),
    finite, a gradient; Clip-Cov's draw seeded afresh per loss call."""
    out = str(tmp_path / "run")
    cfg = _cfg("bandit", out, "model.name=random:tiny-llama", "algorithm.adv_estimator=grpo",
               f"algorithm.policy_loss={policy_loss}", "algorithm.cov_ratio=0.05", "algorithm.clip_cov_lb=-1e9",
               "algorithm.clip_cov_ub=1e9", "optim.ppo_epochs=2", "trainer.iterations=1", "trainer.eval_every=0",
               "trainer.plots=false")
    tr = Trainer(cfg, console=Console(quiet=True))
    seeds = []
    real_loss = fastpo.trainer.update.linear_policy_loss

    def spy(*args, settings, **kw):
        seeds.append(settings.cov_seed)
        return real_loss(*args, settings=settings, **kw)

    monkeypatch.setattr(fastpo.trainer.update, "linear_policy_loss", spy)
    rec = tr.run()[0]
    assert math.isfinite(rec["actor/pg_loss"]) and rec["actor/grad_norm"] > 0
    assert len(seeds) >= 2
    if policy_loss == "clip_cov":  # a fresh draw per micro-batch, as verl's (not one pattern per run)
        assert seeds == [clip_cov_seed(cfg.trainer.seed, 1, i) for i in range(len(seeds))]
        assert len(set(seeds)) == len(seeds)
    if policy_loss in ("clip_cov", "kl_cov"):
        assert 0 < rec["actor/covfrac"] <= 0.2, rec["actor/covfrac"]
    else:
        assert "actor/covfrac" not in rec


def test_dynamic_sampling_draws_until_groups_vary_and_resumes_exactly(tmp_path):
    """DAPO's dynamic sampling (algorithm.filter_mode=dynamic): on FrozenLake the random tiny
    model's groups mostly score alike, so the trainer draws fresh env groups up to the cap;
    the kept groups all vary; an interrupted and resumed run draws the same groups."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = ["model.name=random:tiny-llama", "algorithm.adv_estimator=grpo", "algorithm.filter_mode=dynamic",
              "algorithm.dynamic_max_draws=3", "trainer.iterations=2", "trainer.eval_every=0", "trainer.plots=false",
              "trainer.save_every=1", "trainer.keep_checkpoints=1"]
    Trainer(_cfg("frozenlake", a, *common), console=Console(quiet=True)).run()
    full = _records(a)
    for rec in full:
        draws, varying = rec["train/dynamic_draws"], rec["train/dynamic_varying_groups"]
        groups = _cfg("frozenlake", a).rollout.env_groups
        assert 1 <= draws <= 3 and (draws == 3 or varying >= groups), rec
        assert rec["train/in_group_reward_std_kept"] > 0 or varying == 0
    assert any(r["train/dynamic_draws"] > 1 for r in full), "the case should need extra draws"
    Trainer(_cfg("frozenlake", b, *common), console=Console(quiet=True), stop_after=1).run()
    assert cli_main(["train", "--resume", b]) == 0
    _same_records(full, _records(b))


@pytest.mark.parametrize("estimator", ["bilevel_gae", "turn_rloo"])
def test_turn_level_estimators_train(tmp_path, estimator):
    """The turn-level estimators reach their function with each token's turn: one update on
    multi-turn FrozenLake (random tiny model; bilevel_gae with a critic on the trunk,
    turn_rloo with turn rewards), metrics finite."""
    out = str(tmp_path / "run")
    own = ["algorithm.critic=shared"] if estimator == "bilevel_gae" else ["algorithm.reward_position=turn"]
    cfg = _cfg("frozenlake", out, "model.name=random:tiny-llama", f"algorithm.adv_estimator={estimator}", *own,
               "rollout.max_turns=3", "trainer.iterations=1", "trainer.eval_every=0", "trainer.plots=false")
    rec = Trainer(cfg, console=Console(quiet=True)).run()[0]
    assert rec["train/num_turns"] > 1
    keys = ["actor/grad_norm", "train/advantage_std"] + (["critic/value_loss", "critic/return_mean", "actor/pg_loss"]
                                                        if estimator == "bilevel_gae" else [])
    for k in keys:
        assert math.isfinite(rec[k]), k
