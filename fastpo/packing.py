"""Token-budget micro-batches with no padding: several trajectories packed into one row.

A packed micro-batch is one row of N tokens holding k trajectories back to back. Position
ids restart at 0 for each trajectory, and attention is causal *within* each trajectory only.
Three ways to get that attention (`packing_attention(model)` picks one):

- "segments" (the default for models fastpo trains with sdpa, CPU or GPU without
  flash-attn): fastpo registers an attention function with transformers' AttentionInterface
  (`SEGMENT_ATTENTION`) that runs causal sdpa on each trajectory's slice of the row, using
  the `cu_seq_lens_q` offsets passed through the model's forward. Cost is sum(L_i^2), not
  N^2: a dense N x N mask over a 2048-token row of three 680-token trajectories computes
  three times the attention, and sdpa cannot use its causal fast path with a mask.
  Without `cu_seq_lens_q` (rollout generation, padded batches) it is plain sdpa.
- "varlen" (`attn_implementation="flash_attention_2"`): no mask; transformers derives the
  variable-length boundaries from the restarting position ids.
- "mask" (any other implementation, e.g. eager): a block-diagonal causal 4D mask
  [1, 1, N, N]; transformers (>= 5) hands a user-supplied 4D mask to the attention function
  unchanged: sdpa takes it as a boolean mask (True = attend), eager adds it to the scores
  (additive form, 0 where attended, dtype-min elsewhere).

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
    attention_mask [1, 1, N, N] block-causal mask ("mask" attention), else None;
    seq_ids [N] int64: 0..k-1, which trajectory of the micro-batch a token belongs to;
    cu_seqlens [k + 1] int64 offsets (on the batch's device); indices: the trajectories'
    indices in the full batch; attention: "mask", "segments" or "varlen" (module docstring).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    seq_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    indices: list[int]
    attention: str = "mask"

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def model_inputs(self) -> dict:
        """Keyword arguments for the model's (or its decoder body's) forward on this row.

        "segments" passes `cu_seq_lens_q`/`cu_seq_lens_k` (a CPU int64 tensor, read once per
        layer without a device sync) for `SEGMENT_ATTENTION`, and an all-ones 2D mask so that
        transformers neither detects the packing from the position ids nor builds an N x N
        mask (sdpa's mask function skips an all-ones mask).
        """
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.attention == "mask":
            out["attention_mask"] = self.attention_mask
        elif self.attention == "segments":
            cu = self.cu_seqlens.cpu()
            longest = int((cu[1:] - cu[:-1]).max())
            out.update(attention_mask=torch.ones_like(self.input_ids), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=longest, max_length_k=longest)
        return out

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


ATTENTION_MODES = ("mask", "segments", "varlen")


def pack_micro_batch(input_ids: Sequence[torch.Tensor], indices: Sequence[int], *, attention: str = "mask",
                     mask_dtype: torch.dtype = torch.float32,
                     device: Optional[torch.device | str] = None) -> PackedBatch:
    """Pack the trajectories `indices` of `input_ids` (a list of 1-D int64 tensors) into one row.

    attention: "mask" builds the N x N block-causal mask (of `mask_dtype`); "segments" and
    "varlen" build none (see the module docstring; `packing_attention(model)` picks).
    Raises ValueError for an empty selection or an unknown `attention`.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if len(indices) == 0:
        raise ValueError("a micro-batch needs at least one trajectory")
    seqs = [torch.as_tensor(input_ids[i], dtype=torch.long) for i in indices]
    lengths = [int(s.numel()) for s in seqs]
    ids = torch.cat(seqs).to(device)[None]
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    mask = block_causal_mask(lengths, mask_dtype, device) if attention == "mask" else None
    return PackedBatch(ids, pos, mask, seq_ids, cu.to(device), list(indices), attention)


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


#: Name under which fastpo's per-trajectory attention is registered with transformers.
SEGMENT_ATTENTION = "fastpo_segments"


def _segment_attention(module, query, key, value, attention_mask, *, cu_seq_lens_q=None, **kwargs):
    """transformers attention function: causal sdpa per packed segment, plain sdpa otherwise.

    query [1, heads, N, D], key/value [1, kv_heads, N, D]; `cu_seq_lens_q` [k + 1] int64
    offsets of the k segments. Returns ([1, N, heads, D], None), as transformers expects.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(name, None)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(f"segment attention takes one packed row without a KV cache, got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    bounds = cu_seq_lens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q {bounds} does not span the row's {query.shape[2]} tokens")
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                   is_causal=True, **kwargs)[0]
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1), None


def register_segment_attention() -> str:
    """Register `SEGMENT_ATTENTION` (attention and mask functions) with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(SEGMENT_ATTENTION, _segment_attention)
    # generation and padded batches build their masks exactly as sdpa does
    AttentionMaskInterface.register(SEGMENT_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return SEGMENT_ATTENTION


def use_segment_attention(model: torch.nn.Module) -> bool:
    """Switch a model that runs sdpa to `SEGMENT_ATTENTION` (in place). Returns whether it did.

    Models on eager or flash-attn are left alone ("mask" and "varlen" packing). Everything
    but packed rows with `cu_seq_lens_q` still runs sdpa, so generation is unchanged.
    """
    cfg = getattr(model, "config", None)
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    register_segment_attention()
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(SEGMENT_ATTENTION)
    else:
        cfg._attn_implementation = SEGMENT_ATTENTION
    return cfg._attn_implementation == SEGMENT_ATTENTION


def packing_attention(model: torch.nn.Module) -> str:
    """How packed rows get their per-trajectory attention on this model: "varlen", "segments" or "mask"."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    if "flash_attention" in impl:
        return "varlen"
    return "segments" if impl == SEGMENT_ATTENTION else "mask"
