"""The trained modules of a run: the policy (with its tokenizer), the frozen reference model
of a KL term, the critic (a value head, on the policy's trunk or on a separate body), and how
they run (device, bf16 autocast, the FSDP2 root that shards them).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from typing import Any, Optional

import torch

from fastpo.judge import judge_from_config
from fastpo.run.checkpoint import load_checkpoint
from fastpo.config.schema import TrainConfig
from fastpo.config.fields import ConfigError
from fastpo.kernels.hf import decoder_body, lm_head_weight
from fastpo.model_loading import ModelLoadError, check_lora_targets, load_model_checked
from fastpo.packing import packing_attention, use_segment_attention
from fastpo.trainer.plan import RunPlan


class ValueHead(torch.nn.Module):
    """Scalar value V(s_t) from a hidden state [.., H] -> [..] fp32 (zero-initialised output)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h.to(self.proj.weight.dtype)).squeeze(-1).float()


def hidden_states(body: torch.nn.Module, micro) -> torch.Tensor:
    """The last hidden states [L, H] of packed micro-batch `micro` (one row of L tokens) through
    decoder body `body` (the policy's, the reference model's or a separate critic's): the
    forward that scoring and the update share."""
    return body(**micro.model_inputs(), use_cache=False).last_hidden_state[0]


@dataclasses.dataclass
class Models:
    """The run's modules. policy: the causal LM trained (a peft model with LoRA); tokenizer;
    info: `fastpo.model_loading.ModelInfo` of the loaded policy; reference: the frozen starting model
    (None without a KL term); value_head / critic_body: the critic (None without one;
    critic_body None: on the policy's trunk); fsdp_root: the FSDP2 root sharding them (None
    outside `trainer.data_parallel=fsdp`); autocast_bf16: the math runs under CUDA bf16
    autocast (`model.dtype=auto` on CUDA, fp32 master weights); judge / judge_tokenizer: the
    LLM judge's frozen model and tokenizer (fastpo.judge; None without a rubric),
    the reference module itself when both are the starting model."""

    policy: torch.nn.Module
    tokenizer: Any
    info: Any
    device: torch.device
    reference: Optional[torch.nn.Module] = None
    value_head: Optional[ValueHead] = None
    critic_body: Optional[torch.nn.Module] = None
    fsdp_root: Optional[torch.nn.Module] = None
    autocast_bf16: bool = False
    load_seconds: float = 0.0
    judge: Optional[torch.nn.Module] = None
    judge_tokenizer: Any = None

    def autocast(self):
        """The context the policy's math runs in: bf16 autocast, or nothing."""
        if self.autocast_bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def values(self, micro, rows: torch.Tensor, h_policy: Optional[torch.Tensor]) -> torch.Tensor:
        """The critic's values [M] fp32 at hidden-state rows `rows` [M] of `micro`: from the
        policy's hidden states `h_policy` for a critic on the shared trunk, else its own body's."""
        hv = h_policy if self.critic_body is None else hidden_states(self.critic_body, micro)
        return self.value_head(hv[rows])

    def trained(self) -> list:
        """The modules whose weights the run changes (policy, separate critic body, value head)."""
        return [self.policy, self.critic_body, self.value_head]


def load_models(cfg: TrainConfig, device: torch.device, tok, ckpt: Optional[str], trust: bool, console,
                plan: RunPlan) -> Models:
    """The policy loaded (its checkpointed weights on resume), its packing attention set; the
    frozen reference model (`plan.reference_model`) and the critic (`plan.needs_critic`: a value
    head, and a separate critic's body with `plan.separate_critic`) built beside it; LoRA adapters wrapped
    around it. Raises ModelLoadError / ConfigError (one line) for a model the kernels or the
    context window cannot take."""
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
    if dtype is None:
        dtype = torch.float32  # fp32 master weights; CUDA runs the math under bf16 autocast
    t0 = time.perf_counter()
    model, tok, info = load_model_checked(cfg.model.name, device=str(device), dtype=dtype, tokenizer=tok)
    try:  # the fused kernels compute plain linear heads only (fastpo.kernels.hf.lm_head_weight)
        lm_head_weight(model)
        decoder_body(model)
    except ValueError as e:
        raise ModelLoadError(f"model.name={cfg.model.name!r}: {e}") from None
    # packed rows attend per trajectory (sum of L_i^2, not N^2); generation still runs sdpa
    use_segment_attention(model)
    if cfg.rollout.context_window != "full" and packing_attention(model) == "varlen":
        raise ConfigError(f"config key 'rollout.context_window' = {cfg.rollout.context_window!r} needs a "
                          "per-token attention mask, which flash-attn's varlen packing cannot take; load the "
                          "model with sdpa or eager attention")
    if cfg.model.gradient_checkpointing:  # (transformers >= 5.2x renamed it; the old name warns)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    # the KL term's reference is the run's starting model (model.name, which a resume cannot
    # change): copied before a checkpoint's weights load into the policy
    ref = copy.deepcopy(model).eval().requires_grad_(False) if plan.reference_model else None
    judge, judge_tok = load_judge(cfg, model, tok, ref, device, dtype)
    if ckpt is not None and cfg.model.lora_rank == 0:
        # (with LoRA the base stays frozen; only the adapter is restored, below)
        load_checkpoint(ckpt, model=model, trust=trust)
    load_seconds = time.perf_counter() - t0
    console.print(f"[bold]model[/] {info.label}: {info.num_params / 1e6:.1f}M parameters, {info.dtype}, "
                  f"{device} (loaded in {load_seconds:.1f} s)")
    head = body = None
    if plan.needs_critic:
        head = ValueHead(model.config.hidden_size).to(device)
        if plan.separate_critic:
            # A copy of the policy's architecture (initialised from the policy, as RAGEN/verl do).
            body = copy.deepcopy(decoder_body(model)).to(device)
            body.requires_grad_(True)
    if cfg.model.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        check_lora_targets(model, cfg.model.lora_target_modules, cfg.model.name)  # peft's error is a traceback
        model = get_peft_model(model, LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                                                 lora_dropout=cfg.model.lora_dropout,
                                                 target_modules=list(cfg.model.lora_target_modules),
                                                 task_type="CAUSAL_LM"))
        if ckpt is not None:
            load_checkpoint(ckpt, model=model, trust=trust)  # the adapter
    return Models(model, tok, info, device, reference=ref, value_head=head, critic_body=body,
                  autocast_bf16=device.type == "cuda" and cfg.model.dtype == "auto", load_seconds=load_seconds,
                  judge=judge, judge_tokenizer=judge_tok)


def load_judge(cfg: TrainConfig, model, tok, ref, device: torch.device, dtype) -> tuple:
    """(the LLM judge's model, its tokenizer) for a rubric (reward.judge_rubric), else (None,
    None): reward.judge_model's (frozen; bf16 on CUDA, fp32 on the CPU), or a frozen copy of the
    policy's starting weights `model` (the reference module `ref` when the run has one). Called
    before a checkpoint's weights load, so a resumed run's judge is still the starting model.
    Raises ModelLoadError (one line naming reward.judge_model) for a judge the native engine or
    the judge's prompt cannot take (sliding-window attention, no chat template)."""
    r = cfg.reward
    if r.judge_rubric is None and r.judge_rubric_file is None:
        return None, None
    if r.judge_model is None:
        judge = ref if ref is not None else copy.deepcopy(model).eval().requires_grad_(False)
        return judge, tok
    judge, judge_tok, _ = load_model_checked(r.judge_model, key="reward.judge_model", device=str(device), dtype=None)
    judge.eval().requires_grad_(False)
    try:
        judge_from_config(r, judge, judge_tok)  # what the judge's engine and prompt need, checked now
    except ValueError as e:
        raise ModelLoadError(f"reward.judge_model={r.judge_model!r} cannot judge: {e}") from None
    return judge, judge_tok
