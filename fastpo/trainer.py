"""The StarPO / StarPO-S training loop (RAGEN, arXiv 2504.20073, Alg. 1).

One iteration:

1. rollout: P env groups x N trajectories from seeds derived from (seed, iteration), with the
   native engine sharing the policy module (so step 6 needs no weight transfer);
2. filter: StarPO-S keeps the env groups with the highest in-group reward std;
3. old log-probs (and values, reference log-probs) recomputed by the trainer on packed
   micro-batches, the gap to the sampling log-probs logged (`train/logprob_gap_*`); or,
   where they are the same quantity (`algorithm.old_logprob`, fastpo.old_logprob), the
   sampler's own log-probs and entropies, with a shared critic's values read out in the
   sampling pass, and only what is still missing computed;
4. advantages: GAE over model tokens with the critic (PPO) or group-normalized scores (GRPO);
5. updates: `ppo_epochs` passes over shuffled mini-batches of trajectories, each split into
   token-budget micro-batches with gradient accumulation, fused policy loss from
   `fastpo.kernels`, clipped value loss, gradient clipping; a non-finite loss or gradient
   skips the update with a warning;
6. the engine sees the new weights (same module); evaluation, metrics, plots, samples and
   checkpoints as configured.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import time
from typing import Any, Optional

import numpy as np
import torch
import yaml

from fastpo import algorithms as alg
from fastpo.checkpoint import (clear_run_folder, latest_checkpoint, load_state, run_folder_in_use, save_checkpoint,
                               set_rng_state)
from fastpo.config import ConfigError, TrainConfig, config_from_dict, cpu_preset_note, dump_yaml
from fastpo.evaluate import evaluate_policy
from fastpo.metrics import (EchoTrapDetector, MetricsLogger, plot_curves, rollout_metrics, summary_table,
                            write_samples)
from fastpo.packing import (pack_micro_batch, packing_attention, plan_micro_batches, shared_prefixes,
                            use_segment_attention)


def _settings(config_yaml: str) -> dict:
    """A run's settings from its config.yaml text, without what a resume may change freely
    (the folder's spelling, the iteration count)."""
    d = yaml.safe_load(config_yaml) or {}
    for key in ("output_dir", "iterations"):
        d.get("trainer", {}).pop(key, None)
    return d


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when available else cpu.

    Raises ConfigError (a ValueError) for a string torch cannot read, cuda on a machine
    without it, or a cuda index beyond the devices present.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConfigError(f"trainer.device={name!r} is not a device ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"trainer.device={name!r}: must be auto, cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={name!r} but torch.cuda.is_available() is False")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"trainer.device={name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


class ModelLoadError(ConfigError):
    """The model name or path cannot be loaded (unknown name, missing folder, not a model)."""


def load_model_checked(name: str, **kw):
    """`fastpo.models.load_model_and_tokenizer(name, **kw)` with its bad-input errors
    (ValueError, RuntimeError, OSError) raised as ModelLoadError naming `model.name`."""
    from fastpo import models

    try:
        return models.load_model_and_tokenizer(name, **kw)
    except (ValueError, RuntimeError, OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"model.name={name!r} cannot be loaded: {msg}") from e


def iteration_seeds(seed: int, iteration: int, n: int) -> list[int]:
    """The env seeds of iteration `iteration`: a pure function of (seed, iteration), so resume repeats them."""
    rng = np.random.default_rng([seed, iteration, 7919])
    return [int(s) for s in rng.integers(0, 2**31 - 1, size=n)]


class ValueHead(torch.nn.Module):
    """Scalar value V(s_t) from a hidden state [.., H] -> [..] fp32 (zero-initialised output)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h.to(self.proj.weight.dtype)).squeeze(-1).float()


def _body(model: torch.nn.Module) -> torch.nn.Module:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.base_model


def _lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.get_output_embeddings().weight


class Trainer:
    """Runs StarPO / StarPO-S for `cfg.trainer.iterations` iterations into `cfg.trainer.output_dir`.

    `resume=True` continues the run found in the output folder from its latest checkpoint.
    `console` is a rich Console (created when None). `stop_after` (an iteration) stops the
    run there exactly as a Ctrl-C during that iteration would: checkpoint, then return.
    Public entry point: `run()`, returning the list of metric records.
    """

    def __init__(self, cfg: TrainConfig, resume: bool = False, console: Any = None,
                 stop_after: Optional[int] = None, overwrite: bool = False):
        from rich.console import Console

        self.cfg = cfg
        self.console = console or Console()
        self.out = cfg.trainer.output_dir
        self.resume = resume
        self.overwrite = overwrite
        self.device = resolve_device(cfg.trainer.device)
        self._stop_requested = False
        self.interrupted = False  # stopped by Ctrl-C (after saving), not by reaching the end
        self.stop_after = stop_after
        self.start_iteration = 1
        self.weight_sync_seconds = 0.0
        self.last_eval: dict = {}

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Load the model(s), build the critic, optimizers, engine, rollout and logger; restore a checkpoint.

        A start that fails (e.g. the model cannot load) leaves no empty output folder behind."""
        created = not os.path.exists(self.out)
        try:
            self._setup()
        except BaseException:
            self._shutdown_engine()  # a started SGLang server must not outlive the failed start
            if created and os.path.isdir(self.out) and not os.listdir(self.out):
                os.rmdir(self.out)
            raise

    def _setup(self) -> None:
        from fastpo import rollout as ro

        cfg, c = self.cfg, self.console
        if cfg.rollout.engine == "sglang":
            from fastpo.rollout.sglang_engine import sglang_available

            if not sglang_available():  # before anything loads or is written
                raise ConfigError("config key 'rollout.engine' = 'sglang': needs CUDA and sglang "
                                  "(pip install 'fastpo[sglang]'); use rollout.engine=native on this machine")
        torch.manual_seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed % 2**32)
        if not self.resume:
            used = run_folder_in_use(self.out)
            if used and not self.overwrite:
                # never destroy a previous run by starting a new one on top of it
                raise FileExistsError(f"{self.out} already holds a run ({', '.join(used)}); resume it, "
                                      f"choose another output folder or pass overwrite=True (--overwrite)")
            if used:
                clear_run_folder(self.out)
        os.makedirs(self.out, exist_ok=True)
        dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
        if dtype is None:
            dtype = torch.float32  # fp32 master weights; CUDA runs the math under bf16 autocast
        ckpt = latest_checkpoint(self.out) if self.resume else None
        if self.resume and ckpt is None:
            raise FileNotFoundError(f"--resume {self.out}: no checkpoint found under {self.out}/checkpoints")
        t0 = time.perf_counter()
        model, tok, info = load_model_checked(cfg.model.name, device=str(self.device), dtype=dtype)
        self.info = info
        if ckpt is not None and cfg.model.lora_rank == 0:
            # (with LoRA the base stays frozen; only the adapter is restored, below)
            self._load_weights(model, os.path.join(ckpt, "model"))
        self.load_seconds = time.perf_counter() - t0
        c.print(f"[bold]model[/] {info.label}: {info.num_params / 1e6:.1f}M parameters, {info.dtype}, "
                f"{self.device} (loaded in {self.load_seconds:.1f} s)")
        # packed rows attend per trajectory (sum of L_i^2, not N^2); generation still runs sdpa
        use_segment_attention(model)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        hidden = model.config.hidden_size
        a = cfg.algorithm
        self.critic_body = None
        self.value_head = None
        if a.adv_estimator == "gae":
            self.value_head = ValueHead(hidden).to(self.device)
            if a.critic == "separate":
                # A copy of the policy's architecture (initialised from the policy, as RAGEN/verl do).
                self.critic_body = copy.deepcopy(_body(model)).to(self.device)
                self.critic_body.requires_grad_(True)
        if cfg.model.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                                                     lora_dropout=cfg.model.lora_dropout,
                                                     target_modules=list(cfg.model.lora_target_modules),
                                                     task_type="CAUSAL_LM"))
            if ckpt is not None and os.path.isdir(os.path.join(ckpt, "model", "adapter")):
                from peft import set_peft_model_state_dict
                from safetensors.torch import load_file

                set_peft_model_state_dict(model, load_file(os.path.join(ckpt, "model", "adapter",
                                                                        "adapter_model.safetensors")))
        self.model, self.tokenizer = model, tok
        o = cfg.optim
        actor_params = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": actor_params, "lr": o.actor_lr}]
        self.critic_opt = None
        if self.value_head is not None and a.critic == "shared":
            groups.append({"params": list(self.value_head.parameters()), "lr": o.critic_lr})
        self.actor_opt = torch.optim.AdamW(groups, lr=o.actor_lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        if self.critic_body is not None:
            self.critic_opt = torch.optim.AdamW(list(self.critic_body.parameters()) + list(self.value_head.parameters()),
                                                lr=o.critic_lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        self.rollout_cfg = cfg.rollout.rollout_config()
        self.engine = self._make_engine(model, tok)
        self._resolve_old_logprob()
        self.rollout = ro.MultiTurnRollout(self.engine, tok, cfg.env.name, dict(cfg.env.options), self.rollout_cfg)
        self.echo = EchoTrapDetector(cfg.trainer.echo_trap_drop, cfg.trainer.echo_trap_window)
        if ckpt is not None:
            state, opts = load_state(ckpt)
            self.actor_opt.load_state_dict(opts["actor"])
            if self.critic_opt is not None:
                self.critic_opt.load_state_dict(opts["critic"])
            if self.value_head is not None:
                from safetensors.torch import load_file

                self.value_head.load_state_dict(load_file(os.path.join(ckpt, "critic", "value_head.safetensors")))
            if self.critic_body is not None:
                self._load_weights(self.critic_body, os.path.join(ckpt, "critic"), body=True)
            set_rng_state(state["rng"])
            self.start_iteration = int(state["iteration"]) + 1
            self.last_eval = state.get("last_eval", {})
            c.print(f"[bold]resumed[/] from {ckpt} at iteration {self.start_iteration}")
        self.logger = MetricsLogger(self.out, cfg.trainer.ema_decay, cfg.trainer.tensorboard, cfg.trainer.wandb,
                                    resume_from=self.start_iteration - 1 if ckpt is not None else None,
                                    run_name=os.path.basename(os.path.abspath(self.out)), config=cfg.to_dict(),
                                    model_label=self.info.label)
        for rec in self.logger.records:
            self.echo.update(rec)
        path, text = os.path.join(self.out, "config.yaml"), dump_yaml(cfg)
        if ckpt is not None and self.start_iteration > cfg.trainer.iterations:
            return  # a finished run resumed with nothing to train: its config.yaml stays as it ran
        ran = os.path.join(ckpt, "config.yaml") if ckpt is not None else None
        if ran is not None and os.path.exists(ran) and _settings(_read(ran)) != _settings(text):
            # resumed with changed settings: keep beside the run those the checkpoint's iterations
            # ran with (from the checkpoint, so a failed resume in between cannot blur them)
            kept = os.path.join(self.out, f"config.until_iter_{self.start_iteration - 1:06d}.yaml")
            if not os.path.exists(kept):
                shutil.copyfile(ran, kept)
            c.print(f"settings changed on resume: iterations up to {self.start_iteration - 1} ran with {kept}")
        with open(path, "w") as f:
            f.write(text)

    def _make_engine(self, model, tok):
        """The generation engine of `rollout.engine`: the native one samples from `model` itself;
        SGLang's holds a copy, refreshed by `_engine_awake` after each update."""
        from fastpo import rollout as ro

        r = self.cfg.rollout
        self._engine_released = self._weights_stale = False
        if r.engine == "native":
            return ro.NativeEngine(model, tok)
        import tempfile

        from fastpo.rollout.sglang_engine import SGLangEngine

        # SGLang loads the weights from an HF folder once; later updates go as tensors, so the
        # folder (a full copy of the model) lives only until the engine has started
        folder = tempfile.mkdtemp(prefix="fastpo-sglang-")
        try:
            return SGLangEngine.from_model(model, tok, folder, mem_fraction_static=r.sglang_mem_fraction,
                                           dtype="float32" if self.cfg.model.dtype == "float32" else "bfloat16")
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _resolve_old_logprob(self) -> None:
        """Set `self.old_logprob_source` ("sampler" | "recompute") from `algorithm.old_logprob`."""
        from fastpo.old_logprob import resolve_old_logprob

        autocast = self.device.type == "cuda" and self.cfg.model.dtype == "auto"  # as _autocast()
        self.old_logprob_source, why, warn = resolve_old_logprob(
            self.cfg.algorithm.old_logprob, self.engine, self.model, self.cfg.rollout.temperature, autocast)
        self.console.print(f"{'[yellow]warning[/]: ' if warn else ''}old log-probs: {self.old_logprob_source} ({why})")

    def _shutdown_engine(self) -> None:
        """Stop an engine that runs its own processes (SGLang); the native one has none."""
        engine = getattr(self, "engine", None)
        if hasattr(engine, "shutdown"):
            engine.shutdown()

    @contextlib.contextmanager
    def _engine_awake(self):
        """Around generation: an engine that frees its GPU memory for training (SGLang) takes
        it back and loads the weights of the last update first, and frees it again after."""
        if not hasattr(self.engine, "release_memory"):
            yield  # the native engine is the trained module: nothing to move
            return
        if self._engine_released:
            self.engine.resume_memory()
            self._engine_released = False
        if self._weights_stale:
            t0 = time.perf_counter()
            self.engine.update_weights(self.model)
            self._weights_stale = False
            self.weight_sync_seconds += time.perf_counter() - t0
        try:
            yield
        finally:
            self.engine.release_memory()
            self._engine_released = True

    def _load_weights(self, module: torch.nn.Module, folder: str, body: bool = False) -> None:
        from transformers import AutoModel, AutoModelForCausalLM

        loaded = (AutoModel if body else AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32)
        missing, unexpected = module.load_state_dict(loaded.state_dict(), strict=False)
        # tied LM heads are stored once; anything else missing means a wrong checkpoint
        bad = [k for k in missing if "lm_head" not in k]
        if bad or unexpected:
            raise RuntimeError(f"checkpoint {folder} does not fit the model: missing {bad[:5]}, unexpected {unexpected[:5]}")

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.model.dtype == "auto":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ phases
    def _generate(self, seeds: list[int], group_size: int, temperature: float, seed: int):
        self.model.eval()
        # old log-probs from the sampler: a critic on the policy's trunk reads its values off
        # the sampling pass's hidden states, so no pass over the batch is left to do
        readout = (getattr(self, "old_logprob_source", "recompute") == "sampler" and self.value_head is not None
                   and self.critic_body is None and hasattr(self.engine, "readout"))
        if readout:
            self.engine.readout = self.value_head
        try:
            with torch.no_grad(), self._autocast(), self._engine_awake():
                return self.rollout.generate(seeds, group_size, temperature=temperature, seed=seed)
        finally:
            if readout:
                self.engine.readout = None

    def _micro_batches(self, ids: list[torch.Tensor], indices: list[int], masks: list[torch.Tensor]):
        """Packed micro-batches of the trajectories `indices`; an env group's shared prompt is
        computed once per micro-batch where the attention allows it (optim.share_prefix)."""
        attention = packing_attention(self.model)
        prefix = groups = None
        if attention == "segments" and self.cfg.optim.share_prefix:
            pl, pg = shared_prefixes([ids[i] for i in indices], [masks[i] for i in indices])
            prefix, groups = dict(zip(indices, pl)), dict(zip(indices, pg))
        lengths = [int(ids[i].numel()) for i in indices]
        plan = plan_micro_batches(lengths, self.cfg.optim.micro_token_budget,
                                  None if prefix is None else [prefix[i] for i in indices],
                                  None if groups is None else [groups[i] for i in indices])
        # sdpa takes a boolean mask whatever the query dtype (autocast or not); eager adds a float one
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        mdtype = torch.bool if impl == "sdpa" else torch.float32
        for mb in plan:
            yield pack_micro_batch(ids, [indices[j] for j in mb], attention=attention, mask_dtype=mdtype,
                                   device=self.device, prefix_lengths=prefix, prefix_groups=groups)

    @torch.no_grad()
    def compute_old(self, ids, masks, logprobs: bool = True, values: bool = True) -> tuple[list, list, list, list]:
        """Old log-probs, entropies, values and reference log-probs per trajectory ([T_i] fp32 each).

        Log-prob/entropy of token t sit at index t (0 off the loss mask); values likewise.
        `logprobs=False` skips the policy's LM head (log-probs and entropies stay None),
        `values=False` the critic (values None): what the sampler already gave.
        """
        from fastpo.kernels import linear_logprob_entropy

        temp = self.cfg.rollout.temperature
        impl = self.cfg.trainer.kernel_impl
        n = len(ids)
        values = values and self.value_head is not None
        old_lp = [torch.zeros(int(x.numel())) for x in ids] if logprobs else None
        ent = [torch.zeros(int(x.numel())) for x in ids] if logprobs else None
        vals = [torch.zeros(int(x.numel())) for x in ids] if values else None
        ref = [torch.zeros(int(x.numel())) for x in ids] if self.ref_model is not None else None
        if not (logprobs or values or ref is not None):
            return old_lp, ent, vals, ref
        policy_body = logprobs or (values and self.critic_body is None)
        self.model.eval()
        for pb in self._micro_batches(ids, list(range(n)), masks):
            sc = pb.scored(masks)  # token t is scored from the hidden state at t - 1
            if sc.count == 0:
                continue
            with self._autocast():
                h = _body(self.model)(**pb.model_inputs(), use_cache=False).last_hidden_state[0] if policy_body else None
                if logprobs:
                    lp, e = linear_logprob_entropy(h[sc.hidden], _lm_head_weight(self.model), sc.targets, temp,
                                                   impl=impl)
                    sc.scatter(lp.float(), old_lp)
                    sc.scatter(e.float(), ent)
                if values:
                    hv = h if self.critic_body is None else self.critic_body(
                        **pb.model_inputs(), use_cache=False).last_hidden_state[0]
                    sc.scatter(self.value_head(hv[sc.hidden]).float(), vals)
                if self.ref_model is not None:
                    hr = _body(self.ref_model)(**pb.model_inputs(), use_cache=False).last_hidden_state[0]
                    rlp, _ = linear_logprob_entropy(hr[sc.hidden], _lm_head_weight(self.ref_model), sc.targets, temp,
                                                    impl=impl)
                    sc.scatter(rlp.float(), ref)
        return old_lp, ent, vals, ref

    def _old_from_sampler(self, batch, ids, masks, samp):
        """(old_lp, ent, vals, ref, recomputed log-probs or None) with the sampler's log-probs as
        old_lp; entropies and a shared critic's values from the rollout where it recorded them,
        and one pass over the batch for only what is still missing (a separate critic, a
        reference model, or an engine that records no entropies)."""
        ent = [torch.as_tensor(x, dtype=torch.float32) for x in batch.sample_entropies] or None
        vals = None
        if self.value_head is not None and self.critic_body is None and batch.sample_values:
            vals = [torch.as_tensor(x, dtype=torch.float32) for x in batch.sample_values]
        lp2, ent2, vals2, ref = self.compute_old(ids, masks, logprobs=ent is None,
                                                 values=self.value_head is not None and vals is None)
        return samp, ent if ent is not None else ent2, vals if vals is not None else vals2, ref, lp2

    def compute_advantages(self, batch, masks, vals) -> tuple[list, Optional[list], dict]:
        """Per-trajectory advantages (and returns for PPO), [T_i] fp32 each, zero off the loss mask."""
        a = self.cfg.algorithm
        B = len(masks)
        T = max(int(m.numel()) for m in masks)
        M = torch.zeros(B, T, dtype=torch.bool)
        for i, m in enumerate(masks):
            M[i, : m.numel()] = m
        metrics: dict = {}
        if a.adv_estimator == "gae":
            V = torch.zeros(B, T)
            for i, v in enumerate(vals):
                V[i, : v.numel()] = v
            turn = None
            if a.reward_position == "turn":
                turn = torch.full((B, T), -1, dtype=torch.long)
                for i, t in enumerate(batch.turn_index):
                    t = torch.as_tensor(t)
                    turn[i, : t.numel()] = t
            # turn_rewards already hold each turn's env reward plus its format penalty
            turn_rewards = batch.turn_rewards.float() if a.reward_position == "turn" else None
            R = alg.place_rewards(M, batch.scores.float(), a.reward_position, turn, turn_rewards)
            adv, ret = alg.compute_gae(R, V, M, a.gamma, a.lam)
            metrics["critic/return_mean"] = float(ret[M].mean()) if M.any() else 0.0
            metrics["critic/value_mean"] = float(V[M].mean()) if M.any() else 0.0
            if a.whiten_advantages:
                adv = alg.masked_whiten(adv, M)
            returns = [ret[i, : masks[i].numel()] for i in range(B)]
        else:
            per_traj = alg.grpo_advantages(batch.scores.float(), batch.group_ids, scale_by_std=a.adv_estimator == "grpo")
            adv = per_traj[:, None] * M
            returns = None
        metrics["train/advantage_mean"] = float(adv[M].mean()) if M.any() else 0.0
        metrics["train/advantage_std"] = float(adv[M].std()) if int(M.sum()) > 1 else 0.0
        return [adv[i, : masks[i].numel()] for i in range(B)], returns, metrics

    def epoch_mini_batches(self, masks: list, generator: torch.Generator):
        """One PPO epoch's mini-batches: shuffled trajectory indices, the last one smaller when
        n % mini_batch_size != 0. Yields (indices, scored tokens, loss denominator): the
        denominator is the scored-token count for token-mean, else the scored-trajectory count."""
        size = self.cfg.optim.mini_batch_size
        perm = torch.randperm(len(masks), generator=generator).tolist()
        for start in range(0, len(masks), size):
            mb = perm[start:start + size]
            n_tok = sum(int(masks[i][1:].sum()) for i in mb)
            denom = float(max(1, n_tok)) if self.cfg.algorithm.loss_agg == "token-mean" else float(
                sum(1 for i in mb if bool(masks[i][1:].any())) or 1)
            yield mb, n_tok, denom

    def update(self, it: int, ids, masks, old_lp, adv, vals, returns, ref) -> dict:
        """PPO epochs over shuffled mini-batches; returns averaged update metrics."""
        from fastpo.kernels import linear_policy_loss

        cfg, a, o = self.cfg, self.cfg.algorithm, self.cfg.optim
        g = torch.Generator().manual_seed(int(np.random.default_rng([cfg.trainer.seed, it, 104729]).integers(2**62)))
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}

        def add(k, v):
            sums[k] = sums.get(k, 0.0) + float(v)
            counts[k] = counts.get(k, 0) + 1

        skipped = 0
        steps = 0
        train_tokens = 0
        self.model.train()
        for _epoch in range(o.ppo_epochs):
            for mb, n_tok, denom in self.epoch_mini_batches(masks, g):
                self.actor_opt.zero_grad(set_to_none=True)
                if self.critic_opt is not None:
                    self.critic_opt.zero_grad(set_to_none=True)
                finite = True
                for pb in self._micro_batches(ids, mb, masks):
                    sc = pb.scored(masks)
                    if sc.count == 0:
                        continue
                    old = sc.take(old_lp)
                    A = sc.take(adv)
                    rl = sc.take(ref) if ref is not None else None
                    sid = sc.seq
                    train_tokens += pb.trajectory_tokens
                    with self._autocast():
                        h = _body(self.model)(**pb.model_inputs(), use_cache=False).last_hidden_state[0]
                        out = linear_policy_loss(
                            h[sc.hidden], _lm_head_weight(self.model), sc.targets, old, A,
                            torch.ones_like(old, dtype=torch.bool), rl,
                            clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip,
                            entropy_coef=a.entropy_coef, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                            temperature=cfg.rollout.temperature, loss_agg=a.loss_agg, seq_ids=sid,
                            denominator=denom, impl=cfg.trainer.kernel_impl)
                        loss = out.loss
                        vloss = None
                        if self.value_head is not None:
                            hv = h if self.critic_body is None else self.critic_body(
                                **pb.model_inputs(), use_cache=False).last_hidden_state[0]
                            v = self.value_head(hv[sc.hidden])
                            ov = sc.take(vals)
                            R = sc.take(returns)
                            vl, vm = alg.clipped_value_loss(v, ov, R, torch.ones_like(v, dtype=torch.bool),
                                                            clip=a.value_clip)
                            vloss = vl * (sc.count / max(1, n_tok))
                            for k, val in vm.items():
                                add(f"critic/{k}", val)
                            add("critic/value_loss", vl.detach())
                    total = loss + (a.value_coef * vloss if (vloss is not None and self.critic_body is None) else 0.0)
                    if vloss is not None and self.critic_body is not None:
                        total = total + vloss  # separate critic: its own optimizer, no coefficient needed
                    if not torch.isfinite(total.detach()):
                        finite = False
                        break
                    total.backward()
                    for k, val in out.metrics.items():
                        add(f"actor/{k}", val)
                    add("actor/pg_loss_micro", loss.detach())
                if finite:
                    gn = torch.nn.utils.clip_grad_norm_([p for grp in self.actor_opt.param_groups for p in grp["params"]],
                                                        o.grad_clip)
                    cgn = None
                    if self.critic_opt is not None:
                        cgn = torch.nn.utils.clip_grad_norm_(
                            [p for grp in self.critic_opt.param_groups for p in grp["params"]], o.grad_clip)
                    finite = bool(torch.isfinite(gn)) and (cgn is None or bool(torch.isfinite(cgn)))
                if not finite:
                    skipped += 1
                    self.console.print(f"[yellow]warning[/]: iteration {it}: non-finite loss or gradient; "
                                       "update skipped (weights unchanged)")
                    self.actor_opt.zero_grad(set_to_none=True)
                    if self.critic_opt is not None:
                        self.critic_opt.zero_grad(set_to_none=True)
                    continue
                self.actor_opt.step()
                if self.critic_opt is not None:
                    self.critic_opt.step()
                    add("critic/grad_norm", cgn)
                add("actor/grad_norm", gn)
                steps += 1
        self.model.eval()
        res = {k: sums[k] / counts[k] for k in sums}
        res["actor/updates"] = steps
        res["actor/skipped_updates"] = skipped
        res["_train_tokens"] = train_tokens
        return res

    def evaluate(self, it: int) -> dict:
        """Success rate and pass@k on the fixed eval seeds at the eval temperature; writes samples."""
        t = self.cfg.trainer
        seeds = [t.eval_seed_offset + i for i in range(t.eval_seeds)]
        t0 = time.perf_counter()
        with self._engine_awake():
            res = evaluate_policy(self.rollout, seeds, t.eval_group_size, t.eval_temperature, seed=t.seed + 12345,
                                  autocast=self._autocast, model=self.model)
        batch = res.pop("_batch")
        write_samples(os.path.join(self.out, "samples"), it, batch.texts()[: max(1, t.num_samples)],
                      header=f"eval at iteration {it}: success rate {res['eval/success_rate']:.3f} "
                             f"(temperature {t.eval_temperature}, {len(seeds)} seeds)",
                      model_label=self.info.label)
        res["time/eval_s"] = time.perf_counter() - t0
        return res

    # ------------------------------------------------------------------ loop
    def iteration(self, it: int) -> dict:
        """One StarPO iteration; returns its metrics."""
        cfg, r, a = self.cfg, self.cfg.rollout, self.cfg.algorithm
        tm: dict[str, float] = {}
        t0 = time.perf_counter()
        self.weight_sync_seconds = 0.0
        seeds = iteration_seeds(cfg.trainer.seed, it, r.env_groups)
        batch = self._generate(seeds, r.group_size, r.temperature, seed=cfg.trainer.seed * 1_000_003 + it)
        tm["time/rollout_s"] = time.perf_counter() - t0 - self.weight_sync_seconds
        tm["time/weight_sync_s"] = self.weight_sync_seconds
        full = batch
        m = rollout_metrics(full, prefix="train")
        t1 = time.perf_counter()
        filt = alg.filter_groups(full.scores.float(), full.group_ids, a.filter_ratio, a.filter_mode)
        batch = full.select(filt.indices) if filt.indices.numel() < len(full.input_ids) else full
        m["train/filter_kept_ratio"] = filt.kept_ratio
        m["train/in_group_reward_std_kept"] = filt.std_after
        ids = [torch.as_tensor(x, dtype=torch.long) for x in batch.input_ids]
        masks = [torch.as_tensor(x, dtype=torch.bool).clone() for x in batch.loss_mask]
        for mk in masks:
            mk[0] = False
        samp = [torch.as_tensor(x, dtype=torch.float32) for x in batch.sample_logprobs]
        if getattr(self, "old_logprob_source", "recompute") == "sampler":
            old_lp, ent, vals, ref, recomputed = self._old_from_sampler(batch, ids, masks, samp)
        else:
            old_lp, ent, vals, ref = self.compute_old(ids, masks)
            recomputed = old_lp
        tm["time/old_logprob_s"] = time.perf_counter() - t1
        allm = torch.cat(masks)
        m["train/old_logprob_from_sampler"] = float(old_lp is samp)
        if recomputed is not None:  # both available: how far the sampler's are from the trainer's
            gap = (torch.cat(recomputed) - torch.cat(samp))[allm].abs()
            m["train/logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
            m["train/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
        m["train/rollout_entropy"] = float(torch.cat(ent)[allm].mean()) if allm.any() else 0.0
        t2 = time.perf_counter()
        adv, returns, am = self.compute_advantages(batch, masks, vals)
        m.update(am)
        tm["time/advantage_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        um = self.update(it, ids, masks, old_lp, adv, vals, returns, ref)
        self._weights_stale = True  # a separate engine (SGLang) loads them before it next generates
        train_tokens = um.pop("_train_tokens")
        um.pop("actor/pg_loss_micro", None)
        m.update(um)
        tm["time/update_s"] = time.perf_counter() - t3
        m["perf/train_tokens_per_s"] = train_tokens / max(tm["time/update_s"], 1e-9)
        gen = float(full.metrics.get("generated_tokens", sum(int(torch.as_tensor(x).sum()) for x in full.loss_mask)))
        m["perf/rollout_tokens_per_s"] = gen / max(tm["time/rollout_s"], 1e-9)
        m.update(tm)
        return m

    def _request_stop(self, signum, frame) -> None:
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = self.interrupted = True
        self.console.print("[yellow]Ctrl-C[/]: finishing this iteration, saving a checkpoint, then exiting "
                           "(press again to abort without saving)")

    def _save(self, it: int) -> str:
        t0 = time.perf_counter()
        path = save_checkpoint(self.out, it, model=self.model, tokenizer=self.tokenizer,
                               optimizers={"actor": self.actor_opt, **({"critic": self.critic_opt} if self.critic_opt else {})},
                               state={"last_eval": self.last_eval}, config_yaml=dump_yaml(self.cfg),
                               critic_backbone=self.critic_body, value_head=self.value_head,
                               keep=self.cfg.trainer.keep_checkpoints)
        self.console.print(f"checkpoint: {path} ({time.perf_counter() - t0:.1f} s)")
        return path

    def run(self) -> list[dict]:
        """Train; returns the metric records (also in OUT/metrics.jsonl)."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        cfg, t = self.cfg, self.cfg.trainer
        self.setup()
        total = t.iterations
        old_handler = None
        if hasattr(signal, "SIGINT") and _in_main_thread():
            old_handler = signal.signal(signal.SIGINT, self._request_stop)
        last_saved = self.start_iteration - 1
        updated, consistent = last_saved, True
        it = self.start_iteration - 1
        try:
            if self.start_iteration > total:
                self.console.print(f"[yellow]{self.out} already ran {self.start_iteration - 1} iterations "
                                   f"(trainer.iterations = {total}): nothing to train; pass --iterations N with "
                                   f"N > {self.start_iteration - 1} to train further[/]")
                return self.logger.records
            if t.eval_before_training and self.start_iteration == 1:
                ev = self.evaluate(0)
                self.last_eval = ev
                self.logger.log(0, ev)
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                          console=self.console, disable=not t.progress) as progress:
                task = progress.add_task("train", total=total, completed=self.start_iteration - 1, stats="")
                for it in range(self.start_iteration, total + 1):
                    if self._stop_requested:  # Ctrl-C before this iteration began (the initial eval)
                        self.console.print(f"stopped before iteration {it}; nothing new to save")
                        break
                    t_it = time.perf_counter()
                    consistent = False  # an error inside iteration() may leave a half-applied update
                    m = self.iteration(it)
                    updated, consistent = it, True  # the weights now hold this iteration's update
                    if self.stop_after is not None and it >= self.stop_after:
                        self._stop_requested = True
                    if t.eval_every and (it % t.eval_every == 0 or it == total):
                        ev = self.evaluate(it)
                        self.last_eval = ev
                        m.update(ev)
                    m["time/iteration_s"] = time.perf_counter() - t_it
                    m["echo_trap_warning"] = 0
                    rec = self.logger.log(it, m)
                    warn = self.echo.update(rec)
                    if warn:
                        self.logger.amend_last({"echo_trap_warning": 1})
                        self.console.print(f"[bold red]iteration {it}: {warn}[/]")
                    stats = (f"success {m['train/success_rate']:.2f} | score {m['train/score_mean']:.3f} | "
                             f"entropy {m['train/rollout_entropy']:.2f} | {m['time/iteration_s']:.0f} s/it")
                    if "eval/success_rate" in m:
                        stats += f" | eval {m['eval/success_rate']:.2f}"
                    progress.update(task, completed=it, stats=stats)
                    if not t.progress:
                        self.console.print(f"iteration {it}/{total}: {stats}")
                    if t.plots and (("eval/success_rate" in m) or it == total):
                        plot_curves(self.logger.records, os.path.join(self.out, "plots"), model_label=self.info.label)
                    if (t.save_every and it % t.save_every == 0) or it == total or self._stop_requested:
                        self._save(it)
                        last_saved = it
                    if self._stop_requested and it < total:
                        self.console.print(f"stopped after iteration {it}; resume with "
                                           f"`fastpo train --resume {self.out}`")
                        break
                    self.interrupted = False  # a Ctrl-C in the last iteration still finished the run
        except KeyboardInterrupt:
            # A second Ctrl-C: the current iteration is incomplete; keep the last saved checkpoint.
            self.console.print(f"[yellow]aborted[/]; the last checkpoint is iteration {last_saved}")
            raise
        except Exception:
            # An error after an update (eval, logging, plots, disk): keep the trained iterations.
            if consistent and updated > last_saved:
                try:
                    self._save(updated)
                    self.console.print(f"[red]error after iteration {updated}[/]: emergency checkpoint saved; "
                                       f"resume with `fastpo train --resume {self.out}`")
                except Exception as e2:  # the original error matters more than the failed save
                    self.console.print(f"[red]emergency checkpoint failed[/]: {e2}")
            raise
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            self.logger.close()
            self._shutdown_engine()
        if t.plots and self.logger.records:
            plot_curves(self.logger.records, os.path.join(self.out, "plots"), model_label=self.info.label)
        self.console.print(summary_table(self.logger.records, title=f"fastpo: {cfg.env.name}, {self.info.label}"))
        self.console.print(f"outputs in {self.out}/: metrics.jsonl, plots/, samples/, checkpoints/")
        return self.logger.records


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def train(cfg: TrainConfig, resume: bool = False, console: Any = None, overwrite: bool = False) -> list[dict]:
    """Build a Trainer and run it; prints what the CPU preset scaled down.

    A new run (resume=False) refuses an output folder that already holds a run
    (FileExistsError) unless `overwrite` is true, which clears that run first. Raises
    KeyboardInterrupt after a Ctrl-C stop, once that iteration's checkpoint is saved.
    """
    from rich.console import Console

    console = console or Console()
    if "cpu" in cfg.preset.split(","):
        console.print(f"[cyan]{cpu_preset_note(cfg)}[/]")
    trainer = Trainer(cfg, resume=resume, console=console, overwrite=overwrite)
    records = trainer.run()
    if trainer.interrupted:
        raise KeyboardInterrupt  # after the checkpoint: callers (the CLI's exit code 130) can tell
    return records


def load_run_config(out_dir: str) -> TrainConfig:
    """The configuration a run was started with (`OUT/config.yaml`).

    Raises FileNotFoundError when it is missing, ConfigError when it is not a valid configuration.
    """
    import yaml

    path = os.path.join(out_dir, "config.yaml")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {out_dir} a fastpo run folder?")
    try:
        with open(path) as f:
            d = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(d).__name__}")
    return config_from_dict(d)
