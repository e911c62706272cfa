"""How far fastpo is from the machine's own limits, measured in the same process as the
figures they divide (issue 28): `limit_records` after a `Trainer.iteration` (bench/part_e2e.py).

Three fractions, each a `Record` (fastpo's figure against the limit, ratio > 1 never expected):

* **update**: the FLOPs the update actually computes, over its time (`time/update_s`), against
  the GEMM FLOP/s measured here at the model's MLP shapes (`part_kernels.bare_matmuls`: the
  forward, d input and d weight products of a [tokens, hidden] x [hidden, intermediate]
  layer; target 70%). Computed FLOPs count the tokens that go through the model after
  prefix sharing (an env group's prompt once per micro-batch): forward = 2 x (the decoder
  layers' matmul weights) per token + 4 x (heads x head dim) per attended (query, key) pair
  per layer + 2 x hidden x vocab per trained token (the LM head runs on trained tokens
  only); forward + backward = 3 x forward ("model FLOPs"). Gradient checkpointing
  (`model.gradient_checkpointing`, the CPU preset) recomputes the decoder's forward in the
  backward: not in the fraction, given in the notes ("with the recompute"). The effective
  rate counts every trajectory token (a shared prompt once per trajectory, as
  `perf/train_tokens_per_s` does) at the same FLOPs per token: a separate record.
* **decode**: the engine's seconds per decode step (its decode loops' time over their
  one-token forwards, from `NativeEngine.stats`), against (a) a bare transformers forward of
  one token per row with a `DynamicCache`, at the rollout's mean live rows and mean context
  (no target) and (b) the time to read the weights and the live KV cache once at the memory
  bandwidth measured here (a large tensor copy: bytes read + written over its best time;
  target: within 1.2x).
* **prefill**: the engine's prefill FLOP/s (its prefilled tokens x the decoder's forward
  FLOPs per token, attention at half the rollout's mean context, over its prefill time)
  against the same GEMM FLOP/s; its tokens/s in the notes.

On CUDA the GEMMs are bf16 (the trainer's autocast), on the CPU fp32 (the model's dtype).
"""
from __future__ import annotations

import statistics
import time

import torch

from _common import Record, timings
from part_kernels import bare_matmuls

PART = "e2e"


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_shapes(model, compute_bytes: int | None = None) -> dict:
    """Shapes of a transformers causal LM (Llama/Qwen-style): hidden, layers, heads, head dim,
    KV heads, intermediate, vocab (ints); `layer_matmul_params` (the decoder layers' 2-D
    weights: attention and MLP projections), `weight_bytes` (every parameter, tied ones once)
    and `kv_bytes_per_token` (K and V of one token in all layers), both at `compute_bytes` per
    value (default: the parameters' own size; 2 under bf16 autocast, whose weight casts a
    rollout reuses across its forwards)."""
    cfg = _text_config(model)
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    layers = int(cfg.num_hidden_layers)
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    matmul = sum(p.numel() for n, p in body.named_parameters() if ".layers." in f".{n}" and p.dim() == 2)
    dtype_bytes = compute_bytes or next(model.parameters()).element_size()
    seen, weight_bytes = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weight_bytes += p.numel() * dtype_bytes
    return dict(hidden=hidden, heads=heads, head_dim=head_dim, kv_heads=kv_heads, layers=layers,
                intermediate=int(getattr(cfg, "intermediate_size", 4 * hidden)), vocab=int(cfg.vocab_size),
                layer_matmul_params=int(matmul), weight_bytes=int(weight_bytes),
                kv_bytes_per_token=2 * layers * kv_heads * head_dim * dtype_bytes)


def forward_flops(shapes: dict, tokens: float, attention_pairs: float, head_tokens: float) -> tuple[float, float]:
    """(decoder FLOPs, LM head FLOPs) of one forward: 2 x layer matmul weights per token,
    4 x heads x head dim per (query, key) pair per layer (QK^T and the weighted sum of V), and
    2 x hidden x vocab per token through the LM head."""
    body = 2.0 * shapes["layer_matmul_params"] * tokens \
        + 4.0 * shapes["layers"] * shapes["heads"] * shapes["head_dim"] * attention_pairs
    return body, 2.0 * shapes["hidden"] * shapes["vocab"] * head_tokens


def attention_pairs(micro) -> int:
    """(query, key) pairs a packed micro-batch (`fastpo.packing.PackedBatch`) attends: per
    segment causal over its own S rows plus all P rows of its shared prefix (S(S+1)/2 + S P);
    without segments ("mask"/"varlen" attention) each member causal over its own length."""
    if micro.segments:
        return sum((e - s) * (e - s + 1) // 2 + (e - s) * (pe - ps) for s, e, ps, pe in micro.segments)
    return sum(m.length * (m.length + 1) // 2 for m in micro.members)


class UpdateSpy:
    """Counts what the trainer's update computes: wraps its updater's `update` and, while it
    runs, its log-prob computer's `micro_batches` (the packed micro-batches the update's forwards and backwards
    take). Reset by every update. Fields: computed (tokens through the model), trajectory
    (trajectory tokens, a shared prefix once per member), pairs (attended pairs), scored
    (trained tokens: the LM head's rows), micro (micro-batches), max_tokens (the largest)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._active = False
        self._reset()
        updater, logprobs = trainer.parts.updater, trainer.parts.logprobs
        update, micro_batches = updater.update, logprobs.micro_batches

        def spy_update(*a, **k):
            self._reset()
            self._active = True
            try:
                return update(*a, **k)
            finally:
                self._active = False

        def spy_micro(batch, indices, *a, **k):
            for mb in micro_batches(batch, indices, *a, **k):
                if self._active:
                    self.computed += mb.num_tokens
                    self.trajectory += mb.trajectory_tokens
                    self.pairs += attention_pairs(mb)
                    self.scored += sum(int(torch.as_tensor(batch.loss_mask[m.index])[1:].sum()) for m in mb.members)
                    self.micro += 1
                    self.max_tokens = max(self.max_tokens, mb.num_tokens)
                yield mb

        updater.update, logprobs.micro_batches = spy_update, spy_micro

    def _reset(self):
        self.computed = self.trajectory = self.pairs = self.scored = self.micro = self.max_tokens = 0


def gemm_flops(shapes: dict, tokens: int, device: str, repeats: int = 3) -> tuple[float, str]:
    """(FLOP/s, what) of the model's MLP matmuls at `tokens` rows: `part_kernels.bare_matmuls`
    (forward, d input, d weight; on CUDA also the recompute) of [tokens, hidden] x
    [hidden, intermediate], best of `repeats` after a warm-up (bf16 on CUDA, fp32 on the CPU)."""
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    n, h, i = max(1, tokens), shapes["hidden"], shapes["intermediate"]
    run, flops = bare_matmuls(n, h, i, dtype, device)
    best = min(timings(run, max(1, repeats), sync=torch.cuda.synchronize if cuda else None))
    what = f"{'bf16' if cuda else 'fp32'} torch.mm x{4 if cuda else 3} at [{n}, {h}] x [{h}, {i}], best of {repeats}"
    return flops / best, what


def memory_bandwidth(device: str, nbytes: int | None = None, repeats: int = 3) -> float:
    """Bytes/s of a large tensor copy (`dst.copy_(src)`: each byte read once and written once,
    2 x nbytes moved), best of `repeats` after a warm-up. Default size 256 MiB on the CPU
    (well beyond its caches), 2 GiB on CUDA."""
    cuda = device.startswith("cuda")
    nbytes = nbytes or (2 << 30 if cuda else 256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = min(timings(lambda: dst.copy_(src), max(1, repeats), sync=torch.cuda.synchronize if cuda else None))
    return 2.0 * src.numel() * 4 / best


@torch.no_grad()
def bare_decode_step(model, rows: int, context: int, steps: int = 4, seed: int = 0, autocast=None) -> float:
    """Median seconds of a plain transformers forward of one token per row with a
    `DynamicCache` holding `context` tokens per row (random ids; `steps` timed steps after one
    untimed), inside `autocast()` when given (the trainer's bf16 autocast on CUDA)."""
    import contextlib

    from transformers import DynamicCache

    from fastpo.rollout.kv_cache import cache_kwarg

    kw = cache_kwarg(model)  # the forward's cache keyword in this transformers version
    dev = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    rows, context = max(1, int(rows)), max(1, int(context))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    was = model.training
    model.eval()
    try:
        with (autocast or contextlib.nullcontext)():
            cache = DynamicCache()
            ids = torch.randint(0, vocab, (rows, context), generator=g).to(dev)
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
            tok = torch.randint(0, vocab, (rows, 1), generator=g).to(dev)
            times = []
            for step in range(steps + 1):
                sync()
                t0 = time.perf_counter()
                out = model(input_ids=tok, use_cache=True, logits_to_keep=1, **{kw: cache})
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                sync()
                if step:
                    times.append(time.perf_counter() - t0)
            del cache
        return statistics.median(times)
    finally:
        model.train(was)


def limit_records(trainer, spy: UpdateSpy, update_s: float, device: str, label: str) -> list[Record]:
    """The three limit fractions of one `trainer.iteration` (its update measured by `spy`,
    taking `update_s` seconds; its rollout by the engine's stats), with the GEMM FLOP/s, the
    memory bandwidth and the bare decode forward measured now. Needs the native engine (an
    SGLang engine has no decode counters: its decode records are left out)."""
    model = trainer.model
    # the trainer's bf16 autocast (CUDA): the rollout's weights and KV cache are 2-byte values
    autocast = trainer.parts.models.autocast if trainer.parts.models.autocast_bf16 else None
    sh = model_shapes(model, 2 if autocast is not None else None)
    gemm, gemm_how = gemm_flops(sh, spy.max_tokens or 512, device)
    bw = memory_bandwidth(device)
    ckpt = bool(getattr(trainer.cfg.model, "gradient_checkpointing", False))
    body, head = forward_flops(sh, spy.computed, spy.pairs, spy.scored)
    model_flops = 3.0 * (body + head)
    with_recompute = model_flops + (body if ckpt else 0.0)
    per_token = model_flops / max(1, spy.computed)
    rate = model_flops / update_s
    eff = spy.trajectory * per_token / update_s
    gemm_note = f"GEMM {gemm / 1e9:.1f} GFLOP/s ({gemm_how}), measured after the iteration in the same process"
    upd_note = (f"{label}; update {update_s:.2f} s, {spy.micro} micro-batches, {spy.computed} tokens computed "
                f"(after prefix sharing) of {spy.trajectory} trajectory tokens, {spy.scored} through the LM head, "
                f"{spy.pairs} attended pairs; model FLOPs (fwd + bwd = 3 x fwd) {model_flops / 1e9:.1f} G")
    upd_note += (f"; with the gradient-checkpointing recompute {with_recompute / 1e9:.1f} G = "
                 f"{with_recompute / update_s / gemm:.0%} of GEMM" if ckpt else "; no gradient checkpointing")
    recs = [
        Record(PART, "limit: update FLOP/s, computed tokens (fwd + bwd after prefix sharing)", "GFLOP/s",
               rate / 1e9, gemm / 1e9, True, baseline_name="GEMM FLOP/s at the model's MLP shapes", target=0.7,
               notes=f"{upd_note}; {gemm_note}"),
        Record(PART, "limit: update FLOP/s, effective (every trajectory token)", "GFLOP/s", eff / 1e9, gemm / 1e9,
               True, baseline_name="GEMM FLOP/s at the model's MLP shapes",
               notes=f"every trajectory token at {per_token / 1e9:.3f} GFLOP each; {upd_note}; {gemm_note}"),
    ]
    st = getattr(trainer.parts.sampler.engine, "stats", {})
    if st.get("decode_steps"):
        step_s = st["decode_seconds"] / st["decode_steps"]
        rows = st["decode_rows"] / st["decode_steps"]
        ctx = st["decode_kv_columns"] / max(1, st["decode_rows"])
        kv = st["decode_kv_columns"] / st["decode_steps"] * sh["kv_bytes_per_token"]
        read_s = (sh["weight_bytes"] + kv) / bw
        bare = bare_decode_step(model, round(rows), round(ctx), autocast=autocast)
        dec_note = (f"{label}; {st['decode_steps']} decode steps, mean {rows:.1f} live rows at a mean context of "
                    f"{ctx:.0f} tokens; engine step = its decode loops' time (sampling and stop checks included) over "
                    f"their one-token forwards")
        recs += [
            Record(PART, "limit: decode seconds per step", "s", step_s, bare, False,
                   baseline_name=f"bare transformers forward, DynamicCache, {round(rows)} rows x {round(ctx)} context",
                   notes=dec_note),
            Record(PART, "limit: decode seconds per step, weights + live KV read once", "s", step_s, read_s, False,
                   baseline_name="memory-bandwidth time", target=1 / 1.2,
                   notes=f"{dec_note}; weights {sh['weight_bytes'] / 2**20:.0f} MiB + mean KV {kv / 2**20:.1f} MiB "
                         f"at {bw / 1e9:.1f} GB/s (tensor copy, same process)"),
        ]
    if st.get("prefill_seconds") and st.get("prefilled_tokens"):
        toks = st["prefilled_tokens"]
        # attention at the rollout's mean context (the KV columns per decoded row) for every prefilled token
        ctx = st["decode_kv_columns"] / max(1, st["decode_rows"]) if st.get("decode_rows") else 0.0
        body_p, _ = forward_flops(sh, toks, toks * ctx / 2, 0)
        rate_p = body_p / st["prefill_seconds"]
        recs.append(Record(PART, "limit: prefill FLOP/s", "GFLOP/s", rate_p / 1e9, gemm / 1e9, True,
                           baseline_name="GEMM FLOP/s at the model's MLP shapes",
                           notes=f"{label}; {toks} tokens prefilled in {st['prefill_seconds']:.2f} s = "
                                 f"{toks / st['prefill_seconds']:.0f} tokens/s; the decoder's forward FLOPs (attention "
                                 f"at half the rollout's mean context; the LM head's one row per sequence left out); "
                                 f"{gemm_note}"))
    return recs
