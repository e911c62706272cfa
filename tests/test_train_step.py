"""Stopping as a flag (issue 57, item 1): a SIGTERM sets a flag that the rollout reads between
turns, so nothing is thrown through the rollout. Tiny model (random:tiny-llama), seconds.
"""
import os
import signal

import fastpo.rollout
from fastpo.cli import main

TINY = ["--model", "random:tiny-llama", "--preset", "tiny", "--device", "cpu"]
QUIET = ["trainer.plots=false", "trainer.eval_every=0", "trainer.eval_before_training=false", "rollout.think=false",
         "rollout.max_new_tokens=8"]


def test_a_sigterm_in_a_rollout_ends_it_between_turns_and_throws_nothing_through_it(tmp_path, monkeypatch, capsys):
    """A real SIGTERM during turn 1 of 3: the handler only sets the flag (the code it
    interrupted goes on), the rollout returns after that turn without generating turn 2, the
    iteration is dropped before its update, and the run exits 143 saying so. (Before, the
    handler raised an exception from inside the rollout.)"""
    seen = {"turns": 0, "went_on": False, "raised": None, "returned": 0}
    real_score, real_generate = fastpo.rollout.MultiTurnRollout._score_turn, fastpo.rollout.MultiTurnRollout.generate

    def score(self, st, texts, turn):
        seen["turns"] += 1
        try:
            signal.raise_signal(signal.SIGTERM)
            seen["went_on"] = True
        except BaseException as e:
            seen["raised"] = type(e).__name__
            raise
        return real_score(self, st, texts, turn)

    def generate(self, *a, **k):
        batch = real_generate(self, *a, **k)
        seen["returned"] += 1
        return batch

    monkeypatch.setattr(fastpo.rollout.MultiTurnRollout, "_score_turn", score)
    monkeypatch.setattr(fastpo.rollout.MultiTurnRollout, "generate", generate)
    out = str(tmp_path / "run")
    status = main(["train", "--env", "sokoban", *TINY, "--out", out, "--iterations", "2", *QUIET,
                   "rollout.max_turns=3", "trainer.save_every=1"])
    said = capsys.readouterr().out
    assert seen == {"turns": 1, "went_on": True, "raised": None, "returned": 1}, seen
    assert status == 143
    assert "stopped in iteration 1 before its update" in said
    assert not os.path.isdir(os.path.join(out, "checkpoints"))
