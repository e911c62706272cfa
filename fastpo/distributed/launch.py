"""Starting a data-parallel job: `fastpo train|eval --nproc N` checked (`check_nproc`) and
relaunched under torchrun (`torchrun_command`, `strip_nproc`), and the settings the
data-parallel trainer cannot run yet refused in one line before anything loads
(`check_trainer_support`: UNSUPPORTED, and FSDP_UNSUPPORTED under FSDP2)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from fastpo.distributed.context import DistributedError, launched_by_torchrun
from fastpo.distributed.data_parallel import split_groups


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
