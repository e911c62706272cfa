"""The data-parallel update's gradient exchange and its weights: replicated parameters with
summed gradients (`all_reduce_gradients`, trainer.data_parallel=replicate) or FSDP2
(`shard_for_data_parallel`, trainer.data_parallel=fsdp; the trainer's modules in
fastpo.trainer.fsdp), and rank 0's full state dict written as one HF-format folder
(`full_state_dict`, `save_hf_model`)."""
from __future__ import annotations

import torch

from fastpo.distributed.collectives import on_main
from fastpo.distributed.context import DistContext


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
