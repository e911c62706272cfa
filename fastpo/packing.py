"""Token-budget micro-batches with no padding: several trajectories packed into one row.

A packed micro-batch is one row of N tokens holding k trajectories back to back. Position
ids restart at 0 for each trajectory, and attention is causal *within* each trajectory only:

- on the CPU (and on the GPU without flash-attn) through a block-diagonal causal 4D mask
  [1, 1, N, N]; transformers (>= 5) hands a user-supplied 4D mask to the attention function
  unchanged (`masking_utils._preprocess_mask_arguments` returns early for 4D masks): sdpa
  takes it as a boolean mask (True = attend), eager adds it to the scores (additive form,
  0 where attended, dtype-min elsewhere);
- with `attn_implementation="flash_attention_2"` no mask is built: transformers derives the
  variable-length boundaries (cu_seqlens) from the restarting position ids.

Padding is the baseline this replaces (`pad_micro_batch`), kept for the benchmark.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch


def plan_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group trajectory indices into micro-batches of at most `token_budget` tokens.

    First-fit decreasing bin packing (fewest micro-batches in practice); a trajectory longer
    than the budget gets a micro-batch of its own. Indices inside a micro-batch are sorted,
    and micro-batches are ordered by their first index, so the plan is deterministic.

    Args: lengths: tokens per trajectory (ints >= 1); token_budget: tokens per micro-batch.
    Returns a list of lists of indices into `lengths`. Raises ValueError on a budget < 1 or
    a length < 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"trajectory {i} has length {n}; every trajectory needs >= 1 token")
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        for b in range(len(bins)):
            if free[b] >= n:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(token_budget - n)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def block_causal_mask(lengths: Sequence[int], dtype: torch.dtype = torch.float32,
                      device: Optional[torch.device | str] = None) -> torch.Tensor:
    """Block-diagonal causal mask [1, 1, N, N] for sequences of `lengths` (N = sum).

    Query q may attend key k when k <= q and both lie in the same sequence. A floating
    `dtype` gives the additive form (0 allowed, torch.finfo(dtype).min elsewhere; eager and
    sdpa attention); torch.bool gives True where allowed (sdpa, any query dtype).
    Raises ValueError for another dtype.
    """
    if not (dtype.is_floating_point or dtype == torch.bool):
        raise ValueError(f"the mask dtype must be floating or torch.bool, got {dtype}")
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.as_tensor(list(lengths), device=device))
    n = seq.numel()
    pos = torch.arange(n, device=device)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros(n, n, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@dataclasses.dataclass
class PackedBatch:
    """One packed micro-batch.

    input_ids [1, N] int64; position_ids [1, N] int64 (restart per trajectory);
    attention_mask [1, 1, N, N] additive float mask, or None on the flash-attn varlen path;
    seq_ids [N] int64: 0..k-1, which trajectory of the micro-batch a token belongs to;
    cu_seqlens [k + 1] int64 offsets; indices: the trajectories' indices in the full batch.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    seq_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def gather(self, per_traj: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Concatenate per-trajectory 1-D tensors (the full batch's list) for this micro-batch -> [1, N]."""
        parts = [torch.as_tensor(per_traj[i]) for i in self.indices]
        out = torch.cat(parts).to(self.input_ids.device)
        if dtype is not None:
            out = out.to(dtype)
        if out.shape[0] != self.num_tokens:
            raise ValueError(f"per-trajectory tensors hold {out.shape[0]} entries, the micro-batch {self.num_tokens}")
        return out[None]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a [1, N, ...] or [N, ...] tensor into per-trajectory pieces along N (order of `indices`)."""
        n = self.num_tokens
        flat = x[0] if (x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == n) else x
        if flat.shape[0] != n:
            raise ValueError(f"tensor of shape {tuple(x.shape)} does not hold this micro-batch's {n} tokens")
        bounds = self.cu_seqlens.tolist()
        return [flat[bounds[j]:bounds[j + 1]] for j in range(len(self.indices))]


def pack_micro_batch(input_ids: Sequence[torch.Tensor], indices: Sequence[int], *, mask_dtype: torch.dtype = torch.float32,
                     device: Optional[torch.device | str] = None, varlen: bool = False) -> PackedBatch:
    """Pack the trajectories `indices` of `input_ids` (a list of 1-D int64 tensors) into one row.

    `varlen=True` (flash-attn) skips the N x N mask. Raises ValueError for an empty selection.
    """
    if len(indices) == 0:
        raise ValueError("a micro-batch needs at least one trajectory")
    seqs = [torch.as_tensor(input_ids[i], dtype=torch.long) for i in indices]
    lengths = [int(s.numel()) for s in seqs]
    ids = torch.cat(seqs).to(device)[None]
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    mask = None if varlen else block_causal_mask(lengths, mask_dtype, device)
    return PackedBatch(ids, pos, mask, seq_ids, cu.to(device), list(indices))


def pad_micro_batch(input_ids: Sequence[torch.Tensor], indices: Sequence[int], pad_id: int = 0,
                    device: Optional[torch.device | str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded baseline: (input_ids [k, T_max], attention_mask [k, T_max] int64) right-padded."""
    seqs = [torch.as_tensor(input_ids[i], dtype=torch.long) for i in indices]
    t = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    att = torch.zeros(len(seqs), t, dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : s.numel()] = s
        att[j, : s.numel()] = 1
    return ids.to(device), att.to(device)


def uses_varlen(model: torch.nn.Module) -> bool:
    """True when the model runs flash-attn (variable-length packing from position ids, no mask)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return "flash_attention" in impl
