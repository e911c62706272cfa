"""DAPO's overlong reward shaping and overlong filtering (fastpo.algorithms.overlong), by hand
and through the trainer (one run with both, and its exact resume)."""
import os
import shutil

import pytest
import torch
from rich.console import Console

from fastpo.algorithms import overlong_penalty, truncated_turn_mask
from fastpo.cli import main as cli_main
from fastpo.config import load_config
from fastpo.trainer import Trainer
from run_helpers import records


def test_overlong_penalty_by_hand():
    # L_max 10, L_cache 4: free up to 6 tokens, then -1/4 per token, -1 at the limit
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 12])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 10, 4, factor=2.0)[4].item() == -1.0
    whole = overlong_penalty(torch.tensor([[3, 10]]), 10, 10)  # the buffer is the whole limit
    assert whole.shape == (1, 2) and whole[0].tolist() == pytest.approx([-0.3, -1.0])
    for bad, match in (((10, 0), "buffer must be in"), ((10, 11), "buffer must be in")):
        with pytest.raises(ValueError, match=match):
            overlong_penalty(lengths, *bad)
    with pytest.raises(ValueError, match="factor"):
        overlong_penalty(lengths, 10, 4, factor=-1.0)


def test_truncated_turn_mask_by_hand():
    mask = torch.tensor([False, True, True, False, True, True, True, False, True])
    turn = torch.tensor([-1, 0, 0, -1, 1, 1, 1, -1, 2])
    out = truncated_turn_mask(mask, turn, ["eot", "length", "stop_string"])
    assert out.tolist() == [False, True, True, False, False, False, False, False, True]
    assert truncated_turn_mask(mask, turn, ["eot", "eot", "eot"]) is mask
    ints = truncated_turn_mask(mask.long(), turn, ["length", "eot", "length"])
    assert ints.dtype == torch.long and ints.tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0]


def _cfg(out, *extra):
    return load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={out}", "model.name=random:tiny-llama", "algorithm.adv_estimator=grpo",
        "rollout.max_new_tokens=12", "algorithm.overlong_buffer=6", "algorithm.overlong_filter=true",
        "trainer.iterations=2", "trainer.eval_every=0", "trainer.plots=false", "trainer.save_every=1",
        "trainer.keep_checkpoints=1", *extra])


def test_overlong_shaping_and_filtering_in_training_resume_exactly(tmp_path):
    """The random tiny model rambles into the 12-token limit in every turn: each turn gets the
    full penalty (-1) and leaves the loss, so nothing is trained on (the partial cases are the
    by-hand tests above); a stopped and resumed run logs the same."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = _cfg(a)
    Trainer(cfg, console=Console(quiet=True)).run()
    full = records(a)
    shutil.rmtree(os.path.join(a, "checkpoints"))
    trajectories = cfg.rollout.env_groups * cfg.rollout.group_size
    for rec in full:
        assert rec["train/response_length_per_turn"] == 12.0  # every turn at the limit
        assert rec["train/overlong_penalty_mean"] == pytest.approx(-rec["train/num_turns"])
        assert rec["train/overlong_filtered_turns"] == pytest.approx(rec["train/num_turns"] * trajectories)
        assert rec["actor/grad_norm"] == 0.0 and "actor/pg_loss" not in rec  # no micro-batch had a scored token
    Trainer(_cfg(b), console=Console(quiet=True), stop_after=1).run()
    assert cli_main(["train", "--resume", b]) == 0
    again = records(b)
    for ra, rb in zip(full, again):
        for k in ("train/overlong_penalty_mean", "train/overlong_filtered_turns", "train/score_mean"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), k


def _two_turn_group():
    """Two trajectories of one env group, two turns each (one observation token between):
    trajectory 0's second turn stopped at the length limit (rollout.max_new_tokens = 2) with env
    reward 2.0; every other turn ended normally, shorter, with reward 0."""
    from fastpo.rollout.trajectory_batch import TrajectoryBatch

    ids = torch.tensor([7, 1, 2, 3, 4, 5])
    mask = torch.tensor([False, True, True, False, True, True])
    turn = torch.tensor([-1, 0, 0, -1, 1, 1])
    b = 2
    return TrajectoryBatch(
        input_ids=[ids] * b, loss_mask=[mask.clone() for _ in range(b)], sample_logprobs=[torch.zeros(6)] * b,
        turn_index=[turn] * b, turn_rewards=torch.tensor([[0.0, 2.0], [0.0, 0.0]]), format_penalty=torch.zeros(b, 2),
        num_turns=torch.full((b,), 2), scores=torch.tensor([2.0, 0.0]), success=torch.zeros(b, dtype=torch.bool),
        num_actions=torch.full((b,), 2), group_ids=torch.zeros(b, dtype=torch.long),
        seeds=torch.zeros(b, dtype=torch.long), truncated=torch.zeros(b, dtype=torch.bool),
        stop_reason=["max_turns"] * b,
        # (lengths for the overlong penalty, L_max 2, buffer 1: 1 token is free, 2 tokens cost -1)
        responses=[[torch.tensor([1]), torch.tensor([4, 5])], [torch.tensor([1]), torch.tensor([4])]],
        response_texts=[["", ""]] * b, metrics={}, turn_stop_reasons=[["eot", "length"], ["eot", "eot"]])


def _advantages_after_overlong(tmp_path, estimator, overlong_filter):
    """The trainer's overlong step, then its advantage step, on `_two_turn_group` (no model)."""
    from fastpo.distributed.context import SINGLE
    from fastpo.trainer.batch_advantages import Advantages
    from fastpo.trainer.batch import TrainBatch
    from fastpo.trainer.metric_sums import MetricSums
    from fastpo.trainer.plan import rl_plan
    from fastpo.trainer.sampler import overlong_shaping

    cfg = load_config(env="frozenlake", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path}", f"algorithm.adv_estimator={estimator}", "algorithm.reward_position=turn",
        "algorithm.whiten_advantages=false", "rollout.max_new_tokens=2", "algorithm.overlong_buffer=1",
        f"algorithm.overlong_filter={str(overlong_filter).lower()}"])
    rollout = _two_turn_group()
    sums = MetricSums()
    overlong_shaping(cfg, rollout, sums)
    batch = TrainBatch.from_rollout(rollout, 0)
    batch.values = [torch.zeros(6)] * 2
    Advantages(cfg, SINGLE, rl_plan(cfg, False)).estimate(rollout, batch, sums)
    return batch, sums.reduce(SINGLE)


@pytest.mark.parametrize("estimator", ["gae", "bilevel_gae", "turn_rloo", "reinforce_pp"])
def test_a_cut_turn_leaves_the_loss_but_its_reward_and_penalty_reach_the_earlier_turn(tmp_path, estimator):
    """Overlong filtering takes the cut turn out of the loss only: its reward (2.0) and its overlong
    penalty (-1.0 at the limit) still reach turn 0's advantage, exactly as without the filter.
    (Before, the turn left the loss mask before the rewards were placed: turn 0 of trajectory 0
    saw neither, and its advantage was trajectory 1's.)"""
    batch, metrics = _advantages_after_overlong(tmp_path, estimator, True)
    kept, _ = _advantages_after_overlong(tmp_path, estimator, False)
    assert metrics["train/overlong_filtered_turns"] == 1 and metrics["train/overlong_penalty_mean"] == -0.5
    assert batch.loss_mask[0].tolist() == [False, True, True, False, False, False]
    assert batch.loss_mask[1].tolist() == [False, True, True, False, True, True]
    assert batch.advantages[0][4:].tolist() == [0.0, 0.0]
    assert torch.equal(batch.advantages[0][:4], kept.advantages[0][:4])
    assert torch.equal(batch.advantages[1], kept.advantages[1])
    # turn 0 of the cut trajectory is credited with the cut turn's net reward 2.0 - 1.0, its group mate's with 0
    assert float(batch.advantages[0][1]) > float(batch.advantages[1][1])
