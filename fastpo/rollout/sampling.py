"""Token sampling with temperature, top-k and top-p, and the log-probs the trainer checks.

The log-prob recorded for a sampled token is log softmax(logits / T) of the *full*
vocabulary at the sampling temperature T, the quantity the trainer recomputes (design
convention: temperature scales logits before softmax everywhere). Top-k / top-p only
restrict which tokens can be drawn; they do not renormalise the recorded log-prob (as
verl / RAGEN do), so the on-policy ratio at the first step is exactly 1.
"""
from __future__ import annotations

import dataclasses

import torch

from fastpo.config.schema import TOP_K_RULE, TOP_P_RULE
from fastpo.config.fields import check_fields, checked


@dataclasses.dataclass
class SamplingParams:
    """Per-turn generation settings.

    temperature: > 0 samples from softmax(logits / temperature); 0 means greedy (then the
        recorded log-probs are at temperature 1). top_p in (0, 1]; top_k >= 0 (0 = off).
    max_new_tokens: cap on the response tokens of one turn (>= 1).
    stop_token_ids: a sampled token from this set ends the turn (it is kept in the response).
    stop_strings: the turn ends as soon as the decoded response contains one of these
        (e.g. "</answer>"); the token completing it is kept.
    max_context: a session never grows past this many tokens (prompt + all turns).
    """

    temperature: float = checked(1.0, lambda v: v >= 0, "must be >= 0 (0 = greedy)")
    top_p: float = checked(1.0, TOP_P_RULE.ok, TOP_P_RULE.why)
    top_k: int = checked(0, TOP_K_RULE.ok, TOP_K_RULE.why)
    max_new_tokens: int = checked(128, lambda v: v >= 1, "must be >= 1")
    stop_token_ids: tuple = ()
    stop_strings: tuple = ()
    max_context: int = checked(4096, lambda v: v >= 2, "must be >= 2")

    def __post_init__(self) -> None:
        check_fields(self, "SamplingParams.", what="")  # ValueError (ConfigError) naming the field
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop_strings = tuple(s for s in self.stop_strings if s)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf.

    logits: float [R, V] (already divided by the temperature). Returns a new float [R, V].
    The most likely token always survives.
    """
    out = logits
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


#: Vocabulary block of the two-level inverse-CDF draw (`categorical`): the cumulative sums run
#: over the block masses, then within one block, in float64.
CDF_BLOCK = 256


def categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of the categorical distribution `probs` by its inverse CDF, given one
    uniform number per row: token = the first index whose cumulative probability exceeds
    u * (the row's total). Two levels (block masses of `CDF_BLOCK` tokens, then one block) in
    float64, so that every token's interval has its probability's width to about 1e-16 and a
    token of probability 0 (filtered or underflowed) is never drawn.

    probs: float [R, V], >= 0, each row with a positive sum (normalised or not).
    uniforms: float64 [R] in [0, 1), on probs' device. Returns int64 [R].
    Raises ValueError naming the rows whose sum is not finite and positive (NaN or inf).
    The same distribution as torch.multinomial(probs, 1), which draws V exponentials per row
    (the "exponential race"); this draws one number per row and reads probs twice.
    """
    R, V = probs.shape
    nb = -(-V // CDF_BLOCK)
    if nb * CDF_BLOCK != V:
        probs = torch.nn.functional.pad(probs, (0, nb * CDF_BLOCK - V))
    blocks = probs.reshape(R, nb, CDF_BLOCK)
    zero = torch.zeros((), dtype=torch.float64, device=probs.device)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [R, nb]
    total = block_cdf[:, -1:]
    bad = ~(torch.isfinite(total) & (total > 0))[:, 0]
    if bool(bad.any()):  # (torch.multinomial refused these too; the search would index past the end)
        rows = bad.nonzero()[:, 0].tolist()
        raise ValueError(f"sampling: row(s) {rows[:8]} of {R} have no finite positive probability mass "
                         "(non-finite logits, e.g. a diverged model)")
    # strictly below the total, so that the search stops at a token of positive probability
    target = torch.minimum(uniforms.to(torch.float64)[:, None] * total, torch.nextafter(total, zero))
    b = torch.searchsorted(block_cdf, target, right=True)  # [R, 1]: the block holding the target
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp_min(0)), zero)
    inner = blocks.gather(1, b[:, :, None].expand(R, 1, CDF_BLOCK))[:, 0].cumsum(-1, dtype=torch.float64)
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1:], zero))
    return (b * CDF_BLOCK + torch.searchsorted(inner, rest, right=True))[:, 0]


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                  entropy: bool = False, uniforms: torch.Tensor | None = None):
    """Draw one token per row and return its fp32 log-prob at the sampling temperature.

    logits: [R, V] any float dtype. Returns (tokens int64 [R], logprobs float32 [R]), both on
    logits' device; with `entropy=True` also the fp32 entropy [R] (nats) of the full
    distribution softmax(logits / T) the log-prob is taken from (T = 1 when greedy), the
    quantity the trainer's `linear_logprob_entropy` computes. A row's draw is `categorical`
    with one uniform number from `generator` (rows in order), or from `uniforms` (float64
    [R]) when given. Deterministic for a given generator state (CPU and CUDA).
    """
    x = logits.float()
    if params.temperature == 0:
        logp = torch.log_softmax(x, dim=-1)
        tok = torch.argmax(x, dim=-1)
        probs = None
    else:
        x = x / params.temperature
        logp = torch.log_softmax(x, dim=-1)
        if params.top_k or params.top_p < 1.0:
            probs = torch.softmax(filter_logits(x, params.top_k, params.top_p), dim=-1)
        else:
            probs = logp.exp()
        if uniforms is None:
            uniforms = torch.rand(x.shape[0], generator=generator, dtype=torch.float64, device=x.device)
        tok = categorical(probs, uniforms)
    lp = logp.gather(1, tok[:, None])[:, 0]
    if not entropy:
        return tok, lp
    full = logp.exp() if probs is None or params.top_k or params.top_p < 1.0 else probs
    # -sum p log p with 0 * log 0 = 0 (log_softmax gives -inf where p underflows)
    ent = -(full * torch.where(full > 0, logp, torch.zeros_like(logp))).sum(-1)
    return tok, lp, ent


def sample_tokens_by_stream(logits: torch.Tensor, params: SamplingParams, streams: list, keys: list,
                            entropy: bool = False):
    """`sample_tokens` with one random stream per set of rows: row r draws from generator
    `streams[r]`; the rows sharing a generator (an env group's trajectories) are sampled
    together in the order of their `keys` (session ids), generators taken in the order of
    their smallest key. A row's draw then depends only on its own stream's rows, not on
    which other rows share the batch, so an env group samples the same tokens whatever
    other groups (or processes) there are. logits: [R, V]; streams, keys: R entries.
    Returns what `sample_tokens` returns, rows in the input order."""
    R = logits.shape[0]
    rows_of: dict = {}
    for r in sorted(range(R), key=lambda r: keys[r]):
        rows_of.setdefault(id(streams[r]), []).append(r)
    uniforms = None
    if params.temperature != 0:
        uniforms = torch.empty(R, dtype=torch.float64, device=logits.device)
        for rows in rows_of.values():
            g = streams[rows[0]]
            uniforms[rows] = torch.rand(len(rows), generator=g, dtype=torch.float64,
                                        device=g.device if g is not None else logits.device).to(logits.device)
    return sample_tokens(logits, params, entropy=entropy, uniforms=uniforms)
