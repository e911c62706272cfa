"""The trainer with the collapse metrics and RAGEN head's filters (random tiny model, FrozenLake):
`collapse/*` logged at iteration 1 and every `trainer.collapse_every`, a filter that keeps no
group skips the update (weights unchanged, metrics still logged), soft reweighting logged."""
import copy

import pytest
import torch
from rich.console import Console

from fastpo.config import load_config
from fastpo.trainer import Trainer


def _trainer(tmp_path, *overrides):
    cfg = load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "rollout.env_groups=2",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "optim.mini_batch_size=4", "trainer.eval_every=0",
        "trainer.save_every=0", "trainer.plots=false", *overrides])
    console = Console(record=True, width=200)
    return Trainer(cfg, console=console), console


def test_collapse_metrics_every_n_and_empty_filter_skips_the_update(tmp_path):
    # the random model never answers in format: every trajectory scores -0.2 (two penalised turns), so no group
    # has reward spread and linear top_p keeps none
    tr, console = _trainer(tmp_path, "trainer.iterations=3", "trainer.collapse_every=2",
                           "algorithm.filter_mode=top", "algorithm.filter_strategy=top_p", "algorithm.filter_ratio=0.9",
                           "algorithm.old_logprob=recompute")  # recomputed, so the sampler gap is measured
    tr.setup()
    start = copy.deepcopy(tr.model.state_dict())
    m1 = tr.iteration(1)
    assert m1["train/in_group_reward_std"] == 0 and m1["train/filter_zero_std_groups"] == 2
    assert m1["train/filter_kept_ratio"] == 0 and m1["actor/updates"] == 0 and "time/update_s" not in m1
    assert "kept no env group" in console.export_text()
    for name, p in tr.model.state_dict().items():
        assert torch.equal(p, start[name]), name
    # metrics of the skipped iteration are still measured on the whole batch
    assert m1["train/rollout_entropy"] > 0 and m1["train/logprob_gap_max"] < 1e-3
    # iteration 1 and every 2nd: the collapse metrics, with their cost
    for k in ("collapse/mi_estimate", "collapse/conditional_entropy_est", "collapse/reasoning_entropy_est",
              "collapse/mi_upper_bound", "collapse/retrieval_accuracy", "collapse/num_prompts", "time/collapse_s"):
        assert k in m1, k
    assert m1["collapse/num_prompts"] == 2 and m1["collapse/num_responses"] == 4
    assert "collapse/mi_estimate" not in tr.iteration(3) and "collapse/mi_estimate" in tr.iteration(2)
    # the sampler's policy is the one scored: matched log-probs are the sampled ones (H(Z|X) > 0, finite)
    assert 0 < m1["collapse/conditional_entropy_seq_est"] < 1e3


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_soft_reweight_scales_advantages(tmp_path, estimator):
    tr, _ = _trainer(tmp_path, "trainer.iterations=1", "trainer.collapse_every=0", "algorithm.filter_mode=none",
                     "algorithm.soft_advantage_reweight=true", f"algorithm.adv_estimator={estimator}")
    tr.setup()
    m = tr.iteration(1)
    assert "collapse/num_prompts" not in m and "time/collapse_s" not in m  # collapse_every=0: off
    # no reward spread anywhere: every weight is 0, so no advantage is left (GAE's whitened critic
    # advantages are not 0 before the reweighting)
    assert m["train/soft_reweight_max"] == 0 and m["actor/updates"] == 1
    assert m["actor/pg_loss"] == 0
