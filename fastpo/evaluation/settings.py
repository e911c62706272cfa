"""`fastpo eval`'s configuration and its JSON record.

Evaluating a fastpo checkpoint (`fastpo eval --model runs/x`, `.../iter_000003` or its
`model/` folder) uses the settings it was trained with: `eval_config` takes `env.*` and
the rollout settings from the checkpoint's config.yaml (else the run's) unless the command
line sets them (`--env`, `--preset`, `--config`, `section.key=value`); `RunSettings` says what
it took. `eval_report` is the record `fastpo eval --json` writes. Nothing here loads a model
or torch, so the command refuses bad input before either loads.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

from fastpo.config.fields import ConfigError, apply_dict, nested_dict, parse_override
from fastpo.config.files import read_config_file
from fastpo.config.presets import PRESETS
from fastpo.config.schema import RolloutConfig
from fastpo.config.members import env_members, env_preset, member_rollout_config
from fastpo.config.loading import load_config, read_run_config
from fastpo.config.validation import validate
from fastpo.envs import MIXTURE
from fastpo.run.origin import find_checkpoint
from fastpo.seeds import eval_sampling_seed


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
