"""Mutual-information collapse metrics: does the reasoning still vary, and does it still depend on the state?

RAGEN's follow-up work (its repository's head: `docs/reference_mutual_information_metrics.md`,
`ragen/trainer/collapse_metrics.py`; arXiv 2604.06268) separates two collapses the paper's
Echo Trap lumps together:

- *entropy collapse*: for a given state the reasoning stops varying, H(Z|X) -> 0;
- *template collapse*: the reasoning stops depending on the state (the same text whatever
  the prompt), I(X;Z) -> 0, while it may still vary a lot.

X is the first turn's prompt (system prompt, rules, state, assistant header and the "<think>"
prime; an env group's trajectories share it) and Z the reasoning sampled after it: the
response tokens before "</think>" (answer-only mode: before "</answer>", so Z is the
answer). For the N distinct prompts x_j of a batch and the R responses z_i sampled from
them (R = N x K when every prompt has its own env group of K), the cross log-probability
matrix l_j(z_i) = log p(z_i | x_j) = sum_t log pi(z_i,t | x_j, z_i,<t) (at the sampling
temperature) gives, with w_j the fraction of env groups whose prompt is x_j (1/N when all
prompts differ):

    matched_i  = l_{own(i)}(z_i)                      log p(z | x), its own prompt
    marginal_i = log sum_j w_j exp(l_j(z_i))          log p_mix(z), the batch's prompt mixture
    H(Z|X) = -mean_i matched_i    H(Z) = -mean_i marginal_i    I(X;Z) = H(Z) - H(Z|X)

in nats per sequence (`*_seq_est`) and, with each l_j(z_i) divided by |z_i| first, per
token (`*_est`); I(X;Z) <= H(X) = -sum_j w_j log w_j (log N). These are RAGEN's estimators
(its `collapse_first_turn_sample/<name>` keys; fastpo logs them as `collapse/<name>`).
Identical prompts of different groups are scored once and weighted by their count, which
gives exactly RAGEN's numbers (its duplicate columns) at less cost.

Cost. The matrix needs N x R scorings of (prompt, response) pairs. Scored pair by pair that
is N x R x (|x| + |z|) tokens, the prompt (hundreds of tokens) recomputed for every
response. fastpo packs, for each prompt, all R responses after one copy of it (the shared-
prompt packing of the trainer, `fastpo.packing`: each response attends to the prompt, then
causally to itself), N x (|x| + sum_i |z_i|) tokens, and takes the log-probs from the hidden
states with the fused kernel (`fastpo.kernels.linear_logprob_entropy`), never holding
[tokens x vocab] logits. `cross_logprobs_naive` is the slow, obvious reference.

Differences from RAGEN: Z is the sampled token ids (token-in-token-out), not the decoded
reasoning re-tokenized after stripping; a response cut before its closing tag (by
max_new_tokens) keeps all its tokens as Z, where RAGEN drops it (so that the CPU preset's
48-token responses, which rarely close the tag, still give the metrics;
`collapse/closed_rate` says how many closed it); only the first turn is measured (RAGEN
can also sample later turns, whose prompts differ per trajectory).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch

from fastpo.kernels import linear_logprob_entropy
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.packing import pack_micro_batch, packing_attention, packing_mask_dtype, plan_micro_batches

#: Stability constant of the MI z-score (RAGEN's std_eps).
STD_EPS = 1e-3


@dataclasses.dataclass
class ReasoningPairs:
    """The (prompt, reasoning) pairs of a batch.

    prompts: N distinct prompts, 1-D int64 tensors [P_j]. responses: R reasoning token
    sequences, 1-D int64 [Z_i], each non-empty. prompt_of: int64 [R], the index of each
    response's own prompt. weights: float64 [N], the fraction of env groups (among those
    with a response here) whose prompt is x_j; sums to 1. total: trajectories examined;
    closed: how many of them closed the reasoning with its tag; empty: how many gave an
    empty Z (dropped, as RAGEN drops them).
    """

    prompts: list
    responses: list
    prompt_of: torch.Tensor
    weights: torch.Tensor
    total: int = 0
    closed: int = 0
    empty: int = 0


def reasoning_tokens(ids: Sequence[int], tokenizer, close_tag: str = "</think>") -> tuple[list, bool]:
    """The reasoning part of one response's sampled ids: the tokens before the first token
    that reaches into `close_tag` (a trailing special token, e.g. the end-of-turn token,
    removed first). Returns (tokens, closed): without the tag, all tokens and False.

    Decodes O(log len) prefixes (binary search on the decoded length), not one per token.
    """
    ids = [int(t) for t in ids]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    if ids and ids[-1] in special:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    c = text.find(close_tag)
    if c < 0:
        return ids, False
    lo, hi = 0, len(ids)  # the smallest k whose prefix ids[:k + 1] decodes past character c
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid + 1], skip_special_tokens=False)) > c:
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo], True


def first_turn_pairs(batch, tokenizer, think: bool = True) -> ReasoningPairs:
    """Each trajectory's first-turn (prompt, reasoning) pair from a TrajectoryBatch.

    The prompt is the trajectory's ids before its first response token (the group's prompt,
    prime included); the reasoning is `reasoning_tokens` of the first response with
    close tag "</think>" (think mode) or "</answer>" (answer-only mode). Trajectories with no
    first response or an empty reasoning are left out. Identical prompts (of different env
    groups too) become one, weighted by the number of env groups holding it (a group whose
    trajectories saw different prompts holds each of them).
    """
    close = "</think>" if think else "</answer>"
    key_of: dict = {}
    prompts, responses, own, group_prompts = [], [], [], {}
    total = closed = empty = 0
    for b in range(len(batch.input_ids)):
        tix = torch.as_tensor(batch.turn_index[b])
        pos = torch.nonzero(tix == 0, as_tuple=False).flatten()
        if pos.numel() == 0:
            continue
        total += 1
        ids = torch.as_tensor(batch.input_ids[b], dtype=torch.long)
        z, was_closed = reasoning_tokens(ids[pos].tolist(), tokenizer, close)
        closed += int(was_closed)
        if not z:
            empty += 1
            continue
        x = ids[: int(pos[0])]
        k = key_of.setdefault(x.numpy().tobytes(), len(key_of))
        if k == len(prompts):
            prompts.append(x.clone())
        responses.append(torch.tensor(z, dtype=torch.long))
        own.append(k)
        # a group may hold several prompts (an env whose reset ignores the seed): each counts
        group_prompts.setdefault(int(batch.group_ids[b]), set()).add(k)
    counts = torch.zeros(len(prompts), dtype=torch.float64)
    for ks in group_prompts.values():
        for k in ks:
            counts[k] += 1
    weights = counts / counts.sum() if len(prompts) else counts
    return ReasoningPairs(prompts, responses, torch.tensor(own, dtype=torch.long), weights, total, closed, empty)


def _body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.Tensor]:
    return decoder_body(model), lm_head_weight(model)


@dataclasses.dataclass
class CrossLogprobs:
    """The cross log-probability matrix and what it cost.

    sums: float64 [R, N], l_j(z_i) = sum over z_i's tokens of log p (nats). lengths: int64
    [R], |z_i|. tokens: tokens run through the model (each packed row's length, summed).
    forwards: model forwards (micro-batches). seconds: wall time.
    """

    sums: torch.Tensor
    lengths: torch.Tensor
    tokens: int
    forwards: int
    seconds: float


def _pairs(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> tuple[list, list, list, list]:
    """Every [x_j | z_i] (prompt-major) with its loss mask (the response), prompt length and
    prompt index; ValueError for no prompts, no responses or an empty one."""
    if not prompts or not responses:
        raise ValueError(f"need at least one prompt and one response, got {len(prompts)} and {len(responses)}")
    if any(int(torch.as_tensor(z).numel()) == 0 for z in responses):
        raise ValueError("every response must hold at least one token")
    if any(int(torch.as_tensor(x).numel()) == 0 for x in prompts):
        raise ValueError("every prompt must hold at least one token")
    seqs, masks, plen, pgroup = [], [], [], []
    for j, x in enumerate(prompts):
        x = torch.as_tensor(x, dtype=torch.long).cpu()
        for z in responses:
            z = torch.as_tensor(z, dtype=torch.long).cpu()
            seqs.append(torch.cat([x, z]))
            masks.append(torch.cat([torch.zeros(x.numel(), dtype=torch.bool), torch.ones(z.numel(), dtype=torch.bool)]))
            plen.append(int(x.numel()))
            pgroup.append(j)
    return seqs, masks, plen, pgroup


@torch.no_grad()
def cross_logprobs(model: torch.nn.Module, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], *,
                   temperature: float = 1.0, token_budget: int = 8192, share_prompt: bool = True,
                   impl: str = "auto", autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   device: Optional[torch.device] = None) -> CrossLogprobs:
    """l_j(z_i) = log p(z_i | x_j) for every prompt j and response i, packed.

    Sequences [x_j | z_i] are packed into token-budget rows (`fastpo.packing`). With
    `share_prompt` and a model on fastpo's segment attention (`use_segment_attention`), a
    row holds x_j once and the responses after it, each attending to it; otherwise every pair
    carries its own copy of the prompt (the pair-by-pair cost, same kernel). Log-probs at
    `temperature` come from the last hidden states through the fused kernel
    (`linear_logprob_entropy`, `impl`), without [tokens x vocab] logits.

    Args: model: a transformers causal LM (or peft wrapper); prompts: N 1-D int64 tensors;
    responses: R non-empty 1-D int64 tensors; autocast: a context factory around the
    forwards (the trainer's bf16 autocast on CUDA). Returns CrossLogprobs. Raises ValueError
    for no prompts, no responses or an empty one.
    """
    t0 = time.perf_counter()
    body, head = _body_and_head(model)
    device = device if device is not None else head.device
    N, R = len(prompts), len(responses)
    seqs, masks, plen, pgroup = _pairs(prompts, responses)
    attention = packing_attention(model)
    share = share_prompt and attention == "segments"
    prefix = (plen, pgroup) if share else (None, None)
    plan = plan_micro_batches([int(s.numel()) for s in seqs], token_budget, *prefix)
    mdtype = packing_mask_dtype(model)
    sums = torch.zeros(N * R, dtype=torch.float64)
    tokens = forwards = 0
    was_training = model.training
    model.eval()
    try:
        for mb in plan:
            pb = pack_micro_batch(seqs, mb, attention=attention, mask_dtype=mdtype, device=device,
                                  prefix_lengths=prefix[0], prefix_groups=prefix[1])
            sc = pb.scored(masks)
            with autocast():
                h = body(**pb.model_inputs(), use_cache=False).last_hidden_state[0]
                lp, _ = linear_logprob_entropy(h[sc.rows], head, sc.targets, temperature, impl=impl)
            per_member = torch.zeros(len(pb.members), dtype=torch.float64, device=lp.device)
            per_member.index_add_(0, sc.seq, lp.double())
            sums[torch.tensor(sc.indices)] = per_member.cpu()
            tokens += pb.num_tokens
            forwards += 1
    finally:
        model.train(was_training)
    lengths = torch.tensor([int(torch.as_tensor(z).numel()) for z in responses], dtype=torch.long)
    return CrossLogprobs(sums.view(N, R).t().contiguous(), lengths, tokens, forwards, time.perf_counter() - t0)


@torch.no_grad()
def cross_logprobs_naive(model: torch.nn.Module, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], *,
                         temperature: float = 1.0) -> CrossLogprobs:
    """The reference: every (prompt, response) pair on its own, one plain forward each, full
    logits, log_softmax(logits / T) at the response's tokens. Same result and layout as
    `cross_logprobs`, N x R forwards."""
    t0 = time.perf_counter()
    dev = next(model.parameters()).device
    N, R = len(prompts), len(responses)
    sums = torch.zeros(R, N, dtype=torch.float64)
    tokens = 0
    was_training = model.training
    model.eval()
    try:
        for j, x in enumerate(prompts):
            x = torch.as_tensor(x, dtype=torch.long)
            for i, z in enumerate(responses):
                z = torch.as_tensor(z, dtype=torch.long)
                ids = torch.cat([x, z])[None].to(dev)
                logits = model(input_ids=ids, use_cache=False).logits[0].double()
                lp = torch.log_softmax(logits[x.numel() - 1:-1] / temperature, dim=-1)
                sums[i, j] = lp.gather(1, z.to(dev)[:, None]).sum().cpu()
                tokens += int(ids.shape[1])
    finally:
        model.train(was_training)
    lengths = torch.tensor([int(torch.as_tensor(z).numel()) for z in responses], dtype=torch.long)
    return CrossLogprobs(sums, lengths, tokens, N * R, time.perf_counter() - t0)


def mutual_information_metrics(sums: torch.Tensor, lengths: torch.Tensor, prompt_of: torch.Tensor,
                               weights: Optional[torch.Tensor] = None) -> dict:
    """RAGEN's collapse estimators from a cross log-probability matrix (module docstring).

    Args: sums float [R, N] (l_j(z_i), nats); lengths int [R] (|z_i| >= 1); prompt_of int [R]
    (each response's own prompt); weights float [N] (prompt frequencies, summing to 1;
    None: uniform). Returns {"collapse/<name>": float}: mi_estimate, mi_seq_estimate,
    mi_upper_bound, conditional_entropy_est (H(Z|X) per token), conditional_entropy_seq_est,
    reasoning_entropy_est (H(Z) per token), reasoning_entropy_seq_est,
    matched_log_prob_mean, marginal_log_prob_mean, mi_zscore, retrieval_accuracy (argmax_j
    of the per-token l_j(z_i) is z_i's prompt), retrieval_chance_level (mean weight of the
    own prompt), retrieval_above_chance. Nats; per token = divided by |z_i| before mixing.
    Raises ValueError on inconsistent shapes or weights.
    """
    sums = torch.as_tensor(sums, dtype=torch.float64)
    R, N = sums.shape
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    prompt_of = torch.as_tensor(prompt_of, dtype=torch.long)
    w = torch.full((N,), 1.0 / N, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if lengths.shape != (R,) or prompt_of.shape != (R,) or w.shape != (N,):
        raise ValueError(f"sums [R, N] = {tuple(sums.shape)} needs lengths and prompt_of [R] and weights [N], got "
                         f"{tuple(lengths.shape)}, {tuple(prompt_of.shape)}, {tuple(w.shape)}")
    if (lengths < 1).any() or not abs(float(w.sum()) - 1) < 1e-9 or (w <= 0).any():
        raise ValueError("lengths must be >= 1 and weights positive, summing to 1")
    logw = w.log()
    out = {}
    rows = torch.arange(R)
    for suffix, mat in (("", sums / lengths[:, None]), ("_seq", sums)):
        matched = mat[rows, prompt_of]
        marginal = torch.logsumexp(mat + logw[None, :], dim=1)
        out[f"collapse/mi{suffix}_estimate"] = float((matched - marginal).mean())
        out[f"collapse/conditional_entropy{suffix}_est"] = float(-matched.mean())
        out[f"collapse/reasoning_entropy{suffix}_est"] = float(-marginal.mean())
        if not suffix:
            out["collapse/matched_log_prob_mean"] = float(matched.mean())
            out["collapse/marginal_log_prob_mean"] = float(marginal.mean())
            sd = float(marginal.std(unbiased=False)) if R > 1 else 0.0
            out["collapse/mi_zscore"] = float(((matched - marginal) / (sd + STD_EPS)).mean())
            hit = (mat.argmax(dim=1) == prompt_of).double()
            out["collapse/retrieval_accuracy"] = float(hit.mean())
            out["collapse/retrieval_chance_level"] = float(w[prompt_of].mean())
            out["collapse/retrieval_above_chance"] = out["collapse/retrieval_accuracy"] - out["collapse/retrieval_chance_level"]
    out["collapse/mi_upper_bound"] = float(-(w * logw).sum())
    return out


def batch_collapse_metrics(model: torch.nn.Module, tokenizer, batch, *, think: bool = True, temperature: float = 1.0,
                           token_budget: int = 8192, share_prompt: bool = True, impl: str = "auto",
                           autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> dict:
    """The `collapse/*` metrics of a TrajectoryBatch's first turns (what the trainer logs).

    Besides `mutual_information_metrics` (only when the batch holds at least two distinct
    prompts): collapse/num_prompts (N distinct), collapse/num_responses (R), collapse/
    valid_rate (non-empty reasoning / trajectories), collapse/closed_rate (reasoning closed
    by its tag / trajectories), collapse/reasoning_length (mean |z|, tokens),
    collapse/tokens (tokens run through the model for the matrix). Returns {} for a batch
    without a first response.
    """
    pairs = first_turn_pairs(batch, tokenizer, think)
    if pairs.total == 0:
        return {}
    out = {
        "collapse/num_prompts": float(len(pairs.prompts)),
        "collapse/num_responses": float(len(pairs.responses)),
        "collapse/valid_rate": len(pairs.responses) / pairs.total,
        "collapse/closed_rate": pairs.closed / pairs.total,
    }
    if len(pairs.prompts) < 2:
        return out  # one prompt: no mixture to compare with (RAGEN needs two as well)
    cross = cross_logprobs(model, pairs.prompts, pairs.responses, temperature=temperature, token_budget=token_budget,
                           share_prompt=share_prompt, impl=impl, autocast=autocast)
    out.update(mutual_information_metrics(cross.sums, cross.lengths, pairs.prompt_of, pairs.weights))
    out["collapse/reasoning_length"] = float(cross.lengths.double().mean())
    out["collapse/tokens"] = float(cross.tokens)
    return out
