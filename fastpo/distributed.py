"""Data-parallel training on `torch.distributed`, for processes started by `torchrun`.

Process-group setup from torchrun's environment (gloo on the CPU, NCCL on CUDA) with a
timeout on every collective, so that a rank that fails or hangs ends the whole job instead
of leaving the others waiting; rank-0-only side effects (metrics, checkpoints) with the
result, or the error, shared (`on_main`); work shared out with the results gathered to rank 0
and any rank's error raised on all (`gather_results`, e.g. the evaluation's seeds split by
`split_evenly`); the split of env groups across ranks
(whole groups, seeds independent of the world size); the StarPO-S filter on the global batch
from all-gathered per-group reward stds; global token/sequence counts for the loss
normalisation and global batch statistics (`masked_mean`, `masked_whiten`); the gradient
exchange of a data-parallel update, either FSDP2 (`shard_for_data_parallel`, and the
trainer's modules in `fastpo.fsdp`: sharded parameters, gradients and optimizer state,
summed reduce-scatter, equal micro-batch counts per rank via `micro_batch_count`, whole
parameters for generation and evaluation; `fastpo.trainer`'s default,
trainer.data_parallel=fsdp) or DDP-equivalent (`all_reduce_gradients`: replicated
parameters, summed gradients; trainer.data_parallel=replicate); rank 0's full state dict
(`full_state_dict`) and one HF-format folder written by rank 0 (`save_hf_model`); global
metrics (`weighted_means`, `per_rank`, `held_state_mib`).

`check_trainer_support` refuses, in one line, the settings the trainer cannot run in
several processes yet (UNSUPPORTED, and FSDP_UNSUPPORTED under FSDP2). With one process and no torchrun nothing here
initialises `torch.distributed` (`SINGLE`), and every helper reduces to the one-process
computation: one process is a world of one whose collectives are identities, so the trainer
runs one code path for one process and N.

Launch: `torchrun --nproc_per_node N -m fastpo train ...` (or `fastpo train --nproc N`),
which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for each process.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from typing import Any, Callable, Optional

import torch

#: Seconds a collective may wait for the other ranks before it raises (and the job ends).
DEFAULT_TIMEOUT_S = 600.0
#: The environment variable that overrides DEFAULT_TIMEOUT_S.
TIMEOUT_ENV = "FASTPO_DIST_TIMEOUT_S"

class DistributedError(ValueError):
    """Bad launch input: a torchrun variable, a process count or a device that cannot work."""


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process stands. `backend` None: one process, torch.distributed not
    initialised (today's path). `device`: this rank's device (cuda:LOCAL_RANK under NCCL)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """True on rank 0, the one process that writes metrics and checkpoints."""
        return self.rank == 0

    @property
    def initialized(self) -> bool:
        return self.backend is not None


#: The one-process context: no process group, rank 0 of 1.
SINGLE = DistContext()


def _env_int(env: dict, name: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise DistributedError(f"{name} is not set; start the processes with torchrun (it sets RANK, WORLD_SIZE, "
                               f"LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not a whole number") from None


def torchrun_env(env: Optional[dict] = None) -> Optional[tuple[int, int, int]]:
    """(rank, world size, local rank) from torchrun's variables, or None when WORLD_SIZE is
    unset (not launched by torchrun). Raises DistributedError for a missing or bad value."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return None
    world, rank, local = _env_int(env, "WORLD_SIZE"), _env_int(env, "RANK"), _env_int(env, "LOCAL_RANK")
    if world < 1:
        raise DistributedError(f"WORLD_SIZE={world}: needs at least 1 process")
    if not 0 <= rank < world:
        raise DistributedError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    if local < 0:
        raise DistributedError(f"LOCAL_RANK={local} is negative")
    return rank, world, local


def timeout_seconds(env: Optional[dict] = None) -> float:
    """The collective timeout in seconds: FASTPO_DIST_TIMEOUT_S, else DEFAULT_TIMEOUT_S."""
    env = os.environ if env is None else env
    raw = env.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        t = float(raw)
    except ValueError:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not t > 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r} must be > 0 seconds")
    return t


def check_nproc(nproc: int, device: Optional[str] = None) -> None:
    """Validate `fastpo train|eval --nproc N`: N >= 1, and on CUDA at most one process per visible
    GPU. device: the --device flag (None or "auto": CUDA when available). Raises DistributedError."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise DistributedError(f"--nproc {nproc!r}: needs a whole number of processes >= 1")
    if nproc > 1 and launched_by_torchrun():
        raise DistributedError(f"--nproc {nproc}: this process was already started by torchrun "
                               f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')}); pass --nproc_per_node to torchrun "
                               f"instead")
    name = device or "auto"
    if nproc == 1 or name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return  # CPU processes (gloo): any number
    if name not in ("auto", "cuda"):
        raise DistributedError(f"--nproc {nproc} with --device {name}: each process takes its own GPU "
                               f"(cuda:LOCAL_RANK); use --device cuda")
    if nproc > torch.cuda.device_count():
        raise DistributedError(f"--nproc {nproc}: only {torch.cuda.device_count()} CUDA device(s) visible, one "
                               f"process per GPU; use at most that many, or --device cpu (gloo)")


#: What the data-parallel trainer does not do yet, as (setting, test on the config, why).
UNSUPPORTED = (
    ("algorithm.is_correction", lambda c: c.algorithm.is_correction != "none",
     "the importance-sampling correction is not data-parallel yet; use none"),
    ("rollout.reuse/rollout.replay", lambda c: c.rollout.reuse > 1 or c.rollout.replay > 0,
     "rollout reuse and replay are not data-parallel yet; use reuse=1 replay=0"),
    ("rollout.engine=sglang", lambda c: c.rollout.engine == "sglang",
     "one SGLang engine per process is not wired yet; use native"),
    ("rollout.sampling_streams=batch", lambda c: c.rollout.sampling_streams == "batch",
     "with several processes each env group samples from its own stream; use auto or group"),
)


#: What trainer.data_parallel=fsdp does not shard yet, as UNSUPPORTED.
FSDP_UNSUPPORTED = (
    ("model.lora_rank", lambda c: c.model.lora_rank > 0,
     "LoRA adapters are not sharded by FSDP2 yet; use trainer.data_parallel=replicate"),
)


def check_trainer_support(cfg, world_size: int, torchrun: bool = False) -> None:
    """Refuse, before anything loads, a setting the data-parallel trainer cannot run with
    `world_size` processes under torchrun (see UNSUPPORTED); raises DistributedError naming
    the first one. `torchrun`: launched by torchrun, which takes the data-parallel path even
    for one process; one process without torchrun supports everything."""
    if world_size <= 1 and not torchrun:
        return
    where = f"{world_size} processes" if world_size > 1 else "torchrun"
    fsdp = FSDP_UNSUPPORTED if getattr(cfg.trainer, "data_parallel", "replicate") == "fsdp" else ()
    for key, bad, why in UNSUPPORTED + fsdp:
        if bad(cfg):
            raise DistributedError(f"{key} with {where}: {why} (or run one process without torchrun)")
    split_groups(cfg.rollout.env_groups, world_size, 0)  # at least one whole env group per process


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (WORLD_SIZE set)."""
    return "WORLD_SIZE" in os.environ


def torchrun_command(nproc: int, argv: list[str], python: Optional[str] = None) -> list[str]:
    """The command that runs `fastpo <argv>` in `nproc` processes on this machine:
    `python -m torch.distributed.run --standalone --nproc_per_node N -m fastpo <argv>`
    (--standalone: a local rendezvous on a free port)."""
    import sys

    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "fastpo", *argv]


def strip_nproc(argv: list[str]) -> list[str]:
    """argv without its `--nproc N` / `--nproc=N` (what the relaunched processes get)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def init_from_env(device: str = "auto", timeout_s: Optional[float] = None) -> DistContext:
    """Join the process group torchrun describes; SINGLE when not under torchrun.

    device "auto" | "cpu" | "cuda": gloo on the CPU; NCCL on CUDA with this rank on
    cuda:LOCAL_RANK (`torch.cuda.set_device`). timeout_s: the collectives' timeout (default
    `timeout_seconds()`): a collective that waits longer for another rank raises, so a rank
    that dies or hangs ends the job (torchrun then stops the other ranks, exit status non-zero).
    Raises DistributedError for bad torchrun variables, a device with an index under more
    than one process, or LOCAL_RANK beyond the visible GPUs.
    """
    import torch.distributed as dist

    where = torchrun_env()
    if where is None:
        return SINGLE
    rank, world, local = where
    timeout = timeout_seconds() if timeout_s is None else float(timeout_s)
    name = device or "auto"
    use_cuda = name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())
    if use_cuda:
        if name not in ("auto", "cuda") and world > 1:
            raise DistributedError(f"trainer.device={name!r} under {world} processes: each takes cuda:LOCAL_RANK; "
                                   f"use cuda or auto")
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise DistributedError(f"LOCAL_RANK={local} but {torch.cuda.device_count()} CUDA device(s) visible")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kw = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **kw)
        global _left_job
        _left_job = False  # in a job again
    return DistContext(rank=rank, world_size=world, local_rank=local, backend=backend, device=dev)


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (no-op for one process). No barrier first: a rank whose error
    was its own (an env that raised, rank 0's full disk) returns while the others may be in
    a collective, which a barrier would mismatch; a finished rank may leave while rank 0
    still writes the last checkpoint."""
    import torch.distributed as dist

    if ctx.initialized and dist.is_initialized():
        dist.destroy_process_group()
        global _left_job
        _left_job = True


#: Whether this process has left a torchrun job's process group (`shutdown`).
_left_job = False


def left_job() -> bool:
    """Whether this process joined a torchrun job's process group and has left it (`shutdown`)
    since it last joined one: its command is over, and `fastpo.cli.entry` ends it with
    `end_process`."""
    return _left_job


def end_process(status: int) -> None:
    """End this torchrun rank with exit status `status` once its job is over (after
    `shutdown`): stdout and stderr flushed, logging shut down, then `os._exit` without the
    interpreter's teardown. Why: once FSDP2 (DTensor) and torch._dynamo have been used,
    torch keeps the gloo process group alive past `destroy_process_group` (its worker threads
    still run), and destroying it during the teardown can abort the process (SIGABRT,
    "terminate called without an active exception": a finished job reported as failed by
    torchrun). Everything fastpo writes is closed before this point. Does not return."""
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say
            pass
    logging.shutdown()
    os._exit(status)


def on_main(ctx: DistContext, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Run `fn` on rank 0 only (writing metrics.jsonl, a checkpoint, the evaluation files) and return
    its result on every rank (pickled and broadcast). An exception in `fn` is raised on every
    rank (the same type and message; one that cannot be pickled as a RuntimeError with its
    text), so that all ranks stop together instead of waiting for a result."""
    if not ctx.initialized:
        return fn(*args, **kwargs)
    import torch.distributed as dist

    box: list = [None]
    if ctx.is_main:
        try:
            box[0] = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - re-raised below, on every rank
            box[0] = ("error", _portable(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def _portable(e: BaseException) -> BaseException:
    """`e` if it pickles, else a RuntimeError with its type and text (to send it to other ranks)."""
    import pickle

    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def gather_results(ctx: DistContext, fn: Callable[..., Any], *args, **kwargs) -> Optional[list]:
    """Run `fn` on every rank (each on its own share of some work, e.g. its evaluation seeds)
    and return [every rank's result] in rank order on rank 0, None on the others (pickled).
    An exception in `fn` on any rank is raised on every rank once all have finished `fn`
    (the lowest failing rank's, sent as `on_main` sends one), so that no rank waits for a result
    that will not come. One process: [fn()], its exceptions raised as they are."""
    if not ctx.initialized:
        return [fn(*args, **kwargs)]
    value, error = None, None
    try:
        value = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = _portable(e)
    errors = all_gather_object(ctx, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return gather_to_main(ctx, value)


def all_gather_object(ctx: DistContext, obj: Any) -> list:
    """[every rank's `obj`] in rank order, on every rank (pickled); [obj] for one process."""
    if not ctx.initialized:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(ctx: DistContext, obj: Any) -> Optional[list]:
    """[every rank's `obj`] in rank order on rank 0, None on the others (pickled); [obj] for one process."""
    if not ctx.initialized:
        return [obj]
    import torch.distributed as dist

    out: Optional[list] = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def broadcast_modules(ctx: DistContext, *modules) -> None:
    """Copy rank 0's parameters and buffers into every rank's `modules` (None entries skipped),
    so that data-parallel replicas start equal whatever each rank loaded. No-op for one process."""
    if not ctx.initialized:
        return
    import torch.distributed as dist

    with torch.no_grad():
        for m in modules:
            if m is None:
                continue
            for t in list(m.parameters()) + list(m.buffers()):
                buf = t.detach().to(ctx.device)
                dist.broadcast(buf, src=0)
                if buf is not t:
                    t.copy_(buf)


def masked_mean(ctx: DistContext, x: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of `x` where `mask` is True over every rank's entries (0.0 when there are
    none); one process: `float(x[mask].mean())`, as the trainer computes it."""
    m = mask.bool()
    if not ctx.initialized:
        return float(x[m].mean()) if m.any() else 0.0
    n, total = all_reduce(ctx, [int(m.sum()), float(x[m].double().sum())])
    return total / n if n else 0.0


def masked_whiten(ctx: DistContext, x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False,
                  eps: float = 1e-8) -> torch.Tensor:
    """`fastpo.algorithms.masked_whiten` (shift_mean) with the mean and variance of the global
    batch: every rank's entries where `mask` is True (sums in float64, two passes). x, mask:
    [B_r, T] (B_r may be 0); returns fp32 [B_r, T], zero off the mask. One process: that function."""
    from fastpo.algorithms import masked_whiten as whiten

    m = mask.bool()
    if not ctx.initialized:
        return whiten(x, m, eps=eps, unbiased=unbiased)
    xf = x.to(torch.float32)
    n, total = all_reduce(ctx, [int(m.sum()), float(xf[m].double().sum())])
    if n == 0:
        return torch.zeros_like(xf)
    mean = total / n
    dev = all_reduce(ctx, [float(((xf[m].double() - mean) ** 2).sum())])[0]
    var = dev / (n - 1 if unbiased and n > 1 else n)
    return (xf - mean) * float(1.0 / (var + eps) ** 0.5) * m


def held_state_mib(modules, optimizers) -> tuple[float, float]:
    """(parameters, optimizer state) this process holds, in MiB: each parameter's local storage
    (a DTensor's own shard, not the whole tensor; a tied weight once; None modules skipped)
    and every tensor in the optimizers' states."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    seen, params = set(), 0
    for m in modules:
        for p in (m.parameters() if m is not None else ()):
            if id(p) not in seen:
                seen.add(id(p))
                x = local(p)
                params += x.numel() * x.element_size()
    state = 0
    for opt in optimizers:
        for s in opt.state.values():
            for v in s.values():
                if torch.is_tensor(v):
                    x = local(v)
                    state += x.numel() * x.element_size()
    return params / 2**20, state / 2**20


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory in MiB: CUDA's peak allocated bytes on `device`, else the
    process's peak resident set size (Linux ru_maxrss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def split_groups(n_groups: int, world_size: int, rank: int) -> range:
    """The env groups rank `rank` rolls out: a contiguous block, whole groups only (in-group
    statistics need every trajectory of a group on one rank), block sizes differing by at
    most one, earlier ranks taking the extra groups. Raises DistributedError when there are
    fewer groups than ranks or the rank is out of range."""
    if n_groups < world_size:
        raise DistributedError(f"rollout.env_groups={n_groups} is below the number of processes ({world_size}); "
                               f"each process needs at least one whole env group")
    return split_evenly(n_groups, world_size, rank)


def split_evenly(n: int, world_size: int, rank: int) -> range:
    """Rank `rank`'s contiguous block of `n` items (e.g. the evaluation's seeds): block sizes
    differ by at most one, earlier ranks take the extra items, and a rank gets an empty range
    when n < world_size; the blocks in rank order are range(n). Raises DistributedError when
    the rank is out of range."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise DistributedError(f"rank {rank} is outside [0, {world_size})")
    base, extra = divmod(int(n), world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def rank_seeds(seed: int, iteration: int, n_groups: int, world_size: int, rank: int) -> tuple[list[int], list[int]]:
    """(global group ids, env seeds) of this rank's share of iteration `iteration`: a slice
    of `fastpo.seeds.iteration_seeds(seed, iteration, n_groups)`, so group g has the same
    seed whatever the world size."""
    from fastpo.seeds import iteration_seeds

    groups = split_groups(n_groups, world_size, rank)
    seeds = iteration_seeds(seed, iteration, n_groups)
    return list(groups), [seeds[g] for g in groups]


def _all_gather_rows(ctx: DistContext, rows: torch.Tensor) -> torch.Tensor:
    """Concatenation over ranks (rank order) of each rank's [k_r, C] float64 rows (k_r may differ)."""
    import torch.distributed as dist

    dev = ctx.device
    rows = rows.to(dev)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=dev)
    counts = [torch.zeros_like(count) for _ in range(ctx.world_size)]
    dist.all_gather(counts, count)
    counts = [int(c) for c in counts]
    width = max(counts)
    padded = torch.zeros(width, rows.shape[1], dtype=rows.dtype, device=dev)
    padded[: rows.shape[0]] = rows
    parts = [torch.zeros_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]).cpu()


def gather_group_stds(ctx: DistContext, local: dict) -> dict:
    """{group id: reward std} of every rank's groups (from `group_reward_std` on each rank's
    trajectories), the same dict on every rank. Only (id, std) pairs travel, never
    trajectories; values are sent as float64, so a float std arrives unchanged. Raises
    DistributedError when one group id comes from two ranks (a group split across ranks)."""
    if not ctx.initialized:
        return dict(local)
    rows = torch.tensor([[float(g), float(s)] for g, s in sorted(local.items())], dtype=torch.float64).reshape(-1, 2)
    out: dict = {}
    for g, s in _all_gather_rows(ctx, rows).tolist():
        g = int(g)
        if g in out:
            raise DistributedError(f"env group {g} is on two ranks; a group must stay whole on one rank")
        out[g] = s
    return out


def all_reduce(ctx: DistContext, values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum or max of `values` over ranks (float64), the same on every rank."""
    if not ctx.initialized:
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
    return t.cpu().tolist()


def global_filter(ctx: DistContext, scores: torch.Tensor, group_ids: torch.Tensor, ratio: float = 0.25,
                  mode: str = "top", strategy: str = "top_k", top_p_mode: str = "linear", eps: float = 0.01,
                  keep_zero_std: bool = True):
    """`fastpo.algorithms.filter_groups` on the global batch: StarPO-S ranks every rank's env
    groups together (their stds are all-gathered) and each rank keeps its own trajectories
    of the chosen groups.

    Args as `filter_groups`, for this rank's trajectories: scores [B_r] float, group_ids [B_r]
    int (global group ids, whole groups). Returns a FilterResult whose `indices` index this
    rank's trajectories and whose `kept_groups`, `group_std`, `kept_ratio`, `std_before`,
    `std_after` and `zero_std_groups` are global (equal on every rank, and equal to
    `filter_groups` on the concatenated batch). Raises ValueError as `filter_groups`.
    """
    from fastpo.algorithms.filtering import check_filter_args, filter_from_stds, filter_groups, group_reward_std

    if not ctx.initialized:
        return filter_groups(scores, group_ids, ratio, mode, strategy, top_p_mode, eps, keep_zero_std)
    check_filter_args(mode, ratio)
    stds = gather_group_stds(ctx, group_reward_std(scores, group_ids) if scores.numel() else {})
    local_max = int(torch.unique(group_ids, return_counts=True)[1].max()) if group_ids.numel() else 0
    largest = int(all_reduce(ctx, [local_max], "max")[0])
    return filter_from_stds(stds, group_ids, largest, ratio, mode, strategy, top_p_mode, eps, keep_zero_std,
                            count=lambda kept, n: all_reduce(ctx, [kept, n], "sum"))


def scored_counts(masks: list, indices: list[int]) -> tuple[int, int]:
    """(scored tokens, trajectories with a scored token) of trajectories `indices` on this
    rank. masks: [T_i] bool/int loss masks; a token is scored from position 1 on (the
    one-token shift), as in `fastpo.trainer.loss_denominator`."""
    tokens = sum(int(masks[i][1:].sum()) for i in indices)
    seqs = sum(1 for i in indices if bool(masks[i][1:].any()))
    return tokens, seqs


def global_counts(ctx: DistContext, masks: list, indices: list[int]) -> tuple[int, int]:
    """`scored_counts` summed over ranks: the global batch's (scored tokens, trajectories)."""
    tokens, seqs = scored_counts(masks, indices)
    t, s = all_reduce(ctx, [tokens, seqs], "sum")
    return int(t), int(s)


def global_loss_denominator(ctx: DistContext, loss_agg: str, masks: list, indices: list[int]) -> float:
    """The loss normaliser of a mini-batch spread over ranks: its global scored-token count for
    "token-mean", else its global count of trajectories with a scored token (the seq-mean
    modes); at least 1. Every rank divides by it, so that the sum over ranks of the ranks'
    gradients is the one-process gradient of the whole mini-batch
    (`fastpo.trainer.loss_denominator` on the concatenation)."""
    from fastpo.registry import loss_denominator_of

    return loss_denominator_of(loss_agg, *global_counts(ctx, masks, indices))


def all_reduce_gradients(ctx: DistContext, params) -> None:
    """Sum every parameter's `.grad` over ranks, in place (one flat all-reduce per dtype).

    The data-parallel update's gradient exchange, as DDP's all-reduce but summed, not
    averaged: each rank's loss is already divided by the global count
    (`global_loss_denominator`), so the sum is the one-process gradient of the whole
    mini-batch, and clipping it afterwards (`torch.nn.utils.clip_grad_norm_`) clips the
    global norm. A parameter without a gradient on this rank contributes zeros (and gets
    the others' sum). params: an iterable of tensors (requires_grad ones are reduced, in
    order; every rank must pass the same parameters in the same order). No-op for one process.
    """
    params = [p for p in params if p.requires_grad]
    if not ctx.initialized or not params:
        return
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group]).to(ctx.device)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in group:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def micro_batch_count(ctx: DistContext, n: int) -> int:
    """The number of micro-batches every rank runs in a mini-batch: the largest rank's `n`.
    FSDP's collectives run in each forward and backward, so a rank with fewer micro-batches
    runs empty ones (loss mask all zero: no gradient) up to this count instead of waiting."""
    return int(all_reduce(ctx, [n], "max")[0])


def shard_for_data_parallel(ctx: DistContext, root: torch.nn.Module, layers) -> torch.nn.Module:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) on each module of `layers` (the decoder
    layers), then on `root`, the module whose forward computes the loss (its forward must
    also run every use of the parameters outside `layers`, e.g. the fused loss's LM head, so
    that they are gathered then). Gradients are summed over ranks, not averaged (divide
    factor 1, plain SUM reductions, which gloo supports): each rank's loss is already
    divided by the global count (`global_loss_denominator`). Returns `root`; the parameters
    become DTensors sharded over the ranks (`p.full_tensor()` gathers one;
    `torch.nn.utils.clip_grad_norm_` clips the global norm). One process: returned unchanged.
    """
    if not ctx.initialized:
        return root
    from torch.distributed.fsdp import fully_shard

    mods = [fully_shard(m) for m in layers] + [fully_shard(root)]
    for m in mods:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    return root


def full_state_dict(ctx: DistContext, model: torch.nn.Module) -> dict:
    """The full (unsharded) state dict of `model` on the CPU, on rank 0 (the other ranks get
    {}; every rank must call it: it gathers), from
    `torch.distributed.checkpoint.state_dict.get_model_state_dict`, for rank 0 to write one
    HF-format checkpoint. One process: `model.state_dict()` detached on the CPU."""
    if not ctx.initialized:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_hf_model(ctx: DistContext, model: torch.nn.Module, folder: str) -> str:
    """Write one HF-format model folder (config + safetensors, loadable by
    `AutoModelForCausalLM.from_pretrained`) from the full state dict, by rank 0 only; every
    rank must call it (the state dict is gathered) and gets `folder` back once it is written.
    model: a transformers PreTrainedModel, sharded by `shard_for_data_parallel` or not."""
    state = full_state_dict(ctx, model)

    def write() -> str:
        model.save_pretrained(folder, state_dict=state, safe_serialization=True)
        return folder

    return on_main(ctx, write)


def weighted_means(ctx: DistContext, values: dict, weight: float) -> dict:
    """Global metrics: each value's mean over ranks weighted by `weight` (this rank's share,
    e.g. its trajectories or tokens): sum_r w_r x_r / sum_r w_r (0 where the weights sum to
    0). Every rank must pass the same keys (sent in sorted order); raises DistributedError
    when the key counts differ. One process: the values as floats."""
    keys = sorted(values)
    if not ctx.initialized:
        return {k: float(values[k]) for k in keys}
    lo, hi = all_reduce(ctx, [-len(keys), len(keys)], "max")
    if -lo != hi:
        raise DistributedError(f"ranks report different metrics ({int(-lo)} to {int(hi)} keys); every rank must "
                               f"report the same ones")
    sums = all_reduce(ctx, [float(weight)] + [float(weight) * float(values[k]) for k in keys], "sum")
    total = sums[0]
    return {k: (s / total if total else 0.0) for k, s in zip(keys, sums[1:])}


def per_rank(ctx: DistContext, value: float) -> list[float]:
    """One number from every rank, in rank order (e.g. each rank's peak memory or phase time)."""
    if not ctx.initialized:
        return [float(value)]
    return [row[0] for row in _all_gather_rows(ctx, torch.tensor([[float(value)]], dtype=torch.float64)).tolist()]
