"""FSDP2 in the trainer (`trainer.data_parallel=fsdp`): the policy, a separate critic's body and
the value head sharded over the processes of a data-parallel job (fastpo.distributed), their
parameters gathered whole for generation and evaluation (`gathered`), their full model and
optimizer states gathered for a one-process-format checkpoint and sharded again on resume.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from fastpo.distributed.context import DistContext, DistributedError

from fastpo.distributed.sharding import shard_for_data_parallel
from fastpo.kernels.hf import decoder_body


class ShardedRoot(torch.nn.Module):
    """The FSDP2 root of the trainer's sharded modules: the policy, a separate critic's body
    and the value head (None entries left out). Its forward runs `fn(*args, **kwargs)`, so
    that a whole micro-batch loss (decoder bodies, the fused loss's LM head, the value head)
    runs inside one root forward: FSDP gathers the parameters outside the decoder layers
    (embeddings, final norm, LM head, value head) there and reduce-scatters their gradients
    after the backward."""

    def __init__(self, policy: torch.nn.Module, critic_body: Optional[torch.nn.Module] = None,
                 value_head: Optional[torch.nn.Module] = None):
        super().__init__()
        self.policy = policy
        self.critic_body = critic_body
        self.value_head = value_head

    def forward(self, fn: Callable, *args, **kwargs):
        return fn(*args, **kwargs)


def shard_trainer_modules(ctx: DistContext, policy: torch.nn.Module, critic_body: Optional[torch.nn.Module] = None,
                          value_head: Optional[torch.nn.Module] = None) -> ShardedRoot:
    """FSDP2 over the trained modules (`shard_for_data_parallel`): each decoder layer of the
    policy and of a separate critic's body is one FSDP unit, the `ShardedRoot` holding them
    the last (the rest of their parameters). Every parameter becomes a DTensor sharded over
    the ranks along dim 0, in place (the modules keep their names; an optimizer built after
    this steps the shards). Gradients are summed over ranks. Returns the root; requires an
    initialised process group (raises DistributedError otherwise)."""
    if not ctx.initialized:
        raise DistributedError("trainer.data_parallel=fsdp needs a process group (torchrun)")
    root = ShardedRoot(policy, critic_body, value_head)
    layers = list(decoder_body(policy).layers) + (list(critic_body.layers) if critic_body is not None else [])
    shard_for_data_parallel(ctx, root, layers)
    with torch.no_grad():  # FSDP2 takes the module whose forward runs first for its root
        root(lambda: None)
    for m in _fsdp_modules(root):
        m.reshard()
    return root


def _fsdp_modules(root: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]  # the root first


@contextlib.contextmanager
def gathered(root: Optional[torch.nn.Module]):
    """Every parameter under the FSDP2 `root` whole (all-gathered: plain tensors, not DTensor
    shards) inside the block, and no collective in the forwards run there: for generation,
    old log-probs, the collapse metrics and rank 0's evaluation, whose forward counts differ
    between ranks. Every rank must enter it at the same point (the all-gathers are
    collectives); leaving it frees the gathered copies (no communication). Re-entrant; a
    no-op for root None (no FSDP). (transformers' `generate` would still wait for the other
    ranks when it sees FSDP, unless given synced_gpus=False; fastpo's NativeEngine decodes
    with plain forwards.)"""
    if root is None or getattr(root, "_fastpo_gathered", 0):
        if root is not None:
            root._fastpo_gathered += 1
        try:
            yield
        finally:
            if root is not None:
                root._fastpo_gathered -= 1
        return
    mods = _fsdp_modules(root)
    for m in mods:
        m.unshard()
    inner = mods[1:]  # the root itself never reshards after its forward
    for m in inner:
        m.set_reshard_after_forward(False, recurse=False)
    root._fastpo_gathered = 1
    try:
        yield
    finally:
        root._fastpo_gathered = 0
        for m in inner:
            m.set_reshard_after_forward(True, recurse=False)
        for m in mods:
            m.reshard()


def full_value(x):
    """A DTensor's full value (`full_tensor()`, a collective), any other value unchanged."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def full_optimizer_state(ctx: DistContext, root: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` in the one-process format (states keyed by the parameter's
    position in the param groups, whole tensors on the CPU) of an optimizer over FSDP2-sharded
    parameters under `root`, from `torch.distributed.checkpoint.state_dict
    .get_optimizer_state_dict` (full_state_dict, cpu_offload): a checkpoint any world size
    resumes. Every rank must call it (it gathers); the result is complete on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(root, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not osd:  # (cpu_offload: the other ranks get nothing)
        return {}
    names = {id(p): n for n, p in root.named_parameters()}
    index, groups, state = {}, [], {}
    for grp, saved in zip(optimizer.param_groups, osd["param_groups"]):
        ids = []
        for p in grp["params"]:
            index[names[id(p)]] = len(index)
            ids.append(index[names[id(p)]])
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    for fqn, s in osd["state"].items():
        state[index[fqn]] = s
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(ctx: DistContext, root: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              saved: dict) -> None:
    """Load a one-process `optimizer.state_dict()` (`saved`, whole tensors, e.g. from a
    checkpoint written with any world size) into an optimizer over FSDP2-sharded parameters
    under `root`, with `set_optimizer_state_dict` (full_state_dict): each rank keeps its
    shards. Every rank must call it with the same `saved`. Raises ValueError when the
    parameter groups do not match."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in root.named_parameters()}
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError("the saved optimizer state does not fit the optimizer (other parameter groups)")
    fqn, groups = {}, []
    for grp, sg in zip(optimizer.param_groups, saved["param_groups"]):
        names_here = [names[id(p)] for p in grp["params"]]
        fqn.update(zip(sg["params"], names_here))
        groups.append({**{k: v for k, v in sg.items() if k != "params"}, "params": names_here})
    state = {fqn[i]: s for i, s in saved["state"].items()}
    set_optimizer_state_dict(root, optimizer, {"state": state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))


class FullStateView:
    """What `fastpo.run.checkpoint.save_checkpoint` reads of a module or optimizer (`state_dict()`,
    `save_pretrained(path)` for a transformers model), served from a full state gathered
    beforehand: rank 0 writes a sharded model's checkpoint in the one-process format."""

    def __init__(self, state: dict, module: Optional[torch.nn.Module] = None):
        self._state, self._module = state, module

    def state_dict(self) -> dict:
        return self._state

    def save_pretrained(self, path: str, **kw) -> None:
        self._module.save_pretrained(path, state_dict=self._state, safe_serialization=True, **kw)
