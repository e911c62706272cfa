"""Token-budget micro-batches with no padding: several trajectories packed into one row.

A packed micro-batch is one row of N tokens holding k trajectories back to back. Position
ids restart at 0 for each trajectory, and attention is causal *within* each trajectory only.
Three ways to get that attention (`packing_attention(model)` picks one):

- "segments" (the default for models fastpo trains with sdpa, CPU or GPU without
  flash-attn): fastpo registers an attention function with transformers' AttentionInterface
  (`SEGMENT_ATTENTION`) that runs causal sdpa on each trajectory's slice of the row, using
  the segment table (`fastpo_segments`) passed through the model's forward. Cost is sum(L_i^2), not
  N^2: a dense N x N mask over a 2048-token row of three 680-token trajectories computes
  three times the attention, and sdpa cannot use its causal fast path with a mask.
  Without a segment table (rollout generation, padded batches) it is plain sdpa.
  Segments also allow prefix sharing: the trajectories of an env group start with the
  same prompt, which a row can hold once, each member attending to it (`shared_prefixes`).
  The prompt's forward and backward then run once per group and micro-batch, not once per
  trajectory; gradients through the shared prefix sum over the members, as they would.
- "varlen" (`attn_implementation="flash_attention_2"`): no mask; transformers derives the
  variable-length boundaries from the restarting position ids.
- "mask" (any other implementation, e.g. eager): a block-diagonal causal 4D mask
  [1, 1, N, N]; transformers (>= 5) hands a user-supplied 4D mask to the attention function
  unchanged: sdpa takes it as a boolean mask (True = attend), eager adds it to the scores
  (additive form, 0 where attended, dtype-min elsewhere).

Padding is the baseline this replaces (`pad_micro_batch`), kept for the benchmark.

Bounded context windows (`windows=`, fastpo/rollout/window.py): a trajectory sampled with
rollout.context_window = K is not causal within itself (each turn saw the head and the last K
turns only). "segments" then gives that trajectory's sdpa call a [S, P + S] boolean mask
(`fastpo_segment_masks`, aligned with the segment table) instead of the causal fast path;
"mask" puts it in the block mask; "varlen" cannot take it (ValueError).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from fastpo.rollout.window import window_mask


def shared_prefixes(input_ids: Sequence[torch.Tensor], loss_masks: Sequence[torch.Tensor],
                    min_common: int = 0) -> tuple[list[int], list[int]]:
    """Which trajectories share their untrained leading tokens (an env group's prompt).

    A trajectory's prefix is its tokens before its first trained token (loss mask 1), cut so
    that at least one token of its own remains. Trajectories with identical prefixes form a
    prefix group (all trajectories of an env group share the prompt). Packed with "segments"
    attention, a group's prefix is computed once per micro-batch and every member attends to
    it (`pack_micro_batch`): the prompt's forward and backward are not repeated per member.

    With `min_common` > 0, trajectories whose prefixes only begin alike are grouped too (SFT:
    every expert trajectory opens with the same system prompt and instructions, then its own
    level): in the order of their prefixes, a trajectory joins the group before it while the
    group's longest common prefix stays >= `min_common` tokens, and every member's prefix
    length is that common length. (This merges identical-prompt groups as well.)

    Args: input_ids, loss_masks: per-trajectory 1-D tensors [T_i] (int64, bool).
    Returns (prefix_lengths, prefix_groups): per trajectory, the prefix length in tokens and
    a group number (equal numbers = the same first prefix_length tokens; a trajectory alone in
    its group shares nothing). Raises ValueError when the lists differ in length or a mask's
    length differs from its ids'.
    """
    if len(input_ids) != len(loss_masks):
        raise ValueError(f"{len(input_ids)} trajectories but {len(loss_masks)} loss masks")
    heads = []  # each trajectory's untrained prefix, as numpy
    for i, (x, m) in enumerate(zip(input_ids, loss_masks)):
        x, m = torch.as_tensor(x), torch.as_tensor(m)
        if m.shape != x.shape:
            raise ValueError(f"trajectory {i}: loss mask of shape {tuple(m.shape)} for ids of shape {tuple(x.shape)}")
        trained = torch.nonzero(m, as_tuple=False)
        p = int(trained[0]) if trained.numel() else int(x.numel())
        p = max(0, min(p, int(x.numel()) - 1))
        heads.append(x[:p].cpu().numpy())
    if min_common > 0:
        return _common_prefixes(heads, min_common)
    keys: dict = {}
    return [h.size for h in heads], [keys.setdefault((h.size, h.tobytes()), len(keys)) for h in heads]


def _common_prefixes(heads: list, min_common: int) -> tuple[list[int], list[int]]:
    """`shared_prefixes`' grouping by common leading tokens (see there); `heads` are the
    untrained prefixes, numpy int arrays."""
    import numpy as np

    # a fixed-width encoding sorts lexicographically by tokens: alike prefixes end up adjacent
    order = sorted(range(len(heads)), key=lambda i: (heads[i].astype(">i8").tobytes(), i))
    out_len, out_group = [h.size for h in heads], list(range(len(heads)))
    runs: list[tuple[list[int], int]] = []  # (members, their common length)
    for i in order:
        head = heads[i]
        if runs:
            members, common = runs[-1]
            ref = heads[members[0]][:common]
            m = min(common, head.size)
            diff = np.nonzero(ref[:m] != head[:m])[0]
            lcp = int(diff[0]) if diff.size else m
            if lcp >= min_common:
                runs[-1] = (members + [i], lcp)
                continue
        runs.append(([i], head.size))
    for g, (members, common) in enumerate(runs):
        for i in members:
            out_group[i] = g
            if len(members) > 1:
                out_len[i] = common
    return out_len, out_group


def _units(indices: Sequence[int], prefix_lengths, prefix_groups) -> list[list[int]]:
    """Split `indices` into units that share a prefix (order of first appearance)."""
    if prefix_lengths is None:
        return [[i] for i in indices]
    units: dict = {}
    for i in indices:
        key = ("g", prefix_groups[i]) if prefix_lengths[i] > 0 else ("t", i)
        units.setdefault(key, []).append(i)
    return list(units.values())


def plan_micro_batches(lengths: Sequence[int], token_budget: int, prefix_lengths: Optional[Sequence[int]] = None,
                       prefix_groups: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Group trajectory indices into micro-batches of at most `token_budget` computed tokens.

    First-fit decreasing bin packing (fewest micro-batches in practice); a trajectory longer
    than the budget gets a micro-batch of its own. With `prefix_lengths` / `prefix_groups`
    (from `shared_prefixes`), members of a prefix group are kept together where the budget
    allows, and a micro-batch holding k members of a group counts its prefix once
    (p + sum(L_i - p) tokens). Indices inside a micro-batch are sorted, and micro-batches are
    ordered by their first index, so the plan is deterministic.

    Args: lengths: tokens per trajectory (ints >= 1); token_budget: tokens per micro-batch.
    Returns a list of lists of indices into `lengths`. Raises ValueError on a budget < 1,
    a length < 1, or prefix lists of the wrong length.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"trajectory {i} has length {n}; every trajectory needs >= 1 token")
    if (prefix_lengths is None) != (prefix_groups is None):
        raise ValueError("pass both prefix_lengths and prefix_groups, or neither")
    if prefix_lengths is not None and not (len(prefix_lengths) == len(prefix_groups) == len(lengths)):
        raise ValueError(f"prefix_lengths / prefix_groups need one entry per trajectory ({len(lengths)})")
    # units: a trajectory alone, or members of one prefix group chunked to fit the budget
    units: list[tuple[int, list[int]]] = []
    for members in _units(range(len(lengths)), prefix_lengths, prefix_groups):
        if len(members) == 1:
            units.append((lengths[members[0]], members))
            continue
        p = prefix_lengths[members[0]]
        chunks: list[list[int]] = []
        cost: list[int] = []
        for i in sorted(members, key=lambda j: (-lengths[j], j)):
            own = lengths[i] - p
            for c in range(len(chunks)):
                if cost[c] + own <= token_budget:
                    chunks[c].append(i)
                    cost[c] += own
                    break
            else:
                chunks.append([i])
                cost.append(lengths[i])
        units.extend(zip(cost, chunks))
    bins: list[list[int]] = []
    free: list[int] = []
    for n, members in sorted(units, key=lambda u: (-u[0], min(u[1]))):
        for b in range(len(bins)):
            if free[b] >= n:
                bins[b].extend(members)
                free[b] -= n
                break
        else:
            bins.append(list(members))
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
class PackedMember:
    """Where one trajectory's tokens sit in a packed row.

    index: the trajectory's index in the full batch; length: its tokens; prefix: how many of
    its leading tokens are stored once for its prefix group, at row offset `prefix_start`
    (0: none shared); start: row offset of its own tokens [prefix, length).
    """

    index: int
    length: int
    prefix: int
    prefix_start: int
    start: int

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Row offsets [M] of token positions [M] (int64) of this trajectory."""
        return torch.where(positions < self.prefix, self.prefix_start + positions, self.start + positions - self.prefix)


@dataclasses.dataclass
class ScoredTokens:
    """The trained tokens of a packed micro-batch, in member order, M in all.

    rows [M] int64: row offset of the hidden state that predicts each token (its position
    minus one, which may lie in a shared prefix); targets [M] int64: the token ids;
    seq [M] int64: the member number 0..k-1 (for per-sequence loss aggregation), all on the
    batch's device. positions: per member, the token positions [M_j] (CPU int64).
    indices: per member, the trajectory's index in the full batch.
    """

    rows: torch.Tensor
    targets: torch.Tensor
    seq: torch.Tensor
    positions: list
    indices: list

    @property
    def count(self) -> int:
        return int(self.rows.numel())

    def take(self, per_traj: Sequence[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """per_traj[i][t] for every scored token -> [M] of `dtype` on the batch's device."""
        if self.count == 0:
            return torch.zeros(0, dtype=dtype, device=self.rows.device)
        parts = [torch.as_tensor(per_traj[i])[pos] for i, pos in zip(self.indices, self.positions)]
        return torch.cat(parts).to(device=self.rows.device, dtype=dtype)

    def scatter(self, values: torch.Tensor, out: Sequence[torch.Tensor]) -> None:
        """Write values [M] into out[i][t] (per-trajectory tensors, typically CPU fp32) in place."""
        if values.shape[0] != self.count:
            raise ValueError(f"{values.shape[0]} values for {self.count} scored tokens")
        values = values.detach().to("cpu")
        off = 0
        for i, pos in zip(self.indices, self.positions):
            out[i][pos] = values[off:off + pos.numel()].to(out[i].dtype)
            off += pos.numel()


@dataclasses.dataclass
class PackedBatch:
    """One packed micro-batch.

    input_ids [1, N] int64; position_ids [1, N] int64 (each trajectory's true positions);
    attention_mask [1, 1, N, N] block-causal mask ("mask" attention), else None;
    members: one `PackedMember` per trajectory; segments: (start, end, prefix_start,
    prefix_end) row ranges for "segments" attention (each attends causally to itself and
    fully to its prefix range, empty when prefix_start == prefix_end); attention: "mask",
    "segments" or "varlen" (module docstring). segment_masks: None, or one entry per
    segment: None (causal) or bool [S, P + S] (a context window's visibility, "segments").
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    members: list
    segments: tuple
    attention: str = "mask"
    segment_masks: Optional[tuple] = None

    @property
    def num_tokens(self) -> int:
        """Tokens computed (the row's length)."""
        return int(self.input_ids.shape[1])

    @property
    def trajectory_tokens(self) -> int:
        """Tokens of the packed trajectories (a shared prefix counted once per member)."""
        return sum(m.length for m in self.members)

    @property
    def indices(self) -> list:
        return [m.index for m in self.members]

    @property
    def shares_prefix(self) -> bool:
        return any(m.prefix > 0 for m in self.members)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[k + 1] int64 row offsets of the trajectories (only when no prefix is shared)."""
        self._no_sharing("cu_seqlens")
        out = torch.zeros(len(self.members) + 1, dtype=torch.long)
        out[1:] = torch.cumsum(torch.tensor([m.length for m in self.members]), 0)
        return out.to(self.input_ids.device)

    @property
    def seq_ids(self) -> torch.Tensor:
        """[N] int64: the member number of each row token (only when no prefix is shared)."""
        self._no_sharing("seq_ids")
        lengths = torch.tensor([m.length for m in self.members])
        return torch.repeat_interleave(torch.arange(len(self.members)), lengths).to(self.input_ids.device)

    def _no_sharing(self, what: str) -> None:
        if self.shares_prefix:
            raise ValueError(f"{what} is undefined for a row with shared prefixes; use scored() / members")

    def model_inputs(self) -> dict:
        """Keyword arguments for the model's (or its decoder body's) forward on this row.

        "segments" passes the segment table as `fastpo_segments` (Python ints: no device
        sync per layer) for `SEGMENT_ATTENTION`, and an all-ones 2D mask so that
        transformers neither detects the packing from the position ids nor builds an N x N
        mask (sdpa's mask function skips an all-ones mask).
        """
        out = {"input_ids": self.input_ids, "position_ids": self.position_ids}
        if self.attention == "mask":
            out["attention_mask"] = self.attention_mask
        elif self.attention == "segments":
            out.update(attention_mask=torch.ones_like(self.input_ids), fastpo_segments=self.segments)
            if self.segment_masks is not None:
                out["fastpo_segment_masks"] = self.segment_masks
        return out

    def scored(self, loss_masks: Sequence[torch.Tensor]) -> ScoredTokens:
        """The trained tokens: positions t >= 1 where loss_masks[i][t] is set, for every member."""
        dev = self.input_ids.device
        hidden, targets, seq, positions = [], [], [], []
        for j, m in enumerate(self.members):
            mask = torch.as_tensor(loss_masks[m.index]).bool().cpu()
            if mask.numel() != m.length:
                raise ValueError(f"trajectory {m.index}: loss mask of {mask.numel()} entries for {m.length} tokens")
            pos = torch.nonzero(mask[1:], as_tuple=False).flatten() + 1
            if pos.numel() and int(pos[0]) < m.prefix:
                raise ValueError(f"trajectory {m.index} has a trained token at {int(pos[0])}, inside its shared "
                                 f"prefix of {m.prefix} tokens")
            positions.append(pos)
            hidden.append(m.rows(pos - 1))
            targets.append(self.input_ids[0, m.rows(pos).to(dev)])
            seq.append(torch.full((pos.numel(),), j, dtype=torch.long))
        return ScoredTokens(torch.cat(hidden).to(dev), torch.cat(targets), torch.cat(seq).to(dev), positions,
                            self.indices)

    def gather(self, per_traj: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Concatenate per-trajectory 1-D tensors for this micro-batch -> [1, N] (no shared prefixes)."""
        self._no_sharing("gather")
        parts = [torch.as_tensor(per_traj[i]) for i in self.indices]
        out = torch.cat(parts).to(self.input_ids.device)
        if dtype is not None:
            out = out.to(dtype)
        if out.shape[0] != self.num_tokens:
            raise ValueError(f"per-trajectory tensors hold {out.shape[0]} entries, the micro-batch {self.num_tokens}")
        return out[None]

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a [1, N, ...] or [N, ...] tensor into per-trajectory pieces (no shared prefixes)."""
        self._no_sharing("split")
        n = self.num_tokens
        flat = x[0] if (x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == n) else x
        if flat.shape[0] != n:
            raise ValueError(f"tensor of shape {tuple(x.shape)} does not hold this micro-batch's {n} tokens")
        bounds = self.cu_seqlens.tolist()
        return [flat[bounds[j]:bounds[j + 1]] for j in range(len(self.members))]


ATTENTION_MODES = ("mask", "segments", "varlen")


def pack_micro_batch(input_ids: Sequence[torch.Tensor], indices: Sequence[int], *, attention: str = "mask",
                     mask_dtype: torch.dtype = torch.float32, device: Optional[torch.device | str] = None,
                     prefix_lengths: Optional[Sequence[int]] = None,
                     prefix_groups: Optional[Sequence[int]] = None, windows=None) -> PackedBatch:
    """Pack the trajectories `indices` of `input_ids` (a list of 1-D int64 tensors) into one row.

    attention: "mask" builds the N x N block-causal mask (of `mask_dtype`); "segments" and
    "varlen" build none (see the module docstring; `packing_attention(model)` picks).
    prefix_lengths / prefix_groups (from `shared_prefixes`, indexed like `input_ids`), with
    "segments" only: members of one prefix group in this micro-batch store their prefix
    once, [prefix | own tokens of member 1 | own tokens of member 2 | ...]; each member
    keeps its true position ids and attends to the prefix and then causally to itself.
    windows: None, or per trajectory (indexed like `input_ids`) None or the (turn,
    visible_from) labels of a context-window trajectory (fastpo/rollout/window.py): its tokens
    then attend as the sampler's did ("segments" or "mask" attention).
    Raises ValueError for an empty selection, an unknown `attention`, members of one
    prefix group whose prefixes differ, or windows with "varlen" attention.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if len(indices) == 0:
        raise ValueError("a micro-batch needs at least one trajectory")
    share = attention == "segments" and prefix_lengths is not None
    wins = {i: windows[i] for i in indices if windows is not None and windows[i] is not None}
    if wins and attention == "varlen":
        raise ValueError("context-window trajectories need a per-token attention mask, which flash-attn's varlen "
                         "packing cannot take; load the model with sdpa or eager attention")
    seg_masks = []
    ids_parts, pos_parts, members, segments = [], [], [], []
    row = 0
    for unit in _units(indices, prefix_lengths if share else None, prefix_groups):
        seqs = [torch.as_tensor(input_ids[i], dtype=torch.long).cpu() for i in unit]
        p = int(prefix_lengths[unit[0]]) if (share and len(unit) > 1) else 0
        if p:
            for i, x in zip(unit[1:], seqs[1:]):
                if x.numel() <= p or not torch.equal(x[:p], seqs[0][:p]):
                    raise ValueError(f"trajectory {i} does not share the {p}-token prefix of trajectory {unit[0]}")
            ids_parts.append(seqs[0][:p])
            pos_parts.append(torch.arange(p))
            segments.append((row, row + p, row, row))
            seg_masks.append(None)
        prefix_start = row
        row += p
        for i, x in zip(unit, seqs):
            n = int(x.numel())
            ids_parts.append(x[p:])
            pos_parts.append(torch.arange(p, n))
            members.append(PackedMember(int(i), n, p, prefix_start, row))
            segments.append((row, row + n - p, prefix_start, prefix_start + p))
            seg_masks.append(_window_rows(wins[i], p, n, device) if i in wins else None)
            row += n - p
    ids = torch.cat(ids_parts).to(device)[None]
    pos = torch.cat(pos_parts).to(device)[None]
    mask = None
    if attention == "mask":
        if wins:
            allowed = block_causal_mask([m.length for m in members], torch.bool, device)
            for m in members:
                if m.index in wins:
                    allowed[0, 0, m.start:m.start + m.length, m.start:m.start + m.length] = \
                        _window_rows(wins[m.index], 0, m.length, device)
            mask = allowed if mask_dtype == torch.bool else torch.zeros(allowed.shape, dtype=mask_dtype,
                                                                        device=device).masked_fill_(
                ~allowed, torch.finfo(mask_dtype).min)
        else:
            mask = block_causal_mask([m.length for m in members], mask_dtype, device)
    masks = tuple(seg_masks) if (attention == "segments" and wins) else None
    return PackedBatch(ids, pos, mask, members, tuple(segments), attention, masks)


def _window_rows(labels, p: int, n: int, device) -> torch.Tensor:
    """bool [n - p, n]: the context-window visibility of a trajectory's tokens p..n-1 over its
    tokens 0..n-1 (= its prefix then its own tokens, the segment's key order)."""
    turn, vis = labels
    if turn.numel() != n:
        raise ValueError(f"window labels of {turn.numel()} entries for a trajectory of {n} tokens")
    return window_mask(turn, vis, slice(p, n)).to(device)


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


def _segment_attention(module, query, key, value, attention_mask, *, fastpo_segments=None,
                       fastpo_segment_masks=None, **kwargs):
    """transformers attention function: sdpa per packed segment, plain sdpa otherwise.

    query [1, heads, N, D], key/value [1, kv_heads, N, D]; `fastpo_segments`: (start, end,
    prefix_start, prefix_end) row ranges covering [0, N) in order. A segment attends
    causally to itself (sdpa's causal fast path) and, when it has one, fully to its prefix
    range (then through a [S, P + S] mask). `fastpo_segment_masks` (None or one entry per
    segment, None or bool [S, P + S]) replaces a segment's visibility (context windows).
    Returns ([1, N, heads, D], None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    if fastpo_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    n = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != n:
        raise ValueError(f"segment attention takes one packed row without a KV cache, got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    if fastpo_segments[0][0] != 0 or fastpo_segments[-1][1] != n:
        raise ValueError(f"fastpo_segments {fastpo_segments[:2]}... do not span the row's {n} tokens")
    # one split per tensor (its backward is one concatenation) rather than a slice per use (each
    # slice's backward fills a zero tensor the size of the row)
    sizes = [b - a for a, b, _, _ in fastpo_segments]
    qs, ks, vs = (t.split(sizes, dim=2) for t in (query, key, value))
    piece = {(a, b): s for s, (a, b, _, _) in enumerate(fastpo_segments)}  # (as packed, a prefix range is one)
    outs = []
    for s, (a, b, pa, pb) in enumerate(fastpo_segments):
        own = fastpo_segment_masks[s] if fastpo_segment_masks is not None else None
        if pa == pb and own is None:
            outs.append(sdpa_attention_forward(module, qs[s], ks[s], vs[s], None, is_causal=True, **kwargs)[0])
            continue
        if pa == pb:
            k, v = ks[s], vs[s]
        else:
            p = piece.get((pa, pb))
            kp, vp = (ks[p], vs[p]) if p is not None else (key[:, :, pa:pb], value[:, :, pa:pb])
            k, v = torch.cat([kp, ks[s]], dim=2), torch.cat([vp, vs[s]], dim=2)
        if own is None:  # own token i sees the whole prefix and own tokens <= i
            own = torch.ones(b - a, pb - pa + b - a, dtype=torch.bool, device=query.device).tril(pb - pa)
        outs.append(sdpa_attention_forward(module, qs[s], k, v, own[None, None], is_causal=False, **kwargs)[0])
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


def packing_mask_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the block-causal mask `pack_micro_batch` builds for `model` ("mask" packing).

    torch.bool for sdpa (True = attend; any query dtype, autocast or not); for any other
    attention (eager) the additive form in the dtype of the model's hidden states, as
    transformers builds its own eager masks (the embeddings' output dtype: the parameters'
    dtype, under autocast too): eager adds the mask to its [N, N] scores, which a float32
    mask would turn into float32 for a bf16 model. "segments" and "varlen" packing build no
    mask (the value is then unused).
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    if impl in ("sdpa", SEGMENT_ATTENTION):
        return torch.bool
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    return weight.dtype if weight is not None and weight.dtype.is_floating_point else torch.float32
