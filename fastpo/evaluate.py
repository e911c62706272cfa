"""Evaluation: success rate and pass@k on fixed seeds at the eval temperature; `fastpo eval`.

The paper evaluates on 256 fixed initial states per environment at temperature 0.5 with
episodes cut after 5 turns (RAGEN Sec. 5). pass@k uses the unbiased estimator of Chen et al.
(2021) over `group_size` samples per seed.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import numpy as np
import torch

from fastpo.metrics import rollout_metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k) for n samples with c successes."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate_policy(rollout, seeds: list[int], group_size: int, temperature: float, seed: int = 0,
                    chunk: int = 64, autocast=contextlib.nullcontext, model: Optional[torch.nn.Module] = None) -> dict:
    """Run the rollout on fixed `seeds` (group_size samples each) and score it.

    Returns {"eval/success_rate", "eval/score_mean", "eval/pass@1", "eval/pass@k" (k = group_size),
    ... rollout metrics ..., "_batch": the first chunk's TrajectoryBatch (for samples)}.
    Seeds run `chunk` at a time to bound memory.
    """
    if model is not None:
        model.eval()
    succ = []
    metrics_acc: dict[str, list] = {}
    first = None
    for s in range(0, len(seeds), chunk):
        part = seeds[s:s + chunk]
        with torch.no_grad(), autocast():
            b = rollout.generate(part, group_size, temperature=temperature, seed=seed + s)
        if first is None:
            first = b
        for k, v in rollout_metrics(b, prefix="eval").items():
            metrics_acc.setdefault(k, []).append((v, len(part)))
        ok = b.success.bool()
        for g in torch.unique(b.group_ids).tolist():
            succ.append(ok[b.group_ids == g].tolist())
    res = {k: sum(v * w for v, w in vals) / sum(w for _, w in vals) for k, vals in metrics_acc.items()}
    n = group_size
    res["eval/pass@1"] = float(np.mean([pass_at_k(len(x), sum(x), 1) for x in succ]))
    if n > 1:
        res[f"eval/pass@{n}"] = float(np.mean([pass_at_k(len(x), sum(x), n) for x in succ]))
    res["eval/num_seeds"] = len(seeds)
    res["_batch"] = first
    return res


def run_eval(cfg, console=None, samples_dir: Optional[str] = None) -> dict:
    """`fastpo eval`: load `cfg.model.name` (name, HF id, or a checkpoint's model folder) and
    evaluate it on `cfg.trainer.eval_seeds` fixed seeds, `eval_group_size` samples each, at
    `eval_temperature`. Returns the metrics dict plus "model" (its label, e.g.
    "random:tiny-llama (random weights)") and "model_random_weights" (bool); the samples
    file starts with the same label."""
    import time

    from fastpo import rollout as ro
    from fastpo.metrics import write_samples
    from fastpo.trainer import load_model_checked, resolve_device

    t = cfg.trainer
    device = resolve_device(t.device)
    model, tok, info = load_model_checked(cfg.model.name, device=str(device),
                                                dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype)
    rcfg = cfg.rollout.rollout_config(temperature=t.eval_temperature)
    rollout = ro.MultiTurnRollout(ro.NativeEngine(model, tok), tok, cfg.env.name, dict(cfg.env.options), rcfg)
    seeds = [t.eval_seed_offset + i for i in range(t.eval_seeds)]
    if console is not None:
        console.print(f"evaluating {info.label} on {cfg.env.name}: {len(seeds)} seeds x {t.eval_group_size} "
                      f"samples, temperature {t.eval_temperature}, {rcfg.max_turns} turns")
    t0 = time.perf_counter()
    res = evaluate_policy(rollout, seeds, t.eval_group_size, t.eval_temperature, seed=t.seed + 12345, model=model)
    res["eval/seconds"] = time.perf_counter() - t0
    batch = res.pop("_batch")
    if samples_dir:
        path = write_samples(samples_dir, 0, batch.texts()[: max(1, t.num_samples)],
                             header=f"eval of {info.label}: success rate {res['eval/success_rate']:.3f}",
                             model_label=info.label)
        if console is not None:
            console.print(f"samples: {path}")
    res["model"] = info.label
    res["model_random_weights"] = bool(info.random)
    return res
