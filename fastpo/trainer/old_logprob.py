"""Where the PPO "old" log-probs come from: recomputed by the trainer, or the sampler's own.

PPO's ratio pi_theta / pi_old needs log pi_old(a_t | s_t) of every sampled token under the
weights that sampled it. The trainer can recompute them with a forward pass over the whole
batch after the rollout (what RAGEN / verl do by default), or, when the rollout was sampled
from the very same module at the same precision, take the log-probs the sampler recorded:
the same quantity, without the pass (verl offers the same for this case). fastpo's native
engine records log softmax(logits / T) over the full vocabulary (also under top-p / top-k,
which only restrict the draw), the quantity `fastpo.kernels.linear_logprob_entropy`
recomputes; in fp32 the two differ by float rounding only (< 1e-4 nats; the tests hold
`auto` to that on a test rollout).

`algorithm.old_logprob`:
* "recompute": always the trainer's pass (the gap to the sampler's log-probs is logged as
  `train/logprob_gap_mean` / `_max`);
* "sampler": always the sampler's log-probs (what is still needed, such as a separate
  critic's values or a reference model's log-probs, is computed in one pass without the
  policy's LM head);
* "auto": "sampler" exactly when `same_quantity` finds no reason against it, else
  "recompute".
"""
from __future__ import annotations

import torch

from fastpo.rollout.engine import NativeEngine

MODES = ("recompute", "sampler", "auto")


def same_quantity(engine, model: torch.nn.Module, temperature: float, autocast: bool) -> str | None:
    """Why the engine's recorded log-probs are NOT the trainer's old log-probs, or None when they are.

    The conditions: the engine is fastpo's NativeEngine sampling from `model` itself (not a
    copy such as SGLang's, whose weights are bf16 and whose log-probs are renormalised over
    the top-p nucleus); the logits are computed in fp32 (no autocast, fp32 weights: bf16
    logits are rounded before the sampler's log-softmax, the trainer's fused kernel keeps
    them in fp32, a gap of ~1e-2 nats); a sampling temperature > 0 (greedy decoding records
    log-probs at T = 1); the LM head's rows cover the engine's vocabulary. The native engine
    always records full-vocabulary log-probs (top-p / top-k do not renormalise them), and
    LoRA adapters are part of the shared module, so neither is a reason. Returns a short
    human-readable reason string.
    """
    if not isinstance(engine, NativeEngine):
        return f"the {type(engine).__name__} samples from its own copy of the weights"
    if engine.model is not model:
        return "the engine samples from another module than the one trained"
    if autocast:
        return "the logits are computed under bf16 autocast (the trainer's fused kernel keeps fp32 logits)"
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()})
    if dtypes != ["float32"]:
        return f"the model's weights are {', '.join(dtypes)}, not float32"
    if not temperature > 0:
        return f"rollout.temperature={temperature!r} (greedy sampling records log-probs at temperature 1)"
    head = model.get_output_embeddings()
    if head is None or int(head.weight.shape[0]) < engine.vocab_size:
        return "the LM head does not cover the engine's vocabulary"
    return None


def resolve_old_logprob(mode: str, engine, model: torch.nn.Module, temperature: float,
                        autocast: bool) -> tuple[str, str, bool]:
    """("sampler" | "recompute", why, warn) for `algorithm.old_logprob` = `mode` (module doc).

    Raises ValueError for a mode outside MODES. A forced "sampler" where the quantities
    differ is honoured; `why` then says what differs and `warn` is True (the trainer prints
    it as a warning).
    """
    if mode not in MODES:
        raise ValueError(f"algorithm.old_logprob must be one of {MODES}, got {mode!r}")
    if mode == "recompute":
        return "recompute", "algorithm.old_logprob=recompute", False
    why_not = same_quantity(engine, model, temperature, autocast)
    if mode == "sampler":
        if why_not is None:
            return "sampler", "the sampler's log-probs are the trainer's (algorithm.old_logprob=sampler)", False
        return "sampler", f"forced by algorithm.old_logprob=sampler although {why_not}", True
    if why_not is None:
        return "sampler", "auto: the native engine samples from the trained fp32 module, full-vocabulary log-probs", False
    return "recompute", f"auto: {why_not}", False
