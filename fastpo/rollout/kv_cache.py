"""The native engine's KV cache: keys and values in blocks, allocated as tokens arrive.

`PagedKVCache` keeps the keys and values of many token sequences (the engine's sessions) in
per-layer pools of blocks of `BLOCK` (16) tokens, as SGLang's and vLLM's paged caches do:

- A sequence is a block table (its blocks, in order) and a length. A forward that adds n
  tokens to a sequence takes new blocks only when its last one is full, so memory follows the
  tokens held, not a capacity reserved per row.
- `fork` gives a new sequence the same blocks (reference counts): the common prompt prefix of
  every env group and each group's prompt are held once and shared by every row that starts
  with them. A write into a shared block that is only partly filled first copies it (copy on
  write); full shared blocks are never written again.
- `free` returns a sequence's blocks at once (those no other sequence shares) to the free
  list, from which the next forward takes its blocks: a finished trajectory's memory is
  reused by the others.
- The pools grow when the free list runs short (each layer in turn, so the copy needs one
  layer's pool of extra memory) and are released by `reset`. `stats` records the most pool
  bytes held (`peak_kv_bytes`) and the most bytes of distinct tokens held at one moment
  (`peak_kv_token_bytes`: a shared block counted once).

Attention. The engine runs the model's forward on the new tokens of several sequences packed
into one row ([1, N], each sequence's tokens back to back, with their own position ids) and
with the model's attention function switched to `paged_attention` (`attention_switched`),
which receives the cache and the forward's `Step` through the forward's keyword arguments.
Per layer it writes the new keys and values into their slots, then attends each sequence's
queries to its own tokens: a decoding forward (one token per sequence) with
`fastpo.kernels.cpu_attention.paged_decode` on the CPU (each key and value read once, no
padding) or its PyTorch reference elsewhere; a prefill forward sequence by sequence with sdpa
on the sequence's gathered blocks (causal over its new tokens). Keys are stored after the
rotary embedding, at the positions the engine gave them, so moving entries inside a sequence
(`remove`) does not change what they mean.

Also here: which models the engine can hold (`unsupported_attention`: full attention in every
layer), the prompt prefix every env group shares (`shared_prefix_length`), and the forward's
cache keyword across transformers versions (`cache_kwarg`, for callers that run transformers'
own cache).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch

from fastpo.kernels import cpu_attention
from fastpo.kernels.cpu_attention import BLOCK
from fastpo.memory import mapped_allocations


def unsupported_attention(config) -> str | None:
    """Why a model config cannot run on the native engine, or None when every layer is full attention.

    Checks ``layer_types`` (transformers >= 4.5x: anything but "full_attention", e.g.
    "sliding_attention", "linear_attention"), else ``sliding_window`` (unless
    ``use_sliding_window`` is False), and ``attention_chunk_size``.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    if types:
        other = sorted({str(t) for t in types if t != "full_attention"})
        if other:
            return f"layer_types includes {other}"
    else:
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) is not False:
            return f"sliding_window={window!r}"
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is not None:
        return f"attention_chunk_size={chunk!r}"
    return None


#: Shortest common prompt prefix worth a forward of its own in `NativeEngine.start`.
MIN_SHARED_PREFIX = 16


def shared_prefix_length(prompts: list) -> int:
    """Tokens at the start of every prompt that `NativeEngine.start` prefills once for all of them.

    prompts: lists of token ids. The longest common prefix, less one token if it is a whole
    prompt (every row keeps a token of its own, whose logits start its decoding); 0 for a single
    prompt or a prefix shorter than MIN_SHARED_PREFIX.
    """
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts)
    S = 0
    while S < n and all(p[S] == first[S] for p in prompts):
        S += 1
    S = min(S, n - 1)
    return S if S >= MIN_SHARED_PREFIX else 0


def cache_kwarg(model) -> str:
    """'cache' (transformers >= 5.2x) or 'past_key_values' (older), for the model's forward."""
    base = model
    for attr in ("get_base_model",):  # peft wrappers
        if hasattr(base, attr):
            base = getattr(base, attr)()
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


#: The fewest blocks the pools grow by.
MIN_GROWTH = 16


def _blocks_for(tokens: int) -> int:
    return (tokens + BLOCK - 1) // BLOCK


@dataclasses.dataclass
class Step:
    """One forward's view of the cache (from `PagedKVCache.plan`).

    seqs: the R sequences, in the order their new tokens are packed. counts: new tokens per
    sequence (>= 1); the packed row holds N = sum(counts) tokens, sequence i's at
    [offsets[i], offsets[i + 1]). lengths: each sequence's tokens after the forward (ints).
    slot_block, slot_index: int64 [N], where each new token's key and value go (block id, slot
    in the block). table: int32 [R, max blocks], the sequences' block tables (zero-padded).
    lens: int64 [R], `lengths` as a tensor. decode: every count is 1 (one query per sequence).
    """

    seqs: list
    counts: list
    offsets: list
    lengths: list
    slot_block: torch.Tensor
    slot_index: torch.Tensor
    table: torch.Tensor
    lens: torch.Tensor
    decode: bool
    masks: list = None  # per sequence: bool [n, L] for a prefill (None where n == L: plain causal)


class PagedKVCache:
    """Keys and values of token sequences in per-layer pools of `BLOCK`-token blocks (module docstring).

    Args: num_layers, kv_heads, head_dim: the model's decoder layers, key/value heads and head
    dimension. The pools take the dtype and device of the first keys written.

    Layout per layer: keys [blocks, kv_heads, head_dim, BLOCK] (transposed within a block, for
    `cpu_attention.paged_decode`), values [blocks, kv_heads, BLOCK, head_dim]; a block is one
    index in both pools of every layer. Token i of a sequence is slot i % BLOCK of block
    table[i // BLOCK].

    Sequences are ints from `new` / `fork`; an unknown one raises KeyError. ``stats``:
    ``peak_kv_bytes`` (the largest pools held, keys and values of every layer, bytes),
    ``peak_kv_token_bytes`` (the most distinct tokens held at one moment, times the bytes of a
    token's keys and values in every layer), ``pool_growths`` (reallocations); reset with
    `reset_stats`.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        self.num_layers, self.kv_heads, self.head_dim = int(num_layers), int(kv_heads), int(head_dim)
        self.k_pools: list = [None] * self.num_layers
        self.v_pools: list = [None] * self.num_layers
        self.dtype = self.device = None
        self.capacity = 0  # blocks in each pool
        self._refs: list = []  # per block: sequences holding it (0 = free)
        self._fill: list = []  # per block: slots written (a shared block's fill is its longest view)
        self._free: list = []  # free block ids (taken from the end)
        self._tables: dict = {}  # sequence -> [block ids]
        self._lengths: dict = {}  # sequence -> tokens
        self._next_seq = 0
        self.held_tokens = 0  # sum of _fill over blocks in use
        self.reset_stats()

    # -- bookkeeping -----------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero ``stats`` (the peaks restart from what is held now)."""
        self.stats = {"peak_kv_bytes": self.pool_bytes(), "peak_kv_token_bytes": self.token_bytes(),
                      "pool_growths": 0}

    def bytes_per_token(self) -> int:
        """Bytes of one token's keys and values in every layer (0 before the first write)."""
        if self.dtype is None:
            return 0
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def pool_bytes(self) -> int:
        """Bytes the pools hold now (allocated, used or not)."""
        return self.capacity * BLOCK * self.bytes_per_token() if self.k_pools[0] is not None else 0

    def token_bytes(self) -> int:
        """Bytes of the distinct tokens held now (`held_tokens` x `bytes_per_token`)."""
        return self.held_tokens * self.bytes_per_token()

    def _note(self) -> None:
        st = self.stats
        st["peak_kv_bytes"] = max(st["peak_kv_bytes"], self.pool_bytes())
        st["peak_kv_token_bytes"] = max(st["peak_kv_token_bytes"], self.token_bytes())

    def reset(self) -> None:
        """Drop every sequence and release the pools (the peaks in ``stats`` stay)."""
        self.k_pools = [None] * self.num_layers
        self.v_pools = [None] * self.num_layers
        self.dtype = self.device = None
        self.capacity = 0
        self._refs, self._fill, self._free = [], [], []
        self._tables, self._lengths = {}, {}
        self.held_tokens = 0

    # -- sequences -------------------------------------------------------------------------
    def new(self) -> int:
        """An empty sequence."""
        s = self._next_seq
        self._next_seq += 1
        self._tables[s], self._lengths[s] = [], 0
        return s

    def fork(self, seq: int) -> int:
        """A new sequence holding the same tokens as `seq` (its blocks shared, not copied)."""
        blocks = self._tables[seq]
        s = self.new()
        self._tables[s], self._lengths[s] = list(blocks), self._lengths[seq]
        for b in blocks:
            self._refs[b] += 1
        return s

    def free(self, seq: int) -> None:
        """Forget `seq`; its blocks no other sequence holds go back to the free list."""
        self._release(self._tables.pop(seq))
        del self._lengths[seq]

    def length(self, seq: int) -> int:
        """Tokens `seq` holds."""
        return self._lengths[seq]

    def sequences(self) -> list:
        """The sequences held, in creation order."""
        return list(self._tables)

    def _release(self, blocks) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self.held_tokens -= self._fill[b]
                self._fill[b] = 0
                self._free.append(b)

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first `length` tokens of `seq` (0 <= length <= its length); the blocks past
        them are released. ValueError outside that range."""
        n = self._lengths[seq]
        if not 0 <= length <= n:
            raise ValueError(f"truncate to {length} tokens: the sequence holds {n}")
        table = self._tables[seq]
        keep = _blocks_for(length)
        self._release(table[keep:])
        del table[keep:]
        self._lengths[seq] = length
        if keep and self._refs[table[-1]] == 1:  # its own last block: the slots past `length` are free again
            b = table[-1]
            fill = length - (keep - 1) * BLOCK
            self.held_tokens += fill - self._fill[b]
            self._fill[b] = fill

    def remove(self, seq: int, lo: int, hi: int) -> None:
        """Drop tokens [lo, hi) of `seq` (indices into the sequence, 0 <= lo <= hi <= length):
        the tokens after them move down by hi - lo (copied into blocks of the sequence's own),
        the blocks left empty are released. ValueError outside that range."""
        n = self._lengths[seq]
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"remove tokens [{lo}, {hi}): the sequence holds {n}")
        if lo == hi:
            return
        table = self._tables[seq]
        src_blocks, src_slots = [table[i // BLOCK] for i in range(hi, n)], [i % BLOCK for i in range(hi, n)]
        pinned = table[hi // BLOCK:]
        for b in pinned:  # held until copied: truncating may release them and the copy's room reuse them
            self._refs[b] += 1
        self.truncate(seq, lo)
        if n > hi:
            dst_blocks, dst_slots = self._room(seq, n - hi)
            self._copy_slots(src_blocks, src_slots, dst_blocks, dst_slots)
            self._lengths[seq] = lo + n - hi
        self._release(pinned)
        self._note()

    # -- allocation ------------------------------------------------------------------------
    def _take(self) -> int:
        b = self._free.pop()
        self._refs[b] = 1
        return b

    def _grow(self, free_needed: int) -> None:
        """At least `free_needed` free blocks: the pools grow by what is missing, and by an
        eighth of their size (or MIN_GROWTH blocks) at least, for fewer reallocations; each
        layer in turn."""
        missing = free_needed - len(self._free)
        if missing <= 0:
            return
        new_cap = self.capacity + max(missing, self.capacity // 8, MIN_GROWTH)
        self._refs.extend([0] * (new_cap - self.capacity))
        self._fill.extend([0] * (new_cap - self.capacity))
        self._free[:0] = range(new_cap - 1, self.capacity - 1, -1)  # taken after the free ones, lowest first
        for pools in (self.k_pools, self.v_pools):
            for i, old in enumerate(pools):
                if old is None:
                    continue
                with mapped_allocations():  # returned to the system when replaced (fastpo.memory)
                    new = old.new_empty((new_cap, *old.shape[1:]))
                new[: self.capacity].copy_(old)
                pools[i] = new
                del old
        if self.k_pools[0] is not None:
            self.stats["pool_growths"] += 1
        self.capacity = new_cap
        self._note()

    def _room(self, seq: int, n: int) -> tuple:
        """Make room for n more tokens at the end of `seq` (its last block copied first when it
        is shared and partly filled; new blocks as needed) and return where they go:
        (block ids, slots), int lists of n. Does not change the sequence's length."""
        table = self._tables[seq]
        length = self._lengths[seq]
        if length % BLOCK and self._refs[table[-1]] > 1:  # copy on write
            old = table[-1]
            self._grow(1)
            new = self._take()
            self._refs[old] -= 1
            fill = length % BLOCK
            self._fill[new] = fill
            self.held_tokens += fill
            self._copy_slots([old] * fill, list(range(fill)), [new] * fill, list(range(fill)))
            table[-1] = new
        need = _blocks_for(length + n) - len(table)
        if need > 0:
            self._grow(need)
            table.extend(self._take() for _ in range(need))
        for j in range(length // BLOCK, len(table)):  # the slots this forward writes are held from here
            b = table[j]
            end = min(length + n - j * BLOCK, BLOCK)
            if end > self._fill[b]:
                self.held_tokens += end - self._fill[b]
                self._fill[b] = end
        return [table[i // BLOCK] for i in range(length, length + n)], [i % BLOCK for i in range(length, length + n)]

    def _copy_slots(self, src_blocks, src_slots, dst_blocks, dst_slots) -> None:
        """Copy the keys and values of slots (src_blocks, src_slots) to (dst_blocks, dst_slots)
        in every layer (int lists or int64 tensors of equal length)."""
        for kp, vp in zip(self.k_pools, self.v_pools):
            if kp is None:
                continue
            sb, ss, db, ds = (torch.as_tensor(x, dtype=torch.long).to(kp.device)
                              for x in (src_blocks, src_slots, dst_blocks, dst_slots))
            kp[db, :, :, ds] = kp[sb, :, :, ss]
            vp[db, :, ds, :] = vp[sb, :, ss, :]

    def plan(self, seqs: list, counts: list, spare: int = 0, device=None) -> Step:
        """Room for counts[i] new tokens at the end of each of `seqs` (distinct), for one forward.

        Takes blocks as needed (growing the pools, and keeping at least `spare` blocks free
        after them: the rest of a turn's decoding, so that its steps do not each grow the
        pools); the new tokens count as held from here. Returns the `Step` the forward passes
        to `paged_attention`, its tensors on `device` (the model's; default: the pools', else
        the CPU); the sequences' lengths include the new tokens from here on. Raises
        ValueError for repeated sequences or a count < 1.
        """
        if len(set(seqs)) != len(seqs) or any(int(c) < 1 for c in counts) or len(counts) != len(seqs):
            raise ValueError(f"plan needs distinct sequences and counts >= 1, got {seqs!r:.100} / {counts!r:.100}")
        need = 0
        for s, c in zip(seqs, counts):
            n, table = self._lengths[s], self._tables[s]
            need += _blocks_for(n + c) - len(table) + (n % BLOCK != 0 and self._refs[table[-1]] > 1)
        self._grow(need + spare)
        blocks, slots, lengths = [], [], []
        for s, c in zip(seqs, counts):
            b, o = self._room(s, c)
            blocks += b
            slots += o
            self._lengths[s] += c
            lengths.append(self._lengths[s])
        self._note()
        dev = torch.device(device) if device is not None else (self.device or torch.device("cpu"))
        width = max(len(self._tables[s]) for s in seqs)
        table = torch.tensor([self._tables[s] + [0] * (width - len(self._tables[s])) for s in seqs],
                             dtype=torch.int32)
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + int(c))
        decode = all(int(c) == 1 for c in counts)
        masks = None
        if not decode:
            masks = []
            for c, L in zip(counts, lengths):
                c = int(c)
                masks.append(None if c == L else
                             (torch.arange(L)[None, :] <= torch.arange(L - c, L)[:, None]).to(dev))
        return Step(list(seqs), [int(c) for c in counts], offsets, lengths, torch.tensor(blocks, device=dev),
                    torch.tensor(slots, device=dev), table.to(dev),
                    torch.tensor(lengths, dtype=torch.int64, device=dev), decode, masks)

    # -- attention -------------------------------------------------------------------------
    def _pools(self, layer: int, key: torch.Tensor) -> tuple:
        if self.k_pools[layer] is None:
            if self.dtype is None:
                self.dtype, self.device = key.dtype, key.device
            H, D = self.kv_heads, self.head_dim
            with mapped_allocations():
                self.k_pools[layer] = torch.empty((self.capacity, H, D, BLOCK), dtype=self.dtype, device=self.device)
                self.v_pools[layer] = torch.empty((self.capacity, H, BLOCK, D), dtype=self.dtype, device=self.device)
            if layer == self.num_layers - 1:
                self._note()
        return self.k_pools[layer], self.v_pools[layer]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: Step,
               scale: float) -> torch.Tensor:
        """Write the forward's new keys and values of `layer` into their slots, then attend.

        query [1, Hq, N, D], key / value [1, kv_heads, N, D]: the packed row's new tokens
        (after the rotary embedding), in `step`'s order. Sequence i's queries attend to its
        tokens, its new ones causally. Returns [1, N, Hq, D] in the query's dtype.
        """
        kp, vp = self._pools(layer, key)
        k = key[0].transpose(0, 1).to(kp.dtype)  # [N, H, D]
        v = value[0].transpose(0, 1).to(vp.dtype)
        kp[step.slot_block, :, :, step.slot_index] = k
        vp[step.slot_block, :, step.slot_index, :] = v
        Hq, D = query.shape[1], query.shape[3]
        if step.decode:
            q = query[0].transpose(0, 1)  # [R, Hq, D]
            fn = cpu_attention.paged_decode if cpu_attention.usable(q, kp, vp) else cpu_attention.paged_decode_reference
            return fn(q, kp, vp, step.table, step.lens, scale)[None]
        out = query.new_empty((1, query.shape[2], Hq, D))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for i in range(len(step.seqs)):
            a, b, L = step.offsets[i], step.offsets[i + 1], step.lengths[i]
            ks, vs = cpu_attention.gather_rows(kp, vp, step.table[i:i + 1, :_blocks_for(L)], L)
            q = query[:, :, a:b]
            mask = step.masks[i]
            o = sdpa(q, ks.to(q.dtype), vs.to(q.dtype), attn_mask=mask, is_causal=mask is None, scale=scale,
                     enable_gqa=True)
            out[0, a:b] = o[0].transpose(0, 1)
        return out


#: The name `paged_attention` is registered under with transformers' AttentionInterface.
PAGED_ATTENTION = "fastpo_paged_kv"


def paged_attention(module, query, key, value, attention_mask, scaling=None, fastpo_kv=None, **kwargs):
    """transformers attention function over a `PagedKVCache`: ``fastpo_kv`` = (cache, step)
    from the forward's keyword arguments; the layer is ``module.layer_idx``. query [1, Hq, N,
    D], key/value [1, kv_heads, N, D] (the new tokens); `attention_mask` is ignored (the step
    says what each query sees). Returns ([1, N, Hq, D], None). ValueError without ``fastpo_kv``."""
    if fastpo_kv is None:
        raise ValueError(f"attention {PAGED_ATTENTION!r} needs fastpo_kv=(cache, step) in the forward's arguments")
    cache, step = fastpo_kv
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return cache.attend(module.layer_idx, query, key, value, step, scale), None


def _no_mask(*args, **kwargs):
    return None


@contextlib.contextmanager
def attention_switched(model):
    """Within the block, `model` attends with `paged_attention` (its config's attention
    implementation switched, then restored; registered with transformers on first use)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    AttentionMaskInterface.register(PAGED_ATTENTION, _no_mask)  # no mask is built: the step has what it needs
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = PAGED_ATTENTION
    try:
        yield
    finally:
        cfg._attn_implementation = before
