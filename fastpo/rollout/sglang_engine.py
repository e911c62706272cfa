"""Optional SGLang backend behind the native engine's session interface (GPU only).

    pip install "fastpo[sglang]"          # needs CUDA
    from fastpo.rollout.sglang_engine import SGLangEngine
    engine = SGLangEngine(model_path, tokenizer)          # or SGLangEngine.from_model(model, tokenizer, folder)
    rollout = MultiTurnRollout(engine, tokenizer, "sokoban", {}, cfg)
    ...
    engine.update_weights(model)                           # after each training step

Token ids in, output ids and log-probs out (``sglang.Engine`` offline mode, the tokenizer
is used only for stop strings). Each turn sends every session's full token history; the
radix (prefix) cache, on by default, finds the group's shared prompt and each session's
previous turns already cached, so only new tokens are prefilled — the same saving the
native engine gets from keeping its KV caches. ``stats["prefilled_tokens"]`` counts the
tokens SGLang actually computed (prompt tokens minus cached tokens).

Differences from the native engine, by SGLang's design: sampling is not reproducible
from a seed; weights are a separate copy that ``update_weights`` refreshes through
``update_weights_from_tensor``; ``release_memory`` / ``resume_memory`` free and restore
the engine's GPU memory (weights and KV cache) between rollout and training when the
engine was built with ``enable_memory_saver=True`` (the default here).

Log-prob convention (the recorded ``TurnOutput.logprobs``). NativeEngine records
log softmax(z / T) over the full vocabulary at the sampling temperature T, whatever top-p /
top-k did (T = 1 when greedy): the quantity the trainer recomputes. SGLang's sampler
(sglang/srt/layers/sampler.py, read for this note, 2025 versions) returns instead:
  - by default, log p_T(x) renormalised over the top-p nucleus of p_T = softmax(z / T)
    (top-k is applied to the draw only), so with top_p = 1 it equals fastpo's convention
    (any top_k), and with top_p < 1 it is higher by -log(nucleus mass) >= 0 nats;
  - with the environment variable SGLANG_RETURN_ORIGINAL_LOGPROB set, log softmax(z), i.e.
    at temperature 1, which differs from fastpo's whenever T != 1;
  - greedy (T = 0): log softmax(z), as fastpo.
Other SGLang versions may differ. fastpo's trainer recomputes the old log-probs itself, so
this changes only the rollout-vs-trainer log-prob diagnostic, not the loss; but to keep the
two engines' records comparable, `SGLangEngine.generate` warns once when it is used with
top_p < 1, or with T != 1 while SGLANG_RETURN_ORIGINAL_LOGPROB is set.

Verified: nowhere yet (no machine with SGLang and CUDA was available while this was
written); tests/unit/rollout/test_rollout_sglang.py runs wherever both are importable.
"""
from __future__ import annotations

import os
import time
import warnings

import torch

from .engine import STOP_CONTEXT, STOP_EOT, STOP_LENGTH, STOP_STRING, TurnOutput
from .sampling import SamplingParams


def sglang_available() -> bool:
    """True when sglang imports and CUDA is available."""
    if not torch.cuda.is_available():
        return False
    try:
        import sglang  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return True


class SGLangEngine:
    """Session interface (start / generate / finish / session_length / stats) on sglang.Engine.

    Args:
        model_path: an HF model folder (or hub id) for sglang to load.
        tokenizer: the HF tokenizer (for the pad id in stats and nothing else).
        engine: an existing ``sglang.Engine`` to use instead of starting one.
        mem_fraction_static: GPU memory share for weights + KV cache (shared with training).
        **engine_kwargs: passed to ``sglang.Engine`` (e.g. dtype="bfloat16").
    Raises ImportError with the install command when sglang or CUDA is missing.
    """

    def __init__(self, model_path: str | None = None, tokenizer=None, engine=None, mem_fraction_static: float = 0.4,
                 **engine_kwargs):
        if engine is None:
            if not torch.cuda.is_available():
                raise ImportError("the SGLang backend needs CUDA; use NativeEngine on this machine")
            try:
                import sglang
            except Exception as e:
                raise ImportError(f"the SGLang backend needs sglang: pip install 'fastpo[sglang]' ({e})") from e
            if not model_path:
                raise ValueError("SGLangEngine needs model_path (an HF model folder) or an existing engine")
            kw = dict(model_path=model_path, mem_fraction_static=mem_fraction_static, enable_memory_saver=True,
                      disable_radix_cache=False)
            kw.update(engine_kwargs)
            engine = sglang.Engine(**kw)
        self.sgl = engine
        self.tokenizer = tokenizer
        self.device = torch.device("cuda")
        self._hist: dict = {}
        self._warned_logprobs = False
        self.reset_stats()

    @classmethod
    def from_model(cls, model, tokenizer, folder: str, **kwargs) -> "SGLangEngine":
        """Save `model` and `tokenizer` to `folder` (HF format) and start an engine on it."""
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        return cls(folder, tokenizer, **kwargs)

    def reset_stats(self) -> None:
        """Zero the token and time counters."""
        self.stats = {"prefilled_tokens": 0, "generated_tokens": 0, "forward_passes": 0, "seconds": 0.0}

    def start(self, prompts: list, group_size: int = 1) -> None:
        """Open len(prompts) * group_size sessions (session s continues prompt s // group_size)."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        self._hist = {s: list(prompts[s // group_size]) for s in range(len(prompts) * group_size)}

    def session_length(self, session: int) -> int:
        """Tokens in `session` so far."""
        return len(self._hist[session])

    def finish(self) -> None:
        """Release all sessions (the engine keeps running)."""
        self._hist = {}

    def _check_logprob_convention(self, params: SamplingParams) -> None:
        """Warn once when SGLang's recorded log-probs will differ from NativeEngine's (module docstring)."""
        if self._warned_logprobs:
            return
        original = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes")
        why = None
        if original and params.temperature not in (0, 1):
            why = (f"SGLANG_RETURN_ORIGINAL_LOGPROB is set, so SGLang records log-probs at temperature 1, "
                   f"not at the sampling temperature {params.temperature}")
        elif not original and params.temperature != 0 and params.top_p < 1:
            why = (f"top_p={params.top_p} < 1: SGLang records log-probs renormalised over the top-p nucleus, "
                   f"NativeEngine over the full vocabulary")
        if why:
            self._warned_logprobs = True
            warnings.warn(f"SGLangEngine: {why}; the recorded sample log-probs are not comparable with "
                          f"the trainer's (the loss is unaffected: it recomputes them)", stacklevel=3)

    def generate(self, sessions: list, append: list | None, params: SamplingParams, generator=None) -> list:
        """Same contract as NativeEngine.generate; `generator` is ignored (SGLang seeds itself).

        Sessions not listed and sessions refused for the context limit are closed, as in
        NativeEngine. The recorded log-probs follow SGLang's convention (module docstring).
        """
        if len(set(sessions)) != len(sessions) or any(s not in self._hist for s in sessions):
            raise ValueError(f"sessions must be distinct open session ids, got {sessions!r:.200}")
        append = append if append is not None else [[] for _ in sessions]
        if len(append) != len(sessions):
            raise ValueError(f"append has {len(append)} entries for {len(sessions)} sessions")
        self._check_logprob_convention(params)
        outputs = [TurnOutput([], [], STOP_CONTEXT) for _ in sessions]
        run, inputs, sps = [], [], []
        for i, s in enumerate(sessions):
            n = len(self._hist[s]) + len(append[i])
            if n + 1 > params.max_context:
                continue
            self._hist[s].extend(append[i])
            run.append(i)
            inputs.append(list(self._hist[s]))
            sps.append({
                "temperature": float(params.temperature), "top_p": float(params.top_p),
                "top_k": int(params.top_k) if params.top_k else -1,
                "max_new_tokens": int(min(params.max_new_tokens, params.max_context - n)),
                "stop_token_ids": list(params.stop_token_ids), "stop": list(params.stop_strings),
                "no_stop_trim": True, "skip_special_tokens": False,
            })
        # Sessions not listed, and refused ones, are closed (as NativeEngine does).
        keep = {sessions[i] for i in run}
        for s in [s for s in self._hist if s not in keep]:
            del self._hist[s]
        if not run:
            return outputs
        t0 = time.perf_counter()
        res = self.sgl.generate(input_ids=inputs, sampling_params=sps, return_logprob=True)
        self.stats["seconds"] += time.perf_counter() - t0
        for i, r, sp in zip(run, res, sps):
            meta = r["meta_info"]
            lp = meta.get("output_token_logprobs") or []
            ids = [int(t[1]) for t in lp] if lp else list(r.get("output_ids", []))
            lps = [float(t[0]) if t[0] is not None else 0.0 for t in lp] if lp else [0.0] * len(ids)
            fin = meta.get("finish_reason") or {}
            kind = fin.get("type") if isinstance(fin, dict) else str(fin)
            if kind == "length":
                reason = STOP_LENGTH if sp["max_new_tokens"] == params.max_new_tokens else STOP_CONTEXT
            elif isinstance(fin, dict) and isinstance(fin.get("matched"), str):
                reason = STOP_STRING
            else:
                reason = STOP_EOT
            s = sessions[i]
            self._hist[s].extend(ids)
            outputs[i] = TurnOutput(ids, lps, reason)
            self.stats["generated_tokens"] += len(ids)
            self.stats["prefilled_tokens"] += int(meta.get("prompt_tokens", 0)) - int(meta.get("cached_tokens", 0))
        self.stats["forward_passes"] += 1
        return outputs

    def update_weights(self, model) -> None:
        """Push `model`'s current weights into the engine (after a training step)."""
        named = [(n, p.detach()) for n, p in model.state_dict().items()]
        self.sgl.update_weights_from_tensor(named_tensors=named, flush_cache=True)

    def release_memory(self) -> None:
        """Free the engine's GPU memory for training (if the engine supports it)."""
        fn = getattr(self.sgl, "release_memory_occupation", None)
        if fn is not None:
            fn()

    def resume_memory(self) -> None:
        """Take the GPU memory back before the next rollout (if the engine supports it)."""
        fn = getattr(self.sgl, "resume_memory_occupation", None)
        if fn is not None:
            fn()

    def shutdown(self) -> None:
        """Stop the engine's processes."""
        self.sgl.shutdown()
