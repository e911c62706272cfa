"""This process's place in a torchrun job: `DistContext` (rank, world size, device, backend),
joining and leaving the process group (`init_from_env`, `shutdown`) with a timeout on every
collective, and ending a rank once its job is over (`end_process`). One process without
torchrun is `SINGLE`: no process group, rank 0 of 1."""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from typing import Optional

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


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (WORLD_SIZE set)."""
    return "WORLD_SIZE" in os.environ


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
