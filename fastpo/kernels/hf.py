"""Adapter for transformers causal LMs: decoder body -> hidden states -> fused LM-head loss.

Alignment (the usual next-token shift): per-token tensors are [B, T] aligned with
input_ids; entry t refers to token t, whose log-prob comes from the hidden state at t - 1.
So column 0 can never be scored, and in a packed row neither can any sequence's first
token: the loss mask must be 0 there. Only the scored positions (mask set) are gathered
and sent through the fused function, so cost scales with the number of trained tokens.

transformers is not imported here: models are used through their public methods
(`base_model`, `get_output_embeddings`), so peft-wrapped models work too.
"""
from __future__ import annotations

import torch

from .api import PolicyLossOutput, linear_logprob_entropy, linear_policy_loss


def _unwrap(model):
    # peft's PeftModel keeps the transformers model behind get_base_model()
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# Config fields (and their neutral values) of heads that transform the logits after the linear
# map: Cohere's logit_scale (logits * s), Granite's logits_scaling (logits / s), Gemma 2/3's
# final_logit_softcapping (s * tanh(logits / s)). The fused kernels apply the plain linear map
# only, so such a head would be trained on other log-probs than the model samples with.
_LOGIT_TRANSFORMS = {"logit_scale": (None, 1.0), "logits_scaling": (None, 1.0), "final_logit_softcapping": (None,)}


def lm_head_weight(model) -> torch.Tensor:
    """The LM head's weight [V, H] of a causal LM (peft wrappers unwrapped), checked to be a
    plain linear head: logits = hidden @ weight.T, the only head the fused kernels compute.

    Raises ValueError naming the model class and the offending setting when the model has no
    output embedding, its head has a bias, or its logits are scaled or soft-capped after the
    linear map (`logit_scale`, `logits_scaling`, `final_logit_softcapping` set to anything but
    their neutral value, on the model or its (text) config).
    """
    inner = _unwrap(model)
    name = type(inner).__name__
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name} has no output embedding (lm_head) weight")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{name}'s lm_head has a bias; the fused loss supports bias-free heads only")
    cfg = getattr(inner, "config", None)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else None
    for attr, neutral in _LOGIT_TRANSFORMS.items():
        for holder in (inner, cfg, text_cfg):
            value = getattr(holder, attr, None)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not any(value is v or value == v for v in neutral):
                raise ValueError(f"{name} transforms its logits after the LM head ({attr}={value}); the fused "
                                 "log-prob and loss kernels support plain linear heads only, so the trainer "
                                 "would score other log-probs than the model samples with")
    return weight


def decoder_body(model) -> torch.nn.Module:
    """The decoder body (transformers' `base_model`: embeddings, layers, final norm) of a causal
    LM, peft wrappers unwrapped; calling it gives the last hidden state without logits.

    Raises ValueError when the model has no decoder body separate from its LM head.
    """
    inner = _unwrap(model)
    body = getattr(inner, "base_model", None)
    if body is None or body is inner:
        raise ValueError(f"{type(inner).__name__} has no decoder body (base_model) separate from its LM head")
    return body


def causal_lm_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder body's last hidden state [B, T, H] (final norm applied), no logits.

    model: a transformers *ForCausalLM (or a peft wrapper of one). input_ids [B, T] int64;
    attention_mask [B, T] padding mask or a 4D [B, 1, T, T] block-diagonal mask for packed
    rows (passed through to the model); position_ids [B, T] (restart per packed sequence).
    Raises ValueError when the model has no separate decoder body.
    """
    _check_ids(input_ids)
    body = decoder_body(model)
    out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden


def _check_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be an integer tensor of shape [B, T], got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")


def _check_bt(name, x, shape, allow_none=False):
    if x is None and allow_none:
        return
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must be a tensor of shape [B, T]={tuple(shape)}, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


def _scored(mask: torch.Tensor, name: str) -> torch.Tensor:
    """Flat indices into the [B, T-1] grid of shifted positions where mask[:, 1:] is set."""
    if bool((mask[:, 0] != 0).any()):
        raise ValueError(f"{name}[:, 0] must be 0: the first token of a row has no preceding hidden state")
    return (mask[:, 1:] != 0).reshape(-1).nonzero().squeeze(-1)


def _scatter(values: torch.Tensor, idx: torch.Tensor, b: int, t: int) -> torch.Tensor:
    out = torch.zeros(b, t, dtype=values.dtype, device=values.device)
    flat = torch.zeros(b * (t - 1), dtype=values.dtype, device=values.device).index_copy_(0, idx, values)
    out[:, 1:] = flat.view(b, t - 1)
    return out


def causal_lm_policy_loss(model, input_ids: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                          loss_mask: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                          position_ids: torch.Tensor | None = None, ref_logprob: torch.Tensor | None = None,
                          seq_ids: torch.Tensor | None = None, is_weights: torch.Tensor | None = None,
                          **options) -> PolicyLossOutput:
    """The fused policy loss of a causal LM on a padded or packed batch.

    input_ids [B, T] int64; old_logprob, advantages, ref_logprob, is_weights [B, T] float and
    loss_mask [B, T] bool/float, all aligned with input_ids (entry t is about token t, scored from the
    hidden state at t - 1); loss_mask[:, 0] must be 0, and 0 at every packed sequence start.
    seq_ids [B, T] integer names the sequences for the seq-mean-* aggregations (taken per
    row, so ids may restart in each row; any values, negative ones included); default: one
    sequence per row. `options` are
    `linear_policy_loss`'s keywords (clip_low, clip_high, dual_clip, entropy_coef, kl_coef,
    kl_estimator, temperature, loss_agg, denominator, ratio_level, impl, chunk_size); a
    sequence (for the seq-mean-* aggregations and GSPO's ratio_level "sequence") is a
    seq_ids run within one row. The LM head weight
    (tied to the embeddings or not) gets its gradient through the fused function.
    Returns PolicyLossOutput with logprob / entropy [B, T] fp32 (0 where not scored).
    As with `linear_policy_loss`, the gradient is formed during this call and held until
    `.backward()` (call it per micro-batch; use torch.no_grad() for loss-only evaluation).
    Raises ValueError on mismatched shapes, a nonzero mask in column 0 or at a packed
    sequence start, a negative or non-finite loss_mask, or cu_seqlens given; TypeError on
    non-integer seq_ids; and whatever `linear_policy_loss` raises for its options.
    """
    _check_ids(input_ids)
    b, t = input_ids.shape
    for name, x in (("old_logprob", old_logprob), ("advantages", advantages), ("loss_mask", loss_mask)):
        _check_bt(name, x, (b, t))
    _check_bt("ref_logprob", ref_logprob, (b, t), allow_none=True)
    _check_bt("is_weights", is_weights, (b, t), allow_none=True)
    _check_bt("seq_ids", seq_ids, (b, t), allow_none=True)
    if seq_ids is not None and (seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool):
        raise TypeError(f"seq_ids must be an integer tensor, got {seq_ids.dtype}")
    if "cu_seqlens" in options:
        raise ValueError("causal_lm_policy_loss takes seq_ids [B, T], not cu_seqlens")
    idx = _scored(loss_mask, "loss_mask")
    if seq_ids is not None:
        starts = seq_ids[:, 1:] != seq_ids[:, :-1]
        if bool((loss_mask[:, 1:] != 0)[starts].any()):
            raise ValueError("loss_mask must be 0 at the first token of every packed sequence (where seq_ids "
                             "changes): that token's preceding hidden state belongs to another sequence")
    inner = _unwrap(model)
    weight = lm_head_weight(inner)
    hidden = causal_lm_hidden_states(inner, input_ids, attention_mask, position_ids)
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, idx)

    def pick(x):
        return None if x is None else x[:, 1:].reshape(-1).index_select(0, idx)

    rows = torch.arange(b, device=input_ids.device).unsqueeze(1).expand(b, t)
    if seq_ids is None:
        sid = rows
    else:
        # a sequence lives in one row: number the distinct (row, id) pairs, so that equal ids
        # in different rows stay apart whatever their values (negative or huge)
        pairs = torch.stack([rows.reshape(-1), seq_ids.reshape(-1).long()], 1)
        sid = torch.unique(pairs, dim=0, return_inverse=True)[1].view(b, t)
    out = linear_policy_loss(h, weight, pick(input_ids), pick(old_logprob), pick(advantages), pick(loss_mask),
                             pick(ref_logprob), seq_ids=pick(sid), is_weights=pick(is_weights), **options)
    return PolicyLossOutput(out.loss, _scatter(out.logprob, idx, b, t), _scatter(out.entropy, idx, b, t),
                            out.metrics)


@torch.no_grad()
def causal_lm_logprob_entropy(model, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                              position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                              mask: torch.Tensor | None = None, impl: str = "auto",
                              chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob and entropy [B, T] fp32 of a causal LM (no grad; old/ref log-probs).

    Same alignment as `causal_lm_policy_loss`: entry t is token t scored from position t - 1,
    column 0 is 0. Only positions where `mask` [B, T] is set are computed (mask[:, 0] must
    be 0); default: every position t >= 1 that a 2D attention_mask keeps (all when
    attention_mask is None or 4D). Others are 0. Logits use softmax(logits / temperature).
    Raises ValueError on input_ids that are not an integer [B, T] tensor, a mask of another
    shape or nonzero in column 0, a model without a separate decoder body or with a
    non-linear LM head (bias, logit softcapping or scaling), and whatever
    `linear_logprob_entropy` raises (temperature, impl, token ids out of [0, V)).
    """
    _check_ids(input_ids)
    b, t = input_ids.shape
    if mask is None:
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = attention_mask != 0
        else:
            mask = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        mask = mask.clone()
        mask[:, 0] = False
    _check_bt("mask", mask, (b, t))
    idx = _scored(mask, "mask")
    inner = _unwrap(model)
    weight = lm_head_weight(inner)
    hidden = causal_lm_hidden_states(inner, input_ids, attention_mask, position_ids)
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, idx)
    targets = input_ids[:, 1:].reshape(-1).index_select(0, idx)
    lp, ent = linear_logprob_entropy(h, weight, targets, temperature, impl=impl, chunk_size=chunk_size)
    return _scatter(lp.float(), idx, b, t), _scatter(ent.float(), idx, b, t)
