"""Fused log-prob, entropy and policy loss (PPO/GRPO/GSPO clip and the other registered policy
losses: CISPO, SAPO, Clip-Cov, KL-Cov, or one of your own) from hidden states (Triton + PyTorch).

Usable on its own inside other trainers: it imports torch only (Triton lazily, on first
use of the Triton path), nothing else from fastpo.

    from fastpo.kernels import linear_logprob_entropy, linear_policy_loss, lm_head_weight
    weight = lm_head_weight(model)  # [V, H], checked to be a plain linear head
    logprob, entropy = linear_logprob_entropy(hidden, weight, targets)
    out = linear_policy_loss(hidden, weight, targets, old_logprob, advantages, loss_mask)
    out.loss.backward()

`causal_lm_*` run a transformers causal LM's decoder body and apply the same functions to
its LM head with the one-token shift. A policy loss is one function registered with its
facts (`register_policy_loss`, fastpo.kernels.losses).
"""
from .api import (IMPLS, PolicyLossOutput, linear_logprob_entropy, linear_policy_loss, resolve_impl,
                  triton_available)
from .hf import (causal_lm_hidden_states, causal_lm_logprob_entropy, causal_lm_policy_loss, decoder_body,
                 lm_head_weight)
from .losses import (POLICY_LOSSES, RATIO_LEVELS, LossSetting, PolicyGradient, PolicyLoss, PolicyLossInputs,
                     PolicyLossSettings, loss_settings, policy_loss, register_policy_loss)
from .torch_reference import (aggregate, aggregation_weights, policy_loss_terms, policy_metrics, reference_logprob_entropy,
                        reference_policy_loss, sequence_log_ratio)

__all__ = [
    "IMPLS", "PolicyLossOutput", "linear_logprob_entropy", "linear_policy_loss", "resolve_impl",
    "triton_available", "causal_lm_hidden_states", "causal_lm_logprob_entropy", "causal_lm_policy_loss",
    "decoder_body", "lm_head_weight",
    "POLICY_LOSSES", "RATIO_LEVELS", "LossSetting", "PolicyGradient", "PolicyLoss", "PolicyLossInputs",
    "PolicyLossSettings", "loss_settings", "policy_loss", "register_policy_loss",
    "aggregate", "aggregation_weights", "policy_loss_terms", "policy_metrics", "reference_logprob_entropy",
    "reference_policy_loss", "sequence_log_ratio",
]
