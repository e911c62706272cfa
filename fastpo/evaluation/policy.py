"""The evaluation of a policy: success rate and pass@k on fixed seeds at the eval temperature,
shared by training (`evaluate_config`, each evaluation of a run) and `fastpo eval` (`run_eval`:
a model by name, an HF id or a fastpo checkpoint; `fastpo.evaluate` in the public API).

The paper evaluates on 256 fixed initial states per environment at temperature 0.5 with
episodes cut after 5 turns (RAGEN Sec. 5). pass@k uses the unbiased estimator of Chen et al.
(2021) over `group_size` samples per seed. The success curve's floor and ceiling on the same
seeds are the environment's own random and optimal policies (`success_bounds`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from fastpo.config.members import env_members, member_rollout_config

from fastpo.config.schema import eval_horizon, eval_seeds
from fastpo.distributed.collectives import gather_results, on_main
from fastpo.distributed.context import SINGLE
from fastpo.distributed.data_parallel import split_evenly
from fastpo.envs import make_env
from fastpo.envs.mixture import shares
from fastpo.model_loading import load_model_checked, resolve_device
from fastpo.report.metrics import rollout_metrics, write_samples
from fastpo.report.stats import finite_number, standard_error
from fastpo.rollout import MultiTurnRollout, NativeEngine
from fastpo.rollout.trajectory_batch import TrajectoryBatch, count_rates
from fastpo.seeds import eval_sampling_seed


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k) for n samples with c successes."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def format_valid_per_trajectory(batch) -> torch.Tensor:
    """float32 [B]: the share of each trajectory's turns without the format penalty
    (`TrajectoryBatch.format_valid`)."""
    return batch.format_valid()


def _outcomes(batch):
    """`batch` without what the evaluation's metrics do not read (the per-token log-probs,
    entropies, values and turn indices, the response texts and messages, the tokenizer), so
    that the chunks held until the end, and sent to rank 0, stay small."""
    return dataclasses.replace(batch, sample_logprobs=[], turn_index=[], sample_entropies=[], sample_values=[],
                               context_turns=[], visible_from=[], responses=[], response_texts=[],
                               user_messages=[], turn_stop_reasons=[], tokenizer=None)


def evaluate_policy(rollout, seeds: list[int], group_size: int, temperature: float, seed: int = 0,
                    chunk: int = 64, autocast=contextlib.nullcontext, model: Optional[torch.nn.Module] = None,
                    dist=None) -> dict:
    """Run the rollout on fixed `seeds` (group_size samples each) and score it.

    Each seed's env group samples from its own stream, seeded by (`seed`, the seed's index in
    `seeds`) (`fastpo.seeds.group_sampling_seed`), so a seed's trajectories do not depend on
    which other seeds share its batch, the chunk it falls in or the process that plays it.
    With `dist` (a `fastpo.distributed.context.DistContext` of several processes) the seeds are
    split over the ranks in contiguous blocks (`split_evenly`: sizes differ by at most one,
    a rank may get none), each rank rolls out its block with its own (whole) model, and the
    trajectories are gathered to rank 0, which computes the metrics on their concatenation
    in seed order: the same per-trajectory results and the same metrics as one process
    evaluating every seed, except the engine's cost figures (seconds, tokens per second,
    prefilled tokens, peak KV-cache bytes). Every rank must call it (it is collective) and
    gets the same metrics back; an exception on any rank is raised on every rank.

    Returns {"eval/success_rate", "eval/score_mean", "eval/pass@1", "eval/pass@k" (k = group_size),
    ... rollout metrics of all trajectories (`rollout_metrics`; the engine's action and turn
    rates from the per-trajectory counts, `count_rates`) ..., "eval/format_valid" (1 - the
    format-penalty rate: the mean over trajectories of the share of their turns without the
    format penalty), the standard errors "eval/success_rate_se", "eval/score_mean_se",
    "eval/format_valid_se" (sample std / sqrt(n) over the n = len(seeds) x group_size
    trajectories), "_batch": the TrajectoryBatch of the first seeds (the first chunk of rank
    0's share, for samples; None on the other ranks), "_per_trajectory": {"seed", "success_rate", "score_mean",
    "format_valid"}: one list entry per trajectory, in seed order, "_ranks": per rank
    {"seeds": how many it evaluated, "seconds": its rollout time}}. Seeds run `chunk` at a
    time to bound memory.
    """
    ctx = dist if dist is not None else SINGLE
    if model is not None:
        model.eval()
    share = split_evenly(len(seeds), ctx.world_size, ctx.rank)

    first: dict = {}

    def roll_share() -> tuple:
        t0, parts = time.perf_counter(), []
        for s in range(share.start, share.stop, chunk):
            idx = list(range(s, min(s + chunk, share.stop)))
            with torch.no_grad(), autocast():
                b = rollout.generate([seeds[i] for i in idx], group_size, temperature=temperature, seed=seed,
                                     group_ids=idx)
            if s == 0:  # the first seeds, kept whole here (rank 0) for the samples
                first["batch"] = b
            parts.append(_outcomes(b))
        return parts, {"seeds": len(share), "seconds": time.perf_counter() - t0}

    shares = gather_results(ctx, roll_share)

    def summarize() -> dict:
        whole = TrajectoryBatch.concat([b for parts, _ in shares for b in parts])  # seed order
        whole.metrics.update(count_rates(whole))
        res = rollout_metrics(whole, prefix="eval")
        ok = whole.success.bool()
        per_traj = {"success_rate": ok.float().tolist(), "score_mean": whole.scores.float().tolist(),
                    "format_valid": format_valid_per_trajectory(whole).tolist()}
        res["eval/format_valid"] = float(np.mean(per_traj["format_valid"]))
        for k, xs in per_traj.items():
            res[f"eval/{k}_se"] = standard_error(xs)
        succ = [ok[whole.group_ids == g].tolist() for g in range(len(seeds))]
        n = group_size
        res["eval/pass@1"] = float(np.mean([pass_at_k(len(x), sum(x), 1) for x in succ]))
        if n > 1:
            res[f"eval/pass@{n}"] = float(np.mean([pass_at_k(len(x), sum(x), n) for x in succ]))
        res["eval/num_seeds"] = len(seeds)
        res["_per_trajectory"] = {"seed": [int(x) for x in whole.seeds.tolist()], **per_traj}
        res["_ranks"] = [info for _, info in shares]
        return res

    res = on_main(ctx, summarize)
    res["_batch"] = first.get("batch")
    return res


def success_bounds(env_name: str, env_options: dict, seeds, horizon: int) -> dict:
    """The ceiling and floor of a success curve on these seeds: {"eval/optimal_success": the
    best policy's mean success probability, "eval/random_success": the uniformly random
    policy's} within `horizon` actions (see `eval_horizon`), from the environment's own
    `optimal_success` / `random_success` (FrozenLake: exact value iteration; Sokoban: exact
    breadth-first search, and a Monte-Carlo estimate for the random policy; Bandit: 1 and
    1/2; a plain-Python game: its own, where it defines them). A line the env cannot give is
    left out (the tables then say it is not known). Raises what those raise (ValueError for a
    bad horizon or seed, RuntimeError when a Sokoban search outgrows its state cap).
    """
    env = make_env(env_name, 1, dict(env_options))
    out = {}
    for key, which in (("eval/optimal_success", "optimal_success"), ("eval/random_success", "random_success")):
        if getattr(env, "has_bound", lambda w: True)(which):
            out[key] = float(np.mean(getattr(env, which)(seeds, horizon)))
    return out


def evaluate_config(rollout, cfg, autocast=contextlib.nullcontext,
                    model: Optional[torch.nn.Module] = None, dist=None) -> tuple[dict, Any]:
    """The evaluation of TrainConfig `cfg` that training and `fastpo eval` share:
    `evaluate_policy` on `eval_seeds(cfg)`, trainer.eval_group_size samples each, at
    trainer.eval_temperature with the run's eval sampling seed; with `dist` (several
    processes) the seeds are shared out over the ranks (collective). Returns (metrics, the
    first chunk's TrajectoryBatch for samples, None on ranks other than 0)."""
    t = cfg.trainer
    if getattr(rollout, "mixed", False):
        return evaluate_mixture(rollout, cfg, autocast=autocast, model=model, dist=dist)
    res = evaluate_policy(rollout, eval_seeds(cfg), t.eval_group_size, t.eval_temperature,
                          seed=eval_sampling_seed(t.seed), autocast=autocast, model=model, dist=dist)
    return res, res.pop("_batch")


#: Evaluation figures of a mixture's games that add up (the engine's costs) or take the max.
_SUMMED = ("seconds", "engine_seconds", "prefilled_tokens", "generated_tokens")
_MAXED = ("peak_kv_bytes", "peak_kv_token_bytes")


def evaluate_mixture(rollout, cfg, autocast=contextlib.nullcontext, model: Optional[torch.nn.Module] = None,
                     dist=None) -> tuple[dict, Any]:
    """`evaluate_config` of a rollout over several games (env.mixture): each game on every eval
    seed (`evaluate_policy` of `rollout.only(label)`), its figures as `eval/<label>/<metric>`,
    and the mixture's whole as the plain `eval/<metric>`: the weighted mean over the games
    (weights w_k = weight / sum of weights, the training draw's shares), its standard error
    sqrt(sum w_k^2 SE_k^2); the engine's costs summed. `_per_trajectory` concatenates the
    games' outcomes (game by game) with `env` (each trajectory's label) and `weight`
    (w_k / n_k, so a weighted sum of outcomes is the whole). Returns (metrics, the games'
    first chunks concatenated, for samples; None on ranks other than 0)."""
    t = cfg.trainer
    members = [m for m, _ in rollout.members]
    w = shares(members)
    per_game, batches, per_traj, ranks = {}, [], {}, None
    for m, wk in zip(members, w):
        res = evaluate_policy(rollout.only(m.label), eval_seeds(cfg), t.eval_group_size, t.eval_temperature,
                              seed=eval_sampling_seed(t.seed), autocast=autocast, model=model, dist=dist)
        if res.get("_batch") is not None:
            batches.append(res.pop("_batch"))
        res.pop("_batch", None)
        got = res.pop("_ranks", None)
        ranks = got if ranks is None else [{k: a[k] + b[k] for k in a} for a, b in zip(ranks, got)]
        pt = res.pop("_per_trajectory", None)
        if pt is not None:
            n = len(pt["seed"])
            for k, v in {**pt, "env": [m.label] * n, "weight": [float(wk) / n] * n}.items():
                per_traj.setdefault(k, []).extend(v)
        per_game[m.label] = res
    out = {}
    for label, res in per_game.items():
        out.update({k.replace("eval/", f"eval/{label}/", 1): v for k, v in res.items()})
    out.update(_weighted_whole(list(per_game.values()), w))
    out["eval/num_seeds"] = len(eval_seeds(cfg))
    if per_traj:
        out["_per_trajectory"] = per_traj
    out["_ranks"] = ranks or []
    return out, (TrajectoryBatch.concat(batches) if batches else None)


def _weighted_whole(results: list, w) -> dict:
    """The mixture's `eval/<metric>` from its games' `results` (dicts of eval/ keys) with shares
    `w`: keys every game has, weighted means (standard errors: sqrt(sum w^2 SE^2)), the
    engine's costs summed or maxed, tokens per second recomputed."""
    keys = [k for k in results[0] if all(finite_number(r.get(k)) for r in results)]
    out = {}
    for k in keys:
        xs = np.asarray([float(r[k]) for r in results])
        name = k.split("/", 1)[1]
        if name in _SUMMED:
            out[k] = float(xs.sum())
        elif name in _MAXED:
            out[k] = float(xs.max())
        elif name.endswith("_se"):
            out[k] = float(np.sqrt(np.sum((np.asarray(w) * xs) ** 2)))
        else:
            out[k] = float(np.dot(w, xs))
    if "eval/generated_tokens" in out and out.get("eval/seconds"):
        out["eval/tokens_per_s"] = out["eval/generated_tokens"] / out["eval/seconds"]
    return out


def config_success_bounds(cfg, warn: Optional[Callable[[str], None]] = None) -> dict:
    """`success_bounds` of `cfg`'s env on its eval seeds and horizon (a mixture: of each game,
    as `eval/<label>/optimal_success` etc., and the weighted whole where every game has the
    line). With `warn`, a Sokoban search past its state cap (RuntimeError) is said through it
    and gives {} (no bounds); without, it is raised."""
    if cfg.env.mixture:
        members = env_members(cfg)
        per = []
        out = {}
        for m in members:
            got = _bounds_or_warn(m.name, m.options, eval_seeds(cfg), eval_horizon(member_rollout_config(cfg, m)),
                                  warn, f"eval/{m.label}/")
            out.update({k.replace("eval/", f"eval/{m.label}/", 1): v for k, v in got.items()})
            per.append(got)
        w = shares(members)
        for key in ("eval/optimal_success", "eval/random_success"):
            if all(key in g for g in per):
                out[key] = float(np.dot(w, [g[key] for g in per]))
        return out
    return _bounds_or_warn(cfg.env.name, cfg.env.options, eval_seeds(cfg), eval_horizon(cfg.rollout), warn, "eval/")


def _bounds_or_warn(name: str, options: dict, seeds, horizon: int, warn, prefix: str) -> dict:
    try:
        return success_bounds(name, options, seeds, horizon)
    except RuntimeError as e:
        if warn is None:
            raise
        warn(f"no {prefix}optimal_success or {prefix}random_success: {e}")
        return {}


def run_eval(cfg, console=None, samples_dir: Optional[str] = None, dist=None) -> dict:
    """`fastpo eval` without its command line (the public API's `fastpo.evaluate(cfg)`): load
    `cfg.model.name` (name, HF id, or a fastpo checkpoint) and evaluate it on `cfg.trainer.eval_seeds` fixed seeds, `eval_group_size` samples each, at
    `eval_temperature`. Returns the metrics dict plus "model" (its label, e.g.
    "random:tiny-llama (random weights)"), "model_random_weights" (bool), "model_info" (the
    ModelInfo as a dict), "rollout" (the RolloutConfig used, as a dict) and "device"; the
    samples file, named after the checkpoint's iteration (iter_000000.txt for a model that
    is not a checkpoint), starts with the same label. With `dist` (a DistContext of several
    processes, e.g. `fastpo eval --nproc N`) every rank loads the model on its device and
    evaluates its share of the seeds (`evaluate_policy`); rank 0 computes the success bounds
    and writes the samples, and every rank gets the result."""
    t = cfg.trainer
    ctx = dist if dist is not None else SINGLE
    device = ctx.device if ctx.initialized else resolve_device(t.device)
    model, tok, info = load_model_checked(cfg.model.name, device=str(device),
                                          dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype)
    rcfg = cfg.rollout.rollout_config(temperature=t.eval_temperature)
    rollout = MultiTurnRollout.from_config(cfg, NativeEngine(model, tok), tok)
    seeds = eval_seeds(cfg)
    if console is not None:
        procs = f" in {ctx.world_size} processes" if ctx.world_size > 1 else ""
        console.print(f"evaluating {info.label} on {cfg.env.name}: {len(seeds)} seed{'s' if len(seeds) != 1 else ''} x {t.eval_group_size} "
                      f"sample{'s' if t.eval_group_size != 1 else ''}, temperature {t.eval_temperature}, "
                      f"{rcfg.max_turns} turn{'s' if rcfg.max_turns != 1 else ''}, {rcfg.max_new_tokens} new "
                      f"tokens/turn, {'think' if rcfg.think else 'answer-only'} prompt{procs}")
    t0 = time.perf_counter()
    res, batch = evaluate_config(rollout, cfg, model=model, dist=ctx)
    res["eval/seconds"] = time.perf_counter() - t0
    res.pop("_per_trajectory")
    res.pop("_ranks")

    def finish() -> dict:
        res.update(config_success_bounds(cfg))
        if samples_dir:
            it = info.iteration if info.iteration is not None else 0
            path = write_samples(samples_dir, it, batch.texts()[: max(1, t.num_samples)],
                                 header=f"eval of {info.label}: success rate {res['eval/success_rate']:.3f}",
                                 model_label=info.label)
            if console is not None:
                console.print(f"samples: {path}")
        return res

    res = on_main(ctx, finish)
    res["model"] = info.label
    res["model_random_weights"] = bool(info.random)
    res["model_info"] = dataclasses.asdict(info)
    res["rollout"] = dataclasses.asdict(rcfg)
    res["device"] = str(device)
    return res
