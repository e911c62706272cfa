"""fastpo's native generation engine: a transformers model driven by its own batched sampler.

What it does that ``model.generate`` in a per-turn loop does not:

- Sessions. ``start(prompts, group_size)`` opens ``P * group_size`` sessions; session ``s``
  belongs to env group ``s // group_size``. Each group's prompt is prefilled once and its KV
  cache is copied to the group's sessions (group prefix sharing); the prefix that all the
  groups' prompts share (system prompt, game rules) is prefilled once for all of them.
- KV cache kept across turns. ``generate(sessions, append, params)`` feeds only the tokens
  appended since the session's last forward (the end of the previous response and the
  between-turn template tokens), then decodes. Nothing is re-prefilled.
- Batched decoding with per-sequence stop: a row that samples a stop token, completes a
  stop string, hits ``max_new_tokens`` or the context limit leaves the batch at once, so
  later steps do not compute for it.

KV layout. Per layer one buffer ``[R, H_kv, capacity, D]`` with a validity mask
``[R, capacity]``. Rows are left-padded, and holes (masked columns) appear where rows of one
chunk had different lengths; every position id is the token's true position, so attention
over the masked buffer equals attention over the unpadded sequence. At the start of each
``generate`` call the rows of the continuing sessions are compacted (holes removed,
right-aligned) into a fresh buffer sized for the turn, so buffers never grow mid-turn.
Within the decode loop the live rows are kept as a prefix ``[:live]`` of the buffer: a row
that stops is swapped with the last live row (two row copies), never a whole-batch copy.

Eviction (bounded context windows, rollout.context_window = K). ``evict(session, lo, hi)``
drops the KV entries of the session's tokens at positions [lo, hi) (masked out, removed at the
next compaction), and tokens in that range not fed yet (the pending last token of a response,
the head of the next append) are skipped, never fed. Kept tokens keep their positions (RoPE
positions are never shifted), so the trainer reproduces the sampler's context with the
trajectory's own position ids and a per-turn attention mask (fastpo/rollout/window.py).
``rewind(session, length)`` drops everything from position `length` on and feeds the next
append from that position (re-prefilling a window with fresh positions; the benchmark's
baseline). Per column the buffer also keeps each entry's position and token id
(``session_context``), and ``stats["peak_kv_bytes"]`` records the largest KV buffer held.

Weights are the caller's module (no copy): a trainer that updates the model in place
is immediately sampled from. Generation runs under ``torch.no_grad()`` in eval mode and
restores the module's training flag afterwards.

Log-prob convention. Each sampled token's recorded log-prob is log softmax(logits / T) over
the *full* vocabulary at the sampling temperature T (fp32), whatever top-p / top-k did to the
draw, and at T = 1 for greedy decoding (T = 0). It is the quantity the trainer recomputes, so
the first step's ratio is exactly 1 (see sampling.py). SGLangEngine's convention differs when
top_p < 1 (see sglang_engine.py).

Supports decoder-only transformers models with full attention in every layer (Llama,
Qwen2 / Qwen2.5 with use_sliding_window=False, Mistral without a sliding window, ...).
Configs with a sliding window, chunked attention or non-attention layers (``layer_types``
other than "full_attention") are refused at construction with ValueError: this engine's KV
cache keeps every position, so such models would silently compute something else.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from transformers import DynamicCache

from fastpo.memory import mapped_allocations

# The KV buffer layer and the model checks live in kv_cache.py; the names stay importable here.
from .kv_cache import BufferLayer, cache_kwarg, shared_prefix_length, unsupported_attention
from .sampling import SamplingParams, sample_tokens, sample_tokens_by_stream

STOP_EOT = "eot"
STOP_STRING = "stop_string"
STOP_LENGTH = "length"
STOP_CONTEXT = "context"


@dataclasses.dataclass
class TurnOutput:
    """One session's response in one turn.

    token_ids: the sampled ids, exactly as sampled (a stop token or the token completing a
    stop string included). logprobs: log-prob of each (nats) at the sampling temperature,
    over the full vocabulary (NativeEngine; see the module docstring for SGLang's).
    stop_reason: "eot" (a stop token), "stop_string", "length" (max_new_tokens) or
    "context" (the session reached max_context; possibly with no tokens).
    entropies: entropy (nats) of the full distribution each token was drawn from, at the
    sampling temperature (NativeEngine; empty where an engine does not record it).
    values: `NativeEngine.readout` of the hidden state each token was sampled from (e.g. a
    critic's V(s_t)); empty when no readout is set.
    """

    token_ids: list
    logprobs: list
    stop_reason: str
    entropies: list = dataclasses.field(default_factory=list)
    values: list = dataclasses.field(default_factory=list)


class NativeEngine:
    """Session-based batched generation on a transformers causal LM (see module docstring).

    Args:
        model: a transformers ``*ForCausalLM`` (or a peft wrapper of one), shared, not copied.
        tokenizer: its tokenizer (used for the pad id and for stop-string checks).
    Raises ValueError for a model whose layers are not all full attention (sliding window,
    chunked or linear attention; see `unsupported_attention`).

    Counters (cumulative, reset with ``reset_stats()``): ``stats["prefilled_tokens"]``
    (real tokens fed in prefill forwards), ``stats["generated_tokens"]`` (sampled tokens),
    ``stats["forward_passes"]``, ``stats["seconds"]``; where the time goes, for comparing
    with the machine's limits (bench/limits.py): ``stats["prefill_seconds"]`` (the prefill
    forwards), ``stats["decode_seconds"]`` (the decode loops: sampling, stop checks and the
    one-token forwards), ``stats["decode_steps"]`` (one-token forwards),
    ``stats["decode_rows"]`` (rows summed over those forwards) and
    ``stats["decode_kv_columns"]`` (KV buffer columns each forward reads, summed over its
    rows: rows x buffer length; a layer's K and V of one column are 2 x KV heads x head dim
    values).

    ``readout``: None, or a callable mapping the final hidden states [R, H] (the LM head's
    input) to a float tensor [R]; while set, every sampled token also records the readout of
    the hidden state it was sampled from (``TurnOutput.values``). A trainer sets it to its
    value head to get the critic's values from the sampling pass itself.
    """

    def __init__(self, model, tokenizer):
        why = unsupported_attention(model.config)
        if why is not None:
            raise ValueError(f"NativeEngine supports models with full attention in every layer; "
                             f"{type(model).__name__} has {why}. Use a full-attention model (Llama, Qwen2.5 with "
                             f"use_sliding_window=False, ...)")
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self._cache_kw = cache_kwarg(model)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self._stop_char_masks: dict = {}
        self.readout = None
        self._hidden = None  # the LM head's input of the last forward, while a readout is set
        self._values = None  # the readout of the last forward [rows], or None
        self.reset_stats()
        self._clear()

    # -- bookkeeping -----------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the token and time counters."""
        self.stats = {"prefilled_tokens": 0, "generated_tokens": 0, "forward_passes": 0, "seconds": 0.0,
                      "peak_kv_bytes": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0, "decode_steps": 0,
                      "decode_rows": 0, "decode_kv_columns": 0}

    def _clock(self) -> float:
        """perf_counter after the device's queued work (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _clear(self) -> None:
        self._layers = [BufferLayer() for _ in range(self.num_layers)]
        self._mask = None  # bool [R, capacity]
        self._pos = None  # int64 [R, capacity]: position of each column's token
        self._tok = None  # int64 [R, capacity]: token id of each column
        self._L = 0
        self._rows = 0
        self._row_of: dict = {}
        self._cached: dict = {}  # session -> next position (tokens fed or skipped so far)
        self._kept: dict = {}  # session -> tokens in the KV cache (fewer than _cached after evictions)
        self._floor: dict = {}  # session -> positions below this are evicted: not fed when pending
        self._pending: dict = {}  # session -> tokens not yet fed (the last sampled token)
        self._start_logits: dict = {}  # session -> logits [V] after the shared prompt prefill
        self._start_values: dict = {}  # session -> readout after the shared prompt prefill (readout set)
        self._num_sessions = 0

    def finish(self) -> None:
        """Release every session and its KV cache."""
        self._clear()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def session_length(self, session: int) -> int:
        """Tokens in `session` so far (prompt + all responses and appended tokens), evicted ones included."""
        return self._cached[session] + len(self._pending[session])

    def session_context(self, session: int) -> tuple:
        """(token ids, positions) of the KV entries `session` holds now, in order (int lists);
        the pending last sampled token, not fed yet, is not among them."""
        row = self._row_of[session]
        keep = self._mask[row, :self._L]
        return self._tok[row, :self._L][keep].tolist(), self._pos[row, :self._L][keep].tolist()

    def evict(self, session: int, lo: int, hi: int) -> None:
        """Drop `session`'s tokens at positions [lo, hi) from its context (see module docstring).

        Entries already in the KV cache are masked out; tokens in the range that are not fed
        yet (pending, or the head of the next append) will be skipped. Positions of the other
        tokens do not change. Raises ValueError for an unknown session or lo > hi.
        """
        if session not in self._cached:
            raise ValueError(f"session {session!r} is not open")
        if session in self._start_logits:  # its KV row is still the group's shared prompt row
            raise ValueError(f"session {session!r} has not generated yet; nothing of its own to drop")
        if not 0 <= lo <= hi:
            raise ValueError(f"evict needs 0 <= lo <= hi, got lo={lo!r}, hi={hi!r}")
        row = self._row_of[session]
        pos = self._pos[row, :self._L]
        drop = self._mask[row, :self._L] & (pos >= lo) & (pos < hi)
        self._kept[session] -= int(drop.sum())
        self._mask[row, :self._L] &= ~drop
        self._floor[session] = max(self._floor.get(session, 0), hi)

    def rewind(self, session: int, length: int) -> None:
        """Drop `session`'s tokens at positions >= `length` and its pending token; the next
        append is fed from position `length` on (fresh positions). Raises ValueError for an
        unknown session or a length outside [1, session_length]."""
        if session not in self._cached:
            raise ValueError(f"session {session!r} is not open")
        if session in self._start_logits:  # its KV row is still the group's shared prompt row
            raise ValueError(f"session {session!r} has not generated yet; nothing of its own to drop")
        if not 1 <= length <= self.session_length(session):
            raise ValueError(f"rewind length must be in [1, {self.session_length(session)}], got {length!r}")
        row = self._row_of[session]
        drop = self._mask[row, :self._L] & (self._pos[row, :self._L] >= length)
        self._kept[session] -= int(drop.sum())
        self._mask[row, :self._L] &= ~drop
        self._cached[session] = length
        self._pending[session] = []
        self._floor.pop(session, None)
        self._start_logits.pop(session, None)
        self._start_values.pop(session, None)

    def _note_kv(self) -> None:
        size = sum(x.numel() * x.element_size() for layer in self._layers for x in (layer.kbuf, layer.vbuf)
                   if x is not None)
        self.stats["peak_kv_bytes"] = max(self.stats["peak_kv_bytes"], size)

    @contextlib.contextmanager
    def _inference(self):
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)
            self.stats["seconds"] += time.perf_counter() - t0

    def _forward(self, ids, attn, pos, rows: int, length: int):
        """One forward of `rows` rows; writes K/V at columns [length, length + n). Returns logits [rows, V]
        (and sets ``self._values`` [rows] fp32 from the readout, or None)."""
        for layer in self._layers:
            layer.bind(layer.kbuf, layer.vbuf, rows, length, layer.capacity)
        cache = DynamicCache()
        cache.layers = self._layers
        hook = None
        if self.readout is not None:
            def keep(_module, args):
                self._hidden = args[0][:, -1, :]

            hook = self.model.get_output_embeddings().register_forward_pre_hook(keep)
        try:
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                             **{self._cache_kw: cache})
        finally:
            if hook is not None:
                hook.remove()
        self._values = None
        if hook is not None:
            self._values = self.readout(self._hidden).float().reshape(rows)
            self._hidden = None
        self.stats["forward_passes"] += 1
        return out.logits[:, -1, :]

    def _alloc(self, rows: int, capacity: int, like=None) -> None:
        for layer in self._layers:
            if like is None:
                layer.kbuf = layer.vbuf = None
            layer.capacity = capacity
            layer.rows = rows

    # -- public API ------------------------------------------------------------------------
    def start(self, prompts: list, group_size: int = 1) -> None:
        """Open ``len(prompts) * group_size`` sessions and prefill each prompt once.

        prompts: P lists of token ids (the common prompt of each env group, non-empty).
        Session s continues prompt s // group_size. Previous sessions are released.
        Raises ValueError for empty prompts or a group_size < 1.
        """
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        self._clear()
        P = len(prompts)
        S = shared_prefix_length(prompts)
        Lp = max(len(p) for p in prompts)
        W = Lp - S  # the rows' own tokens, left-padded after the shared prefix
        dev = self.device
        ids = torch.full((P, W), self.pad_id, dtype=torch.long)
        mask = torch.zeros((P, Lp), dtype=torch.bool)
        pos = torch.zeros((P, Lp), dtype=torch.long)
        tok = torch.full((P, Lp), self.pad_id, dtype=torch.long)
        mask[:, :S] = True
        pos[:, :S] = torch.arange(S)
        if S:
            tok[:, :S] = torch.tensor(prompts[0][:S], dtype=torch.long)
        for g, p in enumerate(prompts):
            n = len(p)
            ids[g, W - (n - S):] = torch.tensor(p[S:], dtype=torch.long)
            mask[g, Lp - (n - S):] = True
            pos[g, Lp - (n - S):] = torch.arange(S, n)
        tok[:, S:] = ids
        with self._inference():
            t0 = self._clock()
            self._alloc(P, Lp)
            self._mask = mask.to(dev)
            self._pos, self._tok = pos.to(dev), tok.to(dev)
            if S:
                # The prefix every prompt shares (the system prompt and the game's rules) is
                # prefilled once, in one row, and its KV copied to every row.
                self._forward(self._tok[:1, :S], self._mask[:1, :S].long(), self._pos[:1, :S], 1, 0)
                with mapped_allocations():
                    for layer in self._layers:
                        layer.kbuf = layer.kbuf.expand(P, -1, -1, -1).contiguous()
                        layer.vbuf = layer.vbuf.expand(P, -1, -1, -1).contiguous()
            logits = self._forward(ids.to(dev), self._mask.long(), self._pos[:, S:], P, S)
            self.stats["prefill_seconds"] += self._clock() - t0
        self._note_kv()
        self._L, self._rows = Lp, P
        self.stats["prefilled_tokens"] += S + sum(len(p) - S for p in prompts)
        self._num_sessions = P * group_size
        for s in range(self._num_sessions):
            g = s // group_size
            self._row_of[s] = g
            self._cached[s] = len(prompts[g])
            self._kept[s] = len(prompts[g])
            self._pending[s] = []
            self._start_logits[s] = logits[g]
            if self._values is not None:
                self._start_values[s] = self._values[g]

    def _compact(self, sessions: list, capacity: int) -> int:
        """Move the sessions' KV rows, holes removed and right-aligned, into fresh buffers of
        `capacity` columns (row i = sessions[i]). Returns the aligned length T."""
        dev = self.device
        R = len(sessions)
        src = torch.tensor([self._row_of[s] for s in sessions], dtype=torch.long, device=dev)
        L = self._L
        m = self._mask[src, :L]
        t = m.sum(1)
        T = int(t.max()) if R else 0
        rank = m.long().cumsum(1) - 1
        target = torch.where(m, (T - t)[:, None] + rank, torch.full_like(rank, T))
        col = torch.zeros((R, T + 1), dtype=torch.long, device=dev)
        col.scatter_(1, target, torch.arange(L, device=dev).expand(R, L).contiguous())
        col = col[:, :T]
        new_mask = torch.zeros((R, capacity), dtype=torch.bool, device=dev)
        new_mask[:, :T] = torch.arange(T, device=dev)[None, :] >= (T - t)[:, None]
        new_pos = torch.zeros((R, capacity), dtype=torch.long, device=dev)
        new_tok = torch.zeros((R, capacity), dtype=torch.long, device=dev)
        if T:
            new_pos[:, :T] = self._pos[src[:, None], col]
            new_tok[:, :T] = self._tok[src[:, None], col]
        for layer in self._layers:
            kb, vb = layer.kbuf, layer.vbuf
            H, D = kb.shape[1], kb.shape[3]
            with mapped_allocations():  # each turn's larger buffers: no holes left in the heap
                nk = kb.new_zeros((R, H, capacity, D))
                nv = vb.new_zeros((R, H, capacity, D))
            if T:
                hi = torch.arange(H, device=dev)[None, :, None]
                nk[:, :, :T] = kb[src[:, None, None], hi, col[:, None, :]]
                nv[:, :, :T] = vb[src[:, None, None], hi, col[:, None, :]]
            layer.kbuf, layer.vbuf, layer.capacity = nk, nv, capacity
        self._mask, self._pos, self._tok = new_mask, new_pos, new_tok
        self._rows = R
        self._note_kv()
        return T

    def _stop_char_mask(self, chars: str):
        """bool [V]: tokens whose text contains one of `chars` (cheap pre-check for stop strings)."""
        if chars not in self._stop_char_masks:
            toks = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self._stop_char_masks[chars] = [t is None or any(c in t for c in chars) for t in toks]
        return self._stop_char_masks[chars]

    def generate(self, sessions: list, append: list | None, params: SamplingParams,
                 generator: torch.Generator | None = None) -> list:
        """Continue `sessions`: append tokens, then sample one response each, batched.

        sessions: distinct open session ids. Sessions not listed are released (their KV
        cache is freed and they cannot be continued). append: one token-id list per session
        (the between-turn template tokens and next observation; may be empty), or None.
        params: SamplingParams. generator: torch.Generator on the model's device (seeded
        for reproducible sampling), or None for the global RNG, or a dict {session id:
        torch.Generator} giving each session its stream (the sessions of one env group share
        one; `sampling.sample_tokens_by_stream`): a session's tokens then do not depend on
        which other sessions share the batch.

        Returns one TurnOutput per session, in order. A session whose length would pass
        params.max_context gets stop_reason "context" and no tokens, and is closed (its
        append is not added). Raises ValueError for unknown or repeated sessions or a length
        mismatch, or an appended token id outside [0, vocabulary size).
        """
        if len(set(sessions)) != len(sessions) or any(s not in self._cached for s in sessions):
            raise ValueError(f"sessions must be distinct open session ids, got {sessions!r:.200}")
        if append is None:
            append = [[] for _ in sessions]
        if len(append) != len(sessions):
            raise ValueError(f"append has {len(append)} entries for {len(sessions)} sessions")
        for s, a in zip(sessions, append):
            bad = [t for t in a if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"append for session {s} holds token ids outside [0, {self.vocab_size}): {bad[:5]}")
        outputs = [TurnOutput([], [], STOP_CONTEXT) for _ in sessions]
        # Sessions that cannot take one more token are answered without computing.
        run = []
        for i, s in enumerate(sessions):
            if self.session_length(s) + len(append[i]) + 1 > params.max_context:
                pass  # the append is refused; the session is unchanged
            else:
                run.append(i)
        keep = [sessions[i] for i in run]
        if run:
            with self._inference():
                self._generate(run, sessions, append, params, generator, outputs)
        # Sessions not listed, and refused ones, are closed; their KV rows are gone.
        self._keep_only(keep)
        return outputs

    def _keep_only(self, sessions) -> None:
        keep = set(sessions)
        for d in (self._cached, self._kept, self._floor, self._pending, self._start_logits, self._start_values,
                  self._row_of):
            for s in [s for s in d if s not in keep]:
                del d[s]

    def _generate(self, run, sessions, append, params, generator, outputs) -> None:
        """One turn of the sessions `run` indexes: feed their pending and appended tokens
        (`_feed`), decode until every row stops (`_decode`), record where each session ends."""
        sess = [sessions[i] for i in run]
        cached, T, n_max, logits, values = self._feed(sess, [append[i] for i in run], params)
        R = len(sess)
        row_out = list(range(R))  # buffer row -> output row
        pos_t = torch.tensor(cached, dtype=torch.long, device=self.device)  # next position per buffer row
        resp, lps, ents, vals, L = self._decode(sess, run, cached, T + n_max, logits, values, params, generator,
                                                outputs, row_out, pos_t)
        for r in range(R):
            o = row_out[r]
            s = sess[o]
            self._row_of[s] = r
            self._kept[s] += int(pos_t[r]) - cached[o]  # fed while decoding (all but the pending token)
            self._cached[s] = int(pos_t[r])
            outputs[run[o]].token_ids = resp[o]
            outputs[run[o]].logprobs = lps[o]
            outputs[run[o]].entropies = ents[o]
            outputs[run[o]].values = vals[o]
        self._L = L
        self._rows = R

    def _feed(self, sess, append, params):
        """Prefill the sessions' pending and appended tokens (skipping evicted ones) into a
        buffer compacted and sized for the turn. Returns (cached lengths, aligned length T,
        longest chunk n_max, the next-token logits [R, V] fp32, the readout values or None);
        a session with nothing to feed starts from the logits kept when it was opened."""
        dev = self.device
        chunks = []
        for a, s in zip(append, sess):
            c = self._pending[s] + list(a)
            skip = min(len(c), max(0, self._floor.get(s, 0) - self._cached[s]))  # evicted before being fed
            self._cached[s] += skip
            chunks.append(c[skip:])
        R = len(sess)
        n = [len(c) for c in chunks]
        n_max = max(n)
        # The turn's longest possible row, so the buffer never grows inside the turn.
        T = max(self._kept[s] for s in sess)  # >= the aligned length (holes removed)
        capacity = T + n_max + params.max_new_tokens
        T = self._compact(sess, capacity)
        cached = [self._cached[s] for s in sess]
        if any(nb == 0 for nb in n) and any(s not in self._start_logits for s, nb in zip(sess, n) if nb == 0):
            raise RuntimeError("a session with nothing to feed has no logits (fastpo engine bug)")
        logits = values = None
        if n_max > 0:
            ids = torch.full((R, n_max), self.pad_id, dtype=torch.long)
            pos = torch.zeros((R, n_max), dtype=torch.long)
            for r, c in enumerate(chunks):
                if c:
                    ids[r, n_max - len(c):] = torch.tensor(c, dtype=torch.long)
                    pos[r, n_max - len(c):] = torch.arange(cached[r], cached[r] + len(c))
            cm = torch.arange(n_max)[None, :] >= (n_max - torch.tensor(n))[:, None]
            self._mask[:, T:T + n_max] = cm.to(dev)
            self._pos[:, T:T + n_max] = pos.to(dev)
            self._tok[:, T:T + n_max] = ids.to(dev)
            t0 = self._clock()
            logits = self._forward(ids.to(dev), self._mask[:, :T + n_max].long(), pos.to(dev), R, T).float()
            self.stats["prefill_seconds"] += self._clock() - t0
            values = self._values
            self.stats["prefilled_tokens"] += sum(n)
        readout = self.readout is not None
        for r, s in enumerate(sess):
            if n[r] == 0:
                row = self._start_logits[s].float()[None]
                logits = row.expand(R, -1).clone() if logits is None else logits
                logits[r] = row[0]
                if readout:
                    v0 = self._start_values.get(s)
                    if v0 is None:
                        raise RuntimeError("readout set after the session started (fastpo engine bug)")
                    values = v0.expand(R).clone() if values is None else values
                    values[r] = v0
            cached[r] += n[r]
            self._kept[s] += n[r]
            self._pending[s] = []
            self._start_logits.pop(s, None)
            self._start_values.pop(s, None)
        return cached, T, n_max, logits, values

    def _decode(self, sess, run, cached, L, logits, values, params, generator, outputs, row_out, pos_t):
        """Sample token by token from `logits` until every row stops (a stop token, a stop
        string, max_new_tokens or the context); a stopped row leaves the live prefix at once
        (`_evict`). `row_out` and `pos_t` are updated in place. Returns the per-row (tokens,
        log-probs, entropies, values) and the buffer length L after the last step."""
        R = len(sess)
        readout = self.readout is not None
        # Per output row limits: max_new_tokens and the context.
        limit = [min(params.max_new_tokens, params.max_context - cached[r]) for r in range(R)]
        stop_ids = set(params.stop_token_ids)
        stop_strs = params.stop_strings
        check = self._stop_char_mask("".join(sorted({s[-1] for s in stop_strs}))) if stop_strs else None
        window = max((len(self.tokenizer.encode(s, add_special_tokens=False)) for s in stop_strs), default=0) + 2
        resp = [[] for _ in range(R)]
        lps = [[] for _ in range(R)]
        ents = [[] for _ in range(R)]
        vals = [[] for _ in range(R)]
        live = R
        t0 = self._clock()
        while live > 0:
            if isinstance(generator, dict):  # one stream per env group (session -> generator)
                keys = [sess[row_out[r]] for r in range(live)]
                tok, lp, ent = sample_tokens_by_stream(logits[:live], params, [generator[k] for k in keys], keys,
                                                       entropy=True)
            else:
                tok, lp, ent = sample_tokens(logits[:live], params, generator, entropy=True)
            tl, ll, el = tok.tolist(), lp.tolist(), ent.tolist()
            vl = values[:live].tolist() if readout else None
            stopped = []
            for r in range(live):
                o = row_out[r]
                t = tl[r]
                resp[o].append(t)
                lps[o].append(ll[r])
                ents[o].append(el[r])
                if vl is not None:
                    vals[o].append(vl[r])
                reason = None
                if t in stop_ids:
                    reason = STOP_EOT
                elif check is not None and (t >= len(check) or check[t]):
                    tail = self.tokenizer.decode(resp[o][-window:])
                    if any(s in tail for s in stop_strs):
                        reason = STOP_STRING
                if reason is None and len(resp[o]) >= limit[o]:
                    reason = STOP_LENGTH if limit[o] == params.max_new_tokens else STOP_CONTEXT
                if reason is not None:
                    outputs[run[o]].stop_reason = reason
                    self._pending[sess[o]] = [t]
                    stopped.append(r)
            self.stats["generated_tokens"] += live
            if stopped:
                live, tok = self._evict(stopped, live, L, row_out, pos_t, tok)
            if live == 0:
                break
            self._mask[:live, L] = True
            self._pos[:live, L] = pos_t[:live]
            self._tok[:live, L] = tok[:live]
            logits = self._forward(tok[:live, None], self._mask[:live, :L + 1].long(), pos_t[:live, None], live, L).float()
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += live
            self.stats["decode_kv_columns"] += live * (L + 1)
            values = self._values
            pos_t[:live] += 1
            L += 1
        self.stats["decode_seconds"] += self._clock() - t0
        return resp, lps, ents, vals, L

    def _evict(self, stopped, live, L, row_out, pos_t, tok):
        """Swap stopped rows behind the live prefix; returns (new live count, reordered tok)."""
        st = set(stopped)
        new_live = live - len(stopped)
        holes = [r for r in stopped if r < new_live]
        movers = [r for r in range(new_live, live) if r not in st]
        if holes:
            a = holes + movers
            b = movers + holes
            ia = torch.tensor(a, dtype=torch.long, device=pos_t.device)
            ib = torch.tensor(b, dtype=torch.long, device=pos_t.device)
            for layer in self._layers:
                layer.kbuf[ia, :, :L] = layer.kbuf[ib, :, :L]
                layer.vbuf[ia, :, :L] = layer.vbuf[ib, :, :L]
            self._mask[ia, :L] = self._mask[ib, :L]
            self._pos[ia, :L] = self._pos[ib, :L]
            self._tok[ia, :L] = self._tok[ib, :L]
            pos_t[ia] = pos_t[ib]
            tok = tok.clone()
            tok[ia] = tok[ib]
            ro = list(row_out)
            for x, y in zip(a, b):
                row_out[x] = ro[y]
        return new_live, tok
