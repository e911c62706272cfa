"""Loading a training configuration. A configuration is built in layers, each checked before
any model loads (`load_config`):

    defaults -> named presets (paper | cpu | starpo | grpo ...) -> environment preset
             -> YAML file -> dotted command-line overrides (``algorithm.adv_estimator=grpo``)

then validated (fastpo.config.validation). A run's saved configuration is read back with
`read_run_config`, `load_run_config` and `config_from_dict` (older run folders' sft.yaml and
dagger.yaml included: `legacy_sections`). Errors are `ConfigError` (a `ValueError`) naming the
key."""
from __future__ import annotations

import os
import re
from typing import Optional

from fastpo.config.fields import ConfigError, apply_dict, nested_dict, parse_override
from fastpo.config.files import dig, parse_config_yaml, read_config_file
from fastpo.config.imitation import OPTIONAL_SECTIONS, add_sections
from fastpo.config.members import env_preset
from fastpo.config.presets import PRESETS, default_preset
from fastpo.config.schema import TrainConfig
from fastpo.config.validation import validate

#: The commands that read each optional section (said when another command is given one).
READ_BY = {"sft": "fastpo sft and fastpo dagger", "dagger": "fastpo dagger"}
#: Where a run folder made before config.yaml held these sections kept them (still read).
LEGACY_FILES = {"sft.yaml": ("sft",), "dagger.yaml": ("dagger", "sft")}


def load_config(env: Optional[str] = None, preset: Optional[str] = None, file: Optional[str] = None,
                overrides: Optional[list[str]] = None, values: Optional[dict] = None,
                check_env: bool = True, sections: tuple = ()) -> TrainConfig:
    """Build and validate a TrainConfig: defaults -> named presets -> env preset -> YAML -> overrides.

    `preset` may be several comma-separated names applied in order (e.g. "cpu,grpo"); None
    means `default_preset()`. A YAML file may itself name `env` and `preset`; the command
    line's win. `values` maps dotted keys to values taken literally, not parsed as YAML (what
    --model and --out give: a path may hold '#', ':' or digits only); applied before `overrides`.
    `sections`: the optional sections the command reads ("sft", "dagger";
    fastpo.config.imitation), present with their defaults before the presets; a layer that
    sets another one is refused.
    Raises ConfigError (ValueError) naming the bad key or value; FileNotFoundError
    for a missing file.
    """
    file_dict = read_config_file(file) if file else {}
    override_dicts = [parse_override(o) for o in (overrides or [])]
    refuse_sections(file_dict, sections, f"config file {file}")
    for o, d in zip(overrides or [], override_dicts):
        refuse_sections(d, sections, f"override {o!r}")
    for key in values or {}:
        refuse_sections(nested_dict(key, None), sections, f"value of {key}")
    for d in override_dicts:
        if "preset" in d:  # applying it would only relabel the run, not apply the preset's settings
            raise ConfigError(f"override 'preset={d['preset']}': presets are chosen with --preset NAME[,NAME...] "
                              "(or `preset:` in a config file), not as a dotted override")
    for d in (file_dict, *override_dicts):  # empty would silently mean the default folder
        out = d.get("trainer") if isinstance(d.get("trainer"), dict) else {}
        if "output_dir" in out and (out["output_dir"] is None or not str(out["output_dir"]).strip()):
            raise ConfigError(f"config key 'trainer.output_dir' = {out['output_dir']!r}: must name a folder "
                              "(leave it out for runs/<env>)")
    from fastpo.envs import MIXTURE

    named = env or dig(override_dicts, ("env", "name")) or (file_dict.get("env") or {}).get("name")
    if named is not None and not isinstance(named, str):
        raise ConfigError(f"config key 'env.name' = {named!r}: must be an environment name")
    listed = [n.strip() for n in named.split(",")] if named and "," in named else None  # --env a,b: a mixture
    if listed is not None:
        named = MIXTURE
    if env and isinstance(file_dict.get("env"), dict):  # --env wins over the file's game(s), as over its name
        file_dict["env"].pop("mixture", None)
    mixed = listed or dig(override_dicts, ("env", "mixture")) or (values or {}).get("env.mixture") \
        or (file_dict.get("env") or {}).get("mixture")
    if mixed and named is not None and named != MIXTURE:
        raise ConfigError(f"config key 'env.name' = {named!r}: is set beside env.mixture; give one game in env.name or "
                          f"several in env.mixture (whose run's env.name is {MIXTURE!r})")
    env_name = MIXTURE if mixed else (named or "frozenlake")
    # a mixture's games fix their own settings per member (member_rollout_config)
    fixed_by_env = {} if env_name == MIXTURE else env_preset(env_name)
    preset_names = preset or file_dict.pop("preset", None) or default_preset()
    file_dict.pop("preset", None)
    cfg = TrainConfig()
    cfg.env.name = env_name
    add_sections(cfg, sections)
    names = [p.strip() for p in str(preset_names).split(",") if p.strip()]
    if not names:
        raise ConfigError(f"preset {preset_names!r} names no preset; choose from {', '.join(PRESETS)}")
    for name in names:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        refuse_sections(PRESETS[name], sections, f"preset {name!r}")
        apply_dict(cfg, PRESETS[name])
    apply_dict(cfg, fixed_by_env)
    cfg.preset = ",".join(names)
    apply_dict(cfg, file_dict)
    for key, value in (values or {}).items():
        apply_dict(cfg, nested_dict(key, value))
    for d in override_dicts:
        apply_dict(cfg, d)
    if listed is not None:
        cfg.env.mixture = listed
    cfg.env.name = env_name
    if cfg.env.mixture:
        explicit = {k for d in (file_dict, *override_dicts) if isinstance(d.get("rollout"), dict) for k in d["rollout"]}
        explicit |= {k.split(".", 1)[1] for k in (values or {}) if k.startswith("rollout.")}
        cfg.env.mixture = settled_mixture(cfg.env.mixture, cfg.rollout, explicit)
    if not cfg.trainer.output_dir:
        cfg.trainer.output_dir = default_run_folder(cfg.env.name)
    if cfg.reward.judge_rubric is not None and cfg.reward.judge_rubric_file is not None:
        raise ConfigError(f"config key 'reward.judge_rubric_file' = {cfg.reward.judge_rubric_file!r}: give the rubric "
                          "once: as reward.judge_rubric (text) or reward.judge_rubric_file, not both")
    return validate(inline_rubric_file(cfg), check_env)


def settled_mixture(entries: list, rollout, explicit: set) -> list:
    """env.mixture's entries with each game's own settings written into its `settings` (the
    run's config.yaml then says what each game plays with): the game's built-in settings (e.g.
    Bandit's single turn), except a key the user set in the `rollout` section (`explicit`: from
    a config file or the command line), which keeps the user's value as for one game; the
    entry's own settings over both. Entries that are not valid are left for `validate`."""
    from fastpo.envs import EnvError, resolve_env

    out = []
    for e in entries:
        e = {"name": e} if isinstance(e, str) else e
        if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("settings", {}) or {}, dict):
            try:
                game = resolve_env(e["name"].strip()).settings
            except EnvError:
                game = {}
            own = {k: getattr(rollout, k) if k in explicit else v for k, v in game.items()}
            if own:
                e = {**e, "settings": {**own, **(e.get("settings") or {})}}
        out.append(e)
    return out


def inline_rubric_file(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with reward.judge_rubric_file's text as reward.judge_rubric (the file key cleared),
    so that a run's config.yaml holds the rubric it was judged with: a resume or `fastpo eval`
    never reads the file again (it may have moved or changed). On a resume, a file given as an
    override replaces the saved text. Raises ConfigError (one line) for an unreadable file or a
    rubric without a place for the answer."""
    path = cfg.reward.judge_rubric_file
    if path is not None:
        from fastpo.rubric import read_rubric

        try:
            cfg.reward.judge_rubric = read_rubric(path)
        except ValueError as e:
            raise ConfigError(f"config key 'reward.judge_rubric_file' = {path!r}: {e}") from None
        cfg.reward.judge_rubric_file = None
    return cfg


def default_run_folder(env_name: str, prefix: str = "") -> str:
    """runs/<prefix><env name>, the name made a folder name (no ':' or '/': `mymod:Game` -> `mymod_Game`)."""
    return "runs/" + prefix + re.sub(r"[^A-Za-z0-9._-]+", "_", env_name)


# ------------------------------------------------------------- a run's saved configuration

def read_run_config(path: str) -> TrainConfig:
    """The validated TrainConfig in a run's (or a checkpoint's) config.yaml at `path`.

    Raises FileNotFoundError when it is missing; ConfigError when it cannot be read, is not
    valid YAML or not a valid fastpo configuration (each naming `path`).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {os.path.dirname(path) or '.'} a fastpo run folder?")
    try:
        with open(path, encoding="utf-8") as f:
            d = parse_config_yaml(f, path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the run's configuration ({e.strerror or e})") from None
    try:
        return config_from_dict(d)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: not a valid fastpo configuration ({e})") from None


def load_run_config(out_dir: str) -> TrainConfig:
    """The configuration a run was started with (`OUT/config.yaml`, `read_run_config`; the
    `sft` / `dagger` sections of a run folder made before config.yaml held them come from its
    sft.yaml / dagger.yaml, `legacy_sections`)."""
    cfg = read_run_config(os.path.join(out_dir, "config.yaml"))
    return validate(cfg, check_env=False) if apply_legacy_sections(cfg, out_dir) else cfg


def config_from_dict(d: dict) -> TrainConfig:
    """Rebuild a validated TrainConfig from `TrainConfig.to_dict()` output (used on resume),
    with the optional sections (`sft`, `dagger`) that `d` holds."""
    cfg = TrainConfig()
    add_sections(cfg, [name for name in OPTIONAL_SECTIONS if d.get(name) is not None])
    apply_dict(cfg, d)
    return validate(cfg)


def refuse_sections(layer: dict, sections: tuple, where: str) -> None:
    """ConfigError when config `layer` (a nested mapping: a preset, a file, an override) sets
    an optional section the command does not read (not in `sections`)."""
    for name in OPTIONAL_SECTIONS:
        if name in layer and name not in sections:
            value = layer[name]
            key = f"{name}.{next(iter(value))}" if isinstance(value, dict) and value else name
            raise ConfigError(f"config key {key!r} ({where}): the {name} section is read by {READ_BY[name]} only; "
                              f"this command has none")


def legacy_sections(out_dir: str) -> dict:
    """The optional sections a run folder made before config.yaml held them kept in its own
    files (sft.yaml of a `fastpo sft` run: the sft section; dagger.yaml of a `fastpo dagger`
    run: {"dagger": ..., "sft": ...}), as a nested mapping for `apply_dict`; {} when there
    are none. Raises ConfigError for an unreadable or malformed file (naming it)."""
    out: dict = {}
    for name, sections in LEGACY_FILES.items():
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                d = parse_config_yaml(f, path)
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
        if sections == ("sft",):
            out["sft"] = d
        else:
            out.update({s: d.get(s) or {} for s in sections})
    return out


def apply_legacy_sections(cfg: TrainConfig, out_dir: str) -> bool:
    """Fill the optional sections `cfg` (read from out_dir/config.yaml) lacks from the run
    folder's older files (`legacy_sections`); whether any was filled (none when config.yaml
    holds them)."""
    filled = False
    for name, values in legacy_sections(out_dir).items():
        if getattr(cfg, name) is None:
            add_sections(cfg, [name])
            apply_dict(getattr(cfg, name), values, prefix=f"{name}.")
            filled = True
    return filled
