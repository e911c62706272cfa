"""The StarPO / StarPO-S training loop (RAGEN, arXiv 2504.20073, Alg. 1).

One iteration (`Trainer.iteration` in `step`, read top to bottom):

1. rollout (`Sampler.roll_out`): P env groups x N trajectories from seeds derived from (seed,
   iteration), with the native engine sharing the policy module (so step 6 needs no weight
   transfer); reward.fn and the LLM judge rescore them; DAPO's extra draws and overlong shaping;
2. filter: StarPO-S keeps the env groups with the highest in-group reward std;
3. batch: the kept trajectories as one record (`TrainBatch`);
4. old log-probs (and values, reference log-probs; `LogProbComputer.old_logprobs`) recomputed by the
   trainer on packed micro-batches, the gap to the sampling log-probs logged
   (`train/logprob_gap_*`); or, where they are the same quantity (`algorithm.old_logprob`,
   fastpo.trainer.old_logprob), the sampler's own log-probs and entropies, with a shared
   critic's values read out in the sampling pass, and only what is still missing computed;
5. advantages (`Advantages.estimate`): GAE over model tokens with the critic (PPO),
   group-baselined scores (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline) or batch-normalised
   returns (REINFORCE++); off-policy data (fastpo.trainer.replay): with `rollout.reuse` = K > 1
   the next K - 1 iterations skip steps 1-5 and train again on this batch; `rollout.replay`
   mixes in trajectories of earlier batches (old log-probs recomputed); `algorithm.is_correction`
   weighs the sampler -> trainer gap (fastpo.algorithms.correction);
6. update (`PolicyUpdater.update`): `ppo_epochs` passes over shuffled mini-batches of
   trajectories, each split into token-budget micro-batches with gradient accumulation, fused
   policy loss from `fastpo.kernels`, clipped value loss, gradient clipping; a non-finite loss
   or gradient skips the update with a warning; the engine sees the new weights (same module).
   The loop (`RunLoop`) then evaluates, logs, plots and saves as configured.

Data parallel (N processes under torchrun, `dist`; README "Several processes"): each rank
rolls out its whole env groups (each group from its own sampling stream, so trajectories do
not depend on N), the StarPO-S filter ranks every rank's groups, advantages are per group
(batch statistics such as GAE's whitening over every rank's tokens), the mini-batches are
those of the global batch with global loss denominators, gradients are summed over the
ranks before clipping (trainer.data_parallel: `fsdp`, the default, shards the policy, a
separate critic and the value head with FSDP2, their parameters gathered whole for the
rollout and the evaluation; `replicate` keeps whole parameters and optimizer state on every
rank), and rank 0 alone evaluates and writes metrics, samples and checkpoints (whole model
and optimizer state, gathered from the shards). One process is a world of one: the same
steps, whose collectives are identities (fastpo.distributed).

Stopping is a flag (`lifecycle.StopControl`): the signal handler sets it, the run reads it at
named points. Ctrl-C (SIGINT) finishes the iteration, saves and exits; SIGTERM (what
schedulers send before they kill) stops within a bounded time: a rollout ends after the turn
under way, an iteration whose update has not begun is dropped (resume redoes it
identically), an update under way is finished, and an evaluation it interrupts or would start
is postponed to the resume; then the last complete iteration is saved (`lifecycle.StopPaths`).
The process holds its run folder (`fastpo.run.folder.RunLock`). Data parallel, a signal takes
effect at the next point the ranks share (before the iteration's update, where SIGTERM drops
the iteration, or after it), so a rollout or an evaluation under way finishes first; rank 0
saves; there is no second-signal abort (torchrun kills the workers itself after its grace
period).

The package's files are the trainer's parts: `batch` (`TrainBatch`, the one record of the
trajectories in training), `plan` (`RunPlan`: the settings decided once at set-up), `models`
(policy, reference, critic; autocast), `sampler` (engine and rollout: an iteration's batch, the
evaluation), `logprobs` (`LogProbComputer`: packed micro-batches, old log-probs, values), `batch_advantages`
(`Advantages`), `replay` (reuse, replay, the importance-sampling correction), `update`
(`PolicyUpdater`: optimizers, the optimizer step on an accumulated micro-batch loss, PPO's
epochs), `lifecycle` (`StopControl`, `StopPaths`: signals and stops; `Checkpointer`), `setup`
(the run folder, the parts built, resume, the logger), `loop` (`RunLoop`, shared with SFT)
and `step` (`Trainer`: the iteration; `train`).
"""
from fastpo.trainer.batch import TrainBatch
from fastpo.trainer.lifecycle import Stopped
from fastpo.trainer.loop import RunLoop
from fastpo.trainer.models import ValueHead
from fastpo.trainer.sampler import NothingToTrain
from fastpo.trainer.step import Trainer, train
from fastpo.trainer.update import loss_denominator, policy_loss_settings

__all__ = ["Trainer", "train", "RunLoop", "TrainBatch", "Stopped", "NothingToTrain", "ValueHead", "loss_denominator",
           "policy_loss_settings"]
