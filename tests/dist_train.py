"""`fastpo train` for tests/integration/test_distributed.py, in one process or under torchrun (not a test
module itself):

    python tests/dist_train.py train ARGS...                                  # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_train.py train ARGS...

It runs the `fastpo` command (`fastpo.cli.entry(ARGS)`) with two test-only changes to the rollout:

- scores with spread: a random tiny model never writes a valid answer, so every trajectory
  would score the same format penalty and every advantage would be 0. Each trajectory's
  score is replaced by a function of its own sampled tokens, (sum of its response token ids
  mod 5) / 4, and success by score > 0.5: deterministic, and independent of how the batch is
  split over processes, so one and two processes must see the same scores. Evaluations'
  trajectories are scored the same way (so that their per-seed outcomes differ).
- flat groups: with FASTPO_TEST_FLAT_FROM=G, env groups G and above score 0.25 each (no
  spread), so StarPO-S keeps only groups below G and a rank holding only those keeps no
  trajectory (a rank with an empty share of the update).
- a failing rank: with FASTPO_TEST_FAIL_RANK=R and FASTPO_TEST_FAIL_ITERATION=I set, rank R
  raises RuntimeError("rank R: the env exploded in iteration I") in that iteration's rollout.

With FASTPO_TEST_TEARDOWN_NOTE=1 an atexit hook prints "dist_train: interpreter teardown" to
stderr: whether the process ended through the interpreter's teardown (one process) or
without it (a torchrun rank, fastpo.distributed.context.end_process).
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def token_scores(batch) -> torch.Tensor:
    """float32 [B]: (sum of each trajectory's sampled token ids mod 5) / 4."""
    vals = [float(int(torch.as_tensor(ids)[torch.as_tensor(m)].sum()) % 5) / 4.0
            for ids, m in zip(batch.input_ids, batch.loss_mask)]
    return torch.tensor(vals, dtype=torch.float32)


def _in_evaluation() -> bool:
    """Whether fastpo.evaluation.policy.evaluate_policy is on the call stack."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "evaluate_policy":
            return True
        f = f.f_back
    return False


def patch_rollout() -> None:
    from fastpo.rollout.multiturn import MultiTurnRollout

    original = MultiTurnRollout.generate
    fail_rank = os.environ.get("FASTPO_TEST_FAIL_RANK")
    fail_it = int(os.environ.get("FASTPO_TEST_FAIL_ITERATION", "0"))
    flat_from = os.environ.get("FASTPO_TEST_FLAT_FROM")
    calls = {"n": 0}

    def generate(self, seeds, group_size, temperature=None, seed=0, **kw):
        batch = original(self, seeds, group_size, temperature=temperature, seed=seed, **kw)
        if _in_evaluation():  # scored alike, not counted as an iteration's rollout
            batch.scores = token_scores(batch)
            batch.success = batch.scores > 0.5
            return batch
        calls["n"] += 1
        rank = os.environ.get("RANK", "0")
        if fail_rank is not None and rank == fail_rank and calls["n"] == fail_it:
            raise RuntimeError(f"rank {rank}: the env exploded in iteration {fail_it}")
        batch.scores = token_scores(batch)
        if flat_from is not None:
            batch.scores[batch.group_ids >= int(flat_from)] = 0.25
        batch.success = batch.scores > 0.5
        return batch

    MultiTurnRollout.generate = generate


if __name__ == "__main__":
    if os.environ.get("FASTPO_TEST_TEARDOWN_NOTE") == "1":
        import atexit

        atexit.register(lambda: print("dist_train: interpreter teardown", file=sys.stderr, flush=True))
    patch_rollout()
    from fastpo.cli import entry

    entry(sys.argv[1:])
