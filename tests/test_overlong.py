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
