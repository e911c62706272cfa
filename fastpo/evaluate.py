"""Evaluation: success rate and pass@k on fixed seeds at the eval temperature; `fastpo eval`.

The paper evaluates on 256 fixed initial states per environment at temperature 0.5 with
episodes cut after 5 turns (RAGEN Sec. 5). pass@k uses the unbiased estimator of Chen et al.
(2021) over `group_size` samples per seed.

Evaluating a fastpo checkpoint (`fastpo eval --model runs/x`, `.../iter_000003` or its
`model/` folder) uses the settings it was trained with: `eval_config` takes `env.*` and
the rollout settings from the checkpoint's config.yaml (else the run's) unless the command
line sets them (`--env`, `--preset`, `--config`, `section.key=value`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
import types
from typing import Any, Callable, Optional

import numpy as np
import torch

from fastpo.config.schema import eval_horizon, eval_seeds
from fastpo.report.metrics import rollout_metrics
from fastpo.report.stats import finite_number, standard_error
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
    from fastpo.distributed.collectives import gather_results, on_main
    from fastpo.distributed.context import SINGLE
    from fastpo.distributed.data_parallel import split_evenly
    from fastpo.rollout.trajectory_batch import TrajectoryBatch, count_rates

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
    from fastpo.envs import make_env

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
    from fastpo.envs.mixture import shares
    from fastpo.rollout.trajectory_batch import TrajectoryBatch

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
    from fastpo.config.schema import env_members, member_rollout_config

    if cfg.env.mixture:
        from fastpo.envs.mixture import shares

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


@dataclasses.dataclass
class RunSettings:
    """What `eval_config` took from the run a checkpoint belongs to.

    checkpoint: the CheckpointRef. trained_env: the env the run trained on (None without a
    config). env: the env evaluated on. taken: dotted key -> the run's value, where it changed
    what this command would otherwise use. kept: dotted key -> (this command's value, the
    run's value) for keys the command line set explicitly. env_mismatch: env != trained_env.
    member: the label of the mixture entry evaluated alone (its options and limits carried
    over), None otherwise.
    """

    checkpoint: Any
    trained_env: Optional[str]
    env: str
    taken: dict
    kept: dict
    env_mismatch: bool
    member: Optional[str] = None

    def describe(self) -> str:
        """One line: whose settings are used, and what they changed."""
        ref = self.checkpoint
        if ref.config_path is None:
            return (f"checkpoint {ref.folder} has no config.yaml (neither its own nor its run's): evaluating with "
                    f"this command's settings")
        whose = f"run {ref.run_dir}" if ref.run_dir else f"checkpoint {ref.folder}"
        parts = [f"env {self.env}"]
        parts += [f"{k}={v!r}" for k, v in self.taken.items()]
        line = f"settings of {whose} ({ref.config_path}): " + ", ".join(parts)
        if not self.taken:
            line += " (its rollout settings match this command's)"
        if self.kept:
            line += "; kept from the command line: " + ", ".join(f"{k}={a!r} (run: {b!r})"
                                                                 for k, (a, b) in self.kept.items())
        return line

    def mismatch_note(self) -> Optional[str]:
        """A line saying the env differs from the trained one (or is one game of the trained
        mixture), or None."""
        if not self.env_mismatch:
            return None
        if self.member is not None:
            return (f"note: this checkpoint was trained on a mixture; evaluating its game {self.member!r} alone, with "
                    f"that entry's options and turn and action limits")
        return (f"note: this checkpoint was trained on {self.trained_env} and is evaluated on {self.env} as --env "
                f"asks; the run's env options and {self.trained_env}'s turn and action limits are not carried over")


def _flat_keys(d: Any, prefix: str = "") -> set[str]:
    """Dotted keys of a nested dict (lists are leaves)."""
    if not isinstance(d, dict):
        return {prefix.rstrip(".")} if prefix else set()
    out: set[str] = set()
    for k, v in d.items():
        out |= _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}"}
    return out


def _get(cfg, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


def _explicit_keys(preset: Optional[str], file: Optional[str], overrides: list[str], values: dict) -> set[str]:
    """The dotted keys the command line sets: through its presets, its config file, its
    overrides and its literal values (these keep their value over a checkpoint's settings)."""
    from fastpo.config.fields import parse_override
    from fastpo.config.files import read_config_file
    from fastpo.config.presets import PRESETS

    explicit: set[str] = set()
    for name in (preset.split(",") if preset else []):
        explicit |= _flat_keys(PRESETS.get(name.strip(), {}))
    if file:
        explicit |= _flat_keys(read_config_file(file))  # load_config read it already: it exists and is valid
    for o in overrides:
        explicit |= _flat_keys(parse_override(o))
    explicit |= _flat_keys({k: None for k in values})
    return explicit


#: The evaluation settings a checkpoint's run carries over to `fastpo eval --model RUN` (its own
#: evaluation repeated: the same seeds, samples, temperature and sampling seed).
EVAL_KEYS = ("trainer.eval_seeds", "trainer.eval_seed_offset", "trainer.eval_group_size", "trainer.eval_temperature",
             "trainer.seed")


def _trained_settings(run, eval_env: str, game=None) -> dict[str, Any]:
    """The settings a checkpoint's run config `run` carries over to an eval on `eval_env`, as
    {dotted key: value}: its evaluation settings (EVAL_KEYS), its env.options (same env only)
    and every RolloutConfig setting but `temperature`, less the turn and action limits the env
    presets fix when the env differs. `game`: the mixture entry (an EnvMember) evaluated alone,
    else the first entry named `eval_env` of a mixture run."""
    from fastpo.config.schema import RolloutConfig, env_members, env_preset, member_rollout_config
    from fastpo.envs import MIXTURE

    layer: dict[str, Any] = {k: copy.deepcopy(_get(run, k)) for k in EVAL_KEYS}
    fixed_by_env: set[str] = set()
    rollout = run.rollout
    if game is None and run.env.mixture:
        game = next((m for m in env_members(run) if m.name == eval_env), None)
    if game is not None:  # one game of a mixture run: its options and its own settings
        layer.update({f"env.options.{k}": v for k, v in game.options.items()})
        rollout = member_rollout_config(run, game)
    elif eval_env != run.env.name:
        for e in (run.env.name, eval_env):
            if e != MIXTURE:  # a mixture's games fix their settings in their entries
                fixed_by_env |= set(env_preset(e).get("rollout", {}))
    else:
        layer.update({f"env.options.{k}": v for k, v in run.env.options.items()})
    for f in dataclasses.fields(RolloutConfig):
        if f.name != "temperature" and f.name not in fixed_by_env:
            layer[f"rollout.{f.name}"] = getattr(rollout, f.name)
    return layer


def eval_config(env: Optional[str] = None, preset: Optional[str] = None, file: Optional[str] = None,
                overrides: Optional[list[str]] = None, values: Optional[dict] = None, warn=None):
    """The configuration of `fastpo eval`: `fastpo.config.load_config(env, preset, file,
    overrides, values)`, and when `model.name` is a fastpo checkpoint (its model folder, the
    checkpoint folder, or a run folder meaning its latest checkpoint) the settings it was
    trained with on top: the env (unless `--env`, `env.name=` or the file names one), its
    evaluation settings (`EVAL_KEYS`: eval seeds, their offset, samples per seed, eval
    temperature and the run's seed, which seeds the eval sampling: the run's own evaluation
    repeated), its `env.options` (same env only) and every RolloutConfig setting except
    `temperature` (eval runs at `trainer.eval_temperature`). Keys set by `preset`, `file` or
    `overrides` keep their command-line value. On another env than the trained one, the turn
    and action limits the env presets fix (bandit: 1 turn, 1 action) are not carried over; on
    one game of a mixture run (`--env frozenlake` of a run that mixed it: its first entry of
    that game; `--env LABEL` picks an entry by its label), that game's options and settings in
    the mixture are.

    A run folder whose newest checkpoints are damaged means its newest intact one; `warn`
    (a callable) gets the line naming the damage.

    Returns (TrainConfig, RunSettings or None when the model is not a fastpo checkpoint).
    Raises ConfigError (bad key or value, a run folder without a checkpoint, an unreadable
    run config) and FileNotFoundError (a missing --config file), like load_config.
    """
    from fastpo.run.origin import find_checkpoint
    from fastpo.config.schema import env_members, load_config, read_run_config, validate
    from fastpo.config.fields import ConfigError, nested_dict, apply_dict, parse_override

    overrides = list(overrides or [])
    values = dict(values or {})

    def env_options(o: str) -> bool:  # an override of env.options, valid only for the env it is meant for
        d = parse_override(o).get("env")
        return d is not None and (not isinstance(d, dict) or "options" in d)

    member = _mixture_entry(env, values.get("model.name"))  # `--env LABEL` of a mixture run's entry
    if member is not None:
        env = member.name

    # which model, before the env is known: env.options overrides wait for the checkpoint's env
    cfg = load_config(env=env, preset=preset, file=file, overrides=[o for o in overrides if not env_options(o)],
                      values=values, check_env=False)
    try:
        ref = find_checkpoint(cfg.model.name, warn=warn)
    except ValueError as e:
        raise ConfigError(f"model.name={cfg.model.name!r}: {e}") from None
    if ref is None or ref.config_path is None:
        cfg = load_config(env=env, preset=preset, file=file, overrides=overrides, values=values)
        return cfg, None if ref is None else RunSettings(ref, None, cfg.env.name, {}, {}, False)
    try:
        run = read_run_config(ref.config_path)
    except FileNotFoundError as e:  # removed since find_checkpoint saw it
        raise ConfigError(str(e)) from None

    explicit = _explicit_keys(preset, file, overrides, values)
    env_explicit = bool(env) or "env.name" in explicit
    # on the run's own env its options come along (a game may need some to be built: gym's
    # action_names); the command line's env.options overrides still win
    same_env = not env_explicit or cfg.env.name == run.env.name
    carried = dict(values)
    if same_env and "env.options" not in explicit:
        carried = {**{f"env.options.{k}": copy.deepcopy(v) for k, v in run.env.options.items()
                      if f"env.options.{k}" not in explicit}, **values}
    if same_env and run.env.mixture and "env.mixture" not in explicit:  # a mixture's games come along
        carried = {"env.mixture": copy.deepcopy(run.env.mixture), **carried}
    cfg = load_config(env=env if env_explicit else run.env.name, preset=preset, file=file, overrides=overrides,
                      values=carried)
    eval_env = cfg.env.name
    mismatch = eval_env != run.env.name

    layer = _trained_settings(run, eval_env, member)

    def is_explicit(key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:i]) in explicit for i in range(1, len(parts) + 1))

    out = copy.deepcopy(cfg)
    taken, kept = {}, {}
    for key, value in layer.items():
        current = _get(cfg, key)
        if current == value:
            continue
        if is_explicit(key):
            kept[key] = (current, value)
            continue
        apply_dict(out, nested_dict(key, copy.deepcopy(value)))
        taken[key] = value
    validate(out)
    if member is None and run.env.mixture and mismatch:  # a game of the mixture named by its env name
        member = next((m for m in env_members(run) if m.name == eval_env), None)
    return out, RunSettings(ref, run.env.name, eval_env, taken, kept, mismatch,
                            member.label if member is not None and mismatch else None)


def _mixture_entry(env: Optional[str], model: Optional[str]):
    """The entry of a mixture run's `env.mixture` whose label is `env`, when `model` is such a
    run's checkpoint (`fastpo eval --model RUN --env LABEL`: a second entry of the same game is
    picked by its label; a label, unique in its mixture, wins over a game of that name); else
    None."""
    from fastpo.run.origin import find_checkpoint
    from fastpo.config.schema import env_members, read_run_config
    from fastpo.config.fields import ConfigError

    if not env or "," in env or not isinstance(model, str):
        return None
    try:
        ref = find_checkpoint(model)
        run = read_run_config(ref.config_path) if ref is not None and ref.config_path else None
        members = env_members(run) if run is not None and run.env.mixture else []
    except (ValueError, OSError, ConfigError):  # what is wrong with it is said where it is loaded
        return None
    return next((m for m in members if m.label == env.strip()), None)


def eval_report(cfg, res: dict, settings: Optional[RunSettings] = None) -> dict:
    """The JSON record of a `fastpo eval` run: model (label, path, origin), env, the rollout
    and eval settings used, where they came from, and the metrics (without the "eval/" prefix)."""
    t = cfg.trainer
    info = res.get("model_info") or {}
    ref = settings.checkpoint if settings is not None else None
    return {
        "model": res.get("model"),
        "model_name": cfg.model.name,
        "model_path": info.get("path"),
        "model_random_weights": res.get("model_random_weights"),
        "trained_from": info.get("trained_from"),
        "checkpoint": info.get("checkpoint"),
        "iteration": info.get("iteration"),
        "env": cfg.env.name,
        "env_options": dict(cfg.env.options),
        **({"env_mixture": copy.deepcopy(cfg.env.mixture)} if cfg.env.mixture else {}),
        "trained_env": settings.trained_env if settings is not None else None,
        "settings_from": ref.config_path if ref is not None else None,
        "settings_taken": dict(settings.taken) if settings is not None else {},
        "rollout": res.get("rollout"),
        "eval": {"seeds": t.eval_seeds, "seed_offset": t.eval_seed_offset, "samples_per_seed": t.eval_group_size,
                 "temperature": t.eval_temperature, "sampling_seed": eval_sampling_seed(t.seed), "device": res.get("device")},
        "metrics": {k[len("eval/"):]: v for k, v in sorted(res.items()) if k.startswith("eval/")},
    }


def write_json(path: str, record: dict) -> str:
    """Write `record` as indented JSON to `path` (parent folders created; replaced atomically)."""
    from fastpo.run.folder import atomic_write_text

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1, default=str) + "\n")
    return path


def run_eval(cfg, console=None, samples_dir: Optional[str] = None, dist=None) -> dict:
    """`fastpo eval`: load `cfg.model.name` (name, HF id, or a fastpo checkpoint) and
    evaluate it on `cfg.trainer.eval_seeds` fixed seeds, `eval_group_size` samples each, at
    `eval_temperature`. Returns the metrics dict plus "model" (its label, e.g.
    "random:tiny-llama (random weights)"), "model_random_weights" (bool), "model_info" (the
    ModelInfo as a dict), "rollout" (the RolloutConfig used, as a dict) and "device"; the
    samples file, named after the checkpoint's iteration (iter_000000.txt for a model that
    is not a checkpoint), starts with the same label. With `dist` (a DistContext of several
    processes, e.g. `fastpo eval --nproc N`) every rank loads the model on its device and
    evaluates its share of the seeds (`evaluate_policy`); rank 0 computes the success bounds
    and writes the samples, and every rank gets the result."""
    from fastpo.distributed.collectives import on_main
    from fastpo.distributed.context import SINGLE
    from fastpo import rollout as ro
    from fastpo.report.metrics import write_samples
    from fastpo.model_loading import load_model_checked, resolve_device

    t = cfg.trainer
    ctx = dist if dist is not None else SINGLE
    device = ctx.device if ctx.initialized else resolve_device(t.device)
    model, tok, info = load_model_checked(cfg.model.name, device=str(device),
                                                dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype)
    rcfg = cfg.rollout.rollout_config(temperature=t.eval_temperature)
    rollout = ro.MultiTurnRollout.from_config(cfg, ro.NativeEngine(model, tok), tok)
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


class _CallableModule(types.ModuleType):
    """This module, callable: the public API's `fastpo.evaluate(cfg)` runs `run_eval(cfg)`
    (the API name and the module of evaluation helpers share the name `fastpo.evaluate`,
    and a submodule import rebinds the package attribute to the module)."""

    def __call__(self, cfg, console=None, samples_dir: Optional[str] = None) -> dict:
        return run_eval(cfg, console=console, samples_dir=samples_dir)


sys.modules[__name__].__class__ = _CallableModule
