"""Data-parallel training on `torch.distributed`, for processes started by `torchrun`.

One process is a world of one whose collectives are identities (`SINGLE`: torch.distributed
never initialised), so the trainer runs one code path for one process and N. By job:

- context: this process's place in the job (`DistContext`), joining and leaving the process
  group (gloo on the CPU, NCCL on CUDA) with a timeout on every collective, so that a rank
  that fails or hangs ends the whole job instead of leaving the others waiting.
- launch: `fastpo train|eval --nproc N` relaunched under torchrun, and the settings the
  data-parallel trainer cannot run yet refused before anything loads (`check_trainer_support`).
- collectives: rank-0-only side effects with the result or the error shared (`on_main`),
  work shared out and gathered (`gather_results`), global batch statistics (the metrics of
  an iteration are reduced once, by fastpo.trainer.metric_sums).
- data_parallel: the global batch: env groups split whole across ranks with seeds
  independent of the world size, the StarPO-S filter over every rank's groups, the loss
  normaliser of a mini-batch spread over ranks.
- sharding: the gradient exchange (replicated parameters with summed gradients, or FSDP2)
  and rank 0's full state dict written as one HF-format folder.

Launch: `torchrun --nproc_per_node N -m fastpo train ...` (or `fastpo train --nproc N`),
which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each process.
"""
