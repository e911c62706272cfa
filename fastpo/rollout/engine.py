"""fastpo's native generation engine: a transformers model driven by its own batched sampler.

What it does that ``model.generate`` in a per-turn loop does not:

- Sessions. ``start(prompts, group_size)`` opens ``P * group_size`` sessions; session ``s``
  belongs to env group ``s // group_size``. The prefix that all the groups' prompts share
  (system prompt, game rules) is prefilled once for all of them, then each group's own rest
  of its prompt once for the group's sessions.
- KV cache kept across turns, and memory that follows the tokens held (`PagedKVCache`,
  fastpo/rollout/kv_cache.py): each session's keys and values are blocks of 16 tokens taken
  as its tokens arrive; the shared prefix and each group's prompt are held once, their blocks
  shared by every session that starts with them; the blocks of a session that ends (not
  listed in the next ``generate``) go back to the free list before that call feeds anything.
  ``generate(sessions, append, params)`` feeds only the tokens appended since the session's
  last forward (the end of the previous response and the between-turn template tokens),
  then decodes. Nothing is re-prefilled.
- Batched decoding with per-sequence stop: a row that samples a stop token, completes a
  stop string, hits ``max_new_tokens`` or the context limit leaves the batch at once, so
  later steps do not compute for it.

Forwards. Each forward packs the new tokens of its sessions into one row, back to back with
their true position ids (no padding), and the model attends through the cache
(`kv_cache.paged_attention`): a decode step's one token per session reads that session's
blocks (on the CPU with the compiled `fastpo.kernels.cpu_attention.paged_decode`), a prefill
attends session by session. The decode batch keeps its rows in the order the sampler's random
draws assign them: a row that stops is swapped with the last live row, as the engine's
earlier dense buffer did, so a seed draws the same tokens.

Eviction (bounded context windows, rollout.context_window = K). ``evict(session, lo, hi)``
drops the KV entries of the session's tokens at positions [lo, hi) (the later entries move
down within the session's blocks), and tokens in that range not fed yet (the pending last
token of a response, the head of the next append) are skipped, never fed. Kept tokens keep
their positions (RoPE positions are never shifted), so the trainer reproduces the sampler's
context with the trajectory's own position ids and a per-turn attention mask
(fastpo/rollout/window.py). ``rewind(session, length)`` drops everything from position
`length` on and feeds the next append from that position (re-prefilling a window with fresh
positions; the benchmark's baseline). ``session_context`` gives each entry's position and
token id; ``stats["peak_kv_bytes"]`` records the most KV memory held and
``stats["peak_kv_token_bytes"]`` the most bytes of the tokens held at one moment.

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

import bisect
import contextlib
import dataclasses
import time

import torch

from .kv_cache import BLOCK, PagedKVCache, attention_switched, shared_prefix_length, unsupported_attention
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
        tokenizer: its tokenizer (for stop-string checks).
    Raises ValueError for a model whose layers are not all full attention (sliding window,
    chunked or linear attention; see `unsupported_attention`).

    Counters (cumulative, reset with ``reset_stats()``): ``stats["prefilled_tokens"]``
    (real tokens fed in prefill forwards), ``stats["generated_tokens"]`` (sampled tokens),
    ``stats["forward_passes"]``, ``stats["seconds"]``; where the time goes, for comparing
    with the machine's limits (bench/limits.py): ``stats["prefill_seconds"]`` (the prefill
    forwards), ``stats["decode_seconds"]`` (the decode loops: sampling, stop checks and the
    one-token forwards), ``stats["decode_steps"]`` (one-token forwards),
    ``stats["decode_rows"]`` (rows summed over those forwards) and
    ``stats["decode_kv_columns"]`` (KV entries each forward reads, summed over its rows: each
    row's tokens held; a layer's K and V of one entry are 2 x KV heads x head dim values).
    Memory (bytes): ``stats["peak_kv_bytes"]``, the most KV memory the cache held (its pools);
    ``stats["peak_kv_token_bytes"]``, the most bytes of distinct tokens it held at one moment
    (a shared prompt counted once): what a cache without any slack would need.

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
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
        self.cache = PagedKVCache(self.num_layers, int(getattr(cfg, "num_key_value_heads", None) or heads),
                                  int(head_dim))
        self._stop_char_masks: dict = {}
        self.readout = None
        self._hidden = None  # the LM head's input of the last forward, while a readout is set
        self._values = None  # the readout of the last forward [rows], or None
        self.reset_stats()
        self._clear()

    # -- bookkeeping -----------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the token, time and memory counters."""
        self.cache.reset_stats()
        self.stats = {"prefilled_tokens": 0, "generated_tokens": 0, "forward_passes": 0, "seconds": 0.0,
                      "peak_kv_bytes": 0, "peak_kv_token_bytes": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0,
                      "decode_steps": 0, "decode_rows": 0, "decode_kv_columns": 0}
        self._note_kv()

    def _note_kv(self) -> None:
        for key in ("peak_kv_bytes", "peak_kv_token_bytes"):
            self.stats[key] = max(self.stats[key], self.cache.stats[key])

    def _clock(self) -> float:
        """perf_counter after the device's queued work (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _clear(self) -> None:
        self.cache.reset()
        self._seq: dict = {}  # session -> its sequence in the cache
        self._ctx_tok: dict = {}  # session -> token ids of its KV entries, in order
        self._ctx_pos: dict = {}  # session -> their positions (ascending)
        self._cached: dict = {}  # session -> next position (tokens fed or skipped so far)
        self._floor: dict = {}  # session -> positions below this are evicted: not fed when pending
        self._pending: dict = {}  # session -> tokens not yet fed (the last sampled token)
        self._start_logits: dict = {}  # session -> logits [V] after the shared prompt prefill
        self._start_values: dict = {}  # session -> readout after the shared prompt prefill (readout set)

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
        return list(self._ctx_tok[session]), list(self._ctx_pos[session])

    def evict(self, session: int, lo: int, hi: int) -> None:
        """Drop `session`'s tokens at positions [lo, hi) from its context (see module docstring).

        Entries already in the KV cache are removed; tokens in the range that are not fed
        yet (pending, or the head of the next append) will be skipped. Positions of the other
        tokens do not change. Raises ValueError for an unknown session or lo > hi.
        """
        if session not in self._cached:
            raise ValueError(f"session {session!r} is not open")
        if session in self._start_logits:  # it holds only its group's shared prompt
            raise ValueError(f"session {session!r} has not generated yet; nothing of its own to drop")
        if not 0 <= lo <= hi:
            raise ValueError(f"evict needs 0 <= lo <= hi, got lo={lo!r}, hi={hi!r}")
        pos = self._ctx_pos[session]
        i, j = bisect.bisect_left(pos, lo), bisect.bisect_left(pos, hi)
        if i < j:
            self.cache.remove(self._seq[session], i, j)
            del self._ctx_tok[session][i:j], pos[i:j]
        self._floor[session] = max(self._floor.get(session, 0), hi)

    def rewind(self, session: int, length: int) -> None:
        """Drop `session`'s tokens at positions >= `length` and its pending token; the next
        append is fed from position `length` on (fresh positions). Raises ValueError for an
        unknown session or a length outside [1, session_length]."""
        if session not in self._cached:
            raise ValueError(f"session {session!r} is not open")
        if session in self._start_logits:  # it holds only its group's shared prompt
            raise ValueError(f"session {session!r} has not generated yet; nothing of its own to drop")
        if not 1 <= length <= self.session_length(session):
            raise ValueError(f"rewind length must be in [1, {self.session_length(session)}], got {length!r}")
        pos = self._ctx_pos[session]
        i = bisect.bisect_left(pos, length)
        self.cache.truncate(self._seq[session], i)
        del self._ctx_tok[session][i:], pos[i:]
        self._cached[session] = length
        self._pending[session] = []
        self._floor.pop(session, None)
        self._start_logits.pop(session, None)
        self._start_values.pop(session, None)

    @contextlib.contextmanager
    def _inference(self):
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), attention_switched(self.model):
                yield
        finally:
            self.model.train(was_training)
            self.stats["seconds"] += time.perf_counter() - t0

    def _forward(self, seqs: list, ids: torch.Tensor, pos: torch.Tensor, counts: list, spare: int = 0):
        """One forward of the new tokens of cache sequences `seqs`: counts[i] tokens each, packed
        in `ids` / `pos` (int64 [N], sequence by sequence; positions are the tokens' true
        ones). `spare`: blocks to keep free for the decoding that follows (`PagedKVCache.plan`).
        Returns the fp32 logits [R, V] at each sequence's last new token (and sets
        ``self._values`` [R] fp32 from the readout, or None)."""
        dev = self.device
        step = self.cache.plan(seqs, counts, spare, dev)
        keep = 0 if step.decode else torch.tensor(step.offsets[1:], device=dev) - 1  # 0: every token's logits
        hook = None
        if self.readout is not None:
            def grab(_module, args):
                self._hidden = args[0][0]

            hook = self.model.get_output_embeddings().register_forward_pre_hook(grab)
        try:
            out = self.model(input_ids=ids.to(dev)[None], position_ids=pos.to(dev)[None], use_cache=False,
                             logits_to_keep=keep, fastpo_kv=(self.cache, step))
        finally:
            if hook is not None:
                hook.remove()
        self._values = None
        if hook is not None:
            self._values = self.readout(self._hidden).float().reshape(len(seqs))
            self._hidden = None
        self.stats["forward_passes"] += 1
        self._note_kv()  # (the first forward allocates the pools)
        return out.logits[0].float()

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
        with self._inference():
            t0 = self._clock()
            if S:
                # The prefix every prompt shares (the system prompt and the game's rules) is
                # prefilled once, and its blocks are shared by every group.
                root = self.cache.new()
                self._forward([root], torch.tensor(prompts[0][:S]), torch.arange(S), [S])
                groups = [self.cache.fork(root) for _ in range(P)]
                self.cache.free(root)
            else:
                groups = [self.cache.new() for _ in range(P)]
            ids = torch.tensor([t for p in prompts for t in p[S:]], dtype=torch.long)
            pos = torch.cat([torch.arange(S, len(p)) for p in prompts])
            logits = self._forward(groups, ids, pos, [len(p) - S for p in prompts])
            self.stats["prefill_seconds"] += self._clock() - t0
        self.stats["prefilled_tokens"] += S + sum(len(p) - S for p in prompts)
        for s in range(P * group_size):
            g = s // group_size
            self._seq[s] = self.cache.fork(groups[g])
            self._ctx_tok[s] = list(prompts[g])
            self._ctx_pos[s] = list(range(len(prompts[g])))
            self._cached[s] = len(prompts[g])
            self._pending[s] = []
            self._start_logits[s] = logits[g]
            if self._values is not None:
                self._start_values[s] = self._values[g]
        for seq in groups:  # the sessions hold the groups' blocks now
            self.cache.free(seq)

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
        cache is freed before anything is fed, and they cannot be continued). append: one
        token-id list per session (the between-turn template tokens and next observation;
        may be empty), or None. params: SamplingParams. generator: torch.Generator on the
        model's device (seeded for reproducible sampling), or None for the global RNG, or a
        dict {session id: torch.Generator} giving each session its stream (the sessions of one
        env group share one; `sampling.sample_tokens_by_stream`): a session's tokens then do
        not depend on which other sessions share the batch.

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
        run = [i for i, s in enumerate(sessions) if self.session_length(s) + len(append[i]) + 1 <= params.max_context]
        # Sessions not listed, and refused ones, are closed now: their blocks serve this turn.
        self._keep_only([sessions[i] for i in run])
        if run:
            with self._inference():
                self._generate(run, sessions, append, params, generator, outputs)
        return outputs

    def _keep_only(self, sessions) -> None:
        keep = set(sessions)
        for s in [s for s in self._seq if s not in keep]:
            self.cache.free(self._seq.pop(s))
        for d in (self._ctx_tok, self._ctx_pos, self._cached, self._floor, self._pending, self._start_logits,
                  self._start_values):
            for s in [s for s in d if s not in keep]:
                del d[s]

    def _generate(self, run, sessions, append, params, generator, outputs) -> None:
        """One turn of the sessions `run` indexes: feed their pending and appended tokens
        (`_feed`), decode until every row stops (`_decode`), record where each session ends."""
        sess = [sessions[i] for i in run]
        cached, logits, values = self._feed(sess, [append[i] for i in run], params)
        R = len(sess)
        row_out = list(range(R))  # decode batch row -> output row
        pos_t = torch.tensor(cached, dtype=torch.long)  # next position per batch row
        resp, lps, ents, vals = self._decode(sess, run, cached, logits, values, params, generator, outputs, row_out,
                                             pos_t)
        for r in range(R):
            o = row_out[r]
            s = sess[o]
            fed = resp[o][:-1]  # every sampled token but the pending last one went through a forward
            self._ctx_tok[s].extend(fed)
            self._ctx_pos[s].extend(range(cached[o], cached[o] + len(fed)))
            self._cached[s] = int(pos_t[r])
            outputs[run[o]].token_ids = resp[o]
            outputs[run[o]].logprobs = lps[o]
            outputs[run[o]].entropies = ents[o]
            outputs[run[o]].values = vals[o]

    def _feed(self, sess, append, params):
        """Prefill the sessions' pending and appended tokens (skipping evicted ones) in one
        forward. Returns (each session's next position, the next-token logits [R, V] fp32,
        the readout values [R] or None); a session with nothing to feed starts from the
        logits kept when it was opened."""
        chunks = []
        for a, s in zip(append, sess):
            c = self._pending[s] + list(a)
            skip = min(len(c), max(0, self._floor.get(s, 0) - self._cached[s]))  # evicted before being fed
            self._cached[s] += skip
            chunks.append(c[skip:])
        R = len(sess)
        fed = [r for r in range(R) if chunks[r]]
        if len(fed) < R and any(sess[r] not in self._start_logits for r in range(R) if not chunks[r]):
            raise RuntimeError("a session with nothing to feed has no logits (fastpo engine bug)")
        logits = values = None
        if fed:
            # blocks kept free for this turn's decoding (up to 4 blocks a row), so that its
            # steps do not each grow the pools
            spare = R * (min(-(-params.max_new_tokens // BLOCK), 4) + 1)
            ids = torch.tensor([t for r in fed for t in chunks[r]], dtype=torch.long)
            pos = torch.cat([torch.arange(self._cached[sess[r]], self._cached[sess[r]] + len(chunks[r])) for r in fed])
            t0 = self._clock()
            out = self._forward([self._seq[sess[r]] for r in fed], ids, pos, [len(chunks[r]) for r in fed], spare)
            self.stats["prefill_seconds"] += self._clock() - t0
            self.stats["prefilled_tokens"] += int(ids.numel())
            logits = out.new_empty((R, out.shape[1]))
            logits[fed] = out
            if self._values is not None:
                values = self._values.new_empty(R)
                values[fed] = self._values
        readout = self.readout is not None
        for r, s in enumerate(sess):
            if not chunks[r]:
                row = self._start_logits[s].float()
                logits = row.expand(R, -1).clone() if logits is None else logits
                logits[r] = row
                if readout:
                    v0 = self._start_values.get(s)
                    if v0 is None:
                        raise RuntimeError("readout set after the session started (fastpo engine bug)")
                    values = v0.expand(R).clone() if values is None else values
                    values[r] = v0
            else:
                self._ctx_tok[s].extend(chunks[r])
                self._ctx_pos[s].extend(range(self._cached[s], self._cached[s] + len(chunks[r])))
            self._cached[s] += len(chunks[r])
            self._pending[s] = []
            self._start_logits.pop(s, None)
            self._start_values.pop(s, None)
        return [self._cached[s] for s in sess], logits, values

    def _decode(self, sess, run, cached, logits, values, params, generator, outputs, row_out, pos_t):
        """Sample token by token from `logits` until every row stops (a stop token, a stop
        string, max_new_tokens or the context); a stopped row leaves the live prefix of the
        batch at once (`_evict`). `row_out` and `pos_t` are updated in place. Returns the
        per-row (tokens, log-probs, entropies, values)."""
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
            tok = tok.cpu()
            if stopped:
                live, tok = self._evict(stopped, live, row_out, pos_t, tok)
            if live == 0:
                break
            seqs = [self._seq[sess[row_out[r]]] for r in range(live)]
            logits = self._forward(seqs, tok[:live], pos_t[:live], [1] * live)
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += live
            self.stats["decode_kv_columns"] += sum(self.cache.length(q) for q in seqs)
            values = self._values
            pos_t[:live] += 1
        self.stats["decode_seconds"] += self._clock() - t0
        return resp, lps, ents, vals

    @staticmethod
    def _evict(stopped, live, row_out, pos_t, tok):
        """Swap stopped rows behind the live prefix; returns (new live count, reordered tok).
        (Rows keep the order the sampler's draws are assigned in: a stopped row is swapped with
        the last live one.)"""
        st = set(stopped)
        new_live = live - len(stopped)
        holes = [r for r in stopped if r < new_live]
        movers = [r for r in range(new_live, live) if r not in st]
        if holes:
            a = holes + movers
            b = movers + holes
            ia = torch.tensor(a, dtype=torch.long)
            ib = torch.tensor(b, dtype=torch.long)
            pos_t[ia] = pos_t[ib]
            tok = tok.clone()
            tok[ia] = tok[ib]
            ro = list(row_out)
            for x, y in zip(a, b):
                row_out[x] = ro[y]
        return new_live, tok
