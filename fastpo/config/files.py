"""Configuration files: every config file and run `config.yaml` is read here (YAML,
`read_config_file`, `read_run_config`, `load_run_config`) and written here (`dump_yaml`)."""
from __future__ import annotations

from typing import Any

import yaml

from fastpo.config.fields import ConfigError
from fastpo.config.schema import TrainConfig


def parse_config_yaml(text: Any, where: str) -> dict:
    """The mapping in config YAML `text` (a string or an open file): the one reader of
    config files, run folders' and checkpoints' config.yaml. An empty document is {}.

    Raises ConfigError naming `where`: invalid YAML or a top level that is not a mapping.
    """
    try:
        d = yaml.safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: the top level must be a mapping, got {type(d).__name__}")
    return d


def read_config_file(file: str) -> dict:
    """The mapping in YAML config file `file`; `env: NAME` (a string) is read as `env: {name: NAME}`.

    Raises FileNotFoundError for a missing file, ConfigError for an unreadable one, invalid
    YAML, a top level that is not a mapping or an `env` that is neither a mapping nor a name.
    """
    try:
        with open(file, encoding="utf-8") as f:
            d = dict(parse_config_yaml(f, f"config file {file}"))
    except FileNotFoundError:
        raise
    except OSError as e:  # a folder, no permission, ...
        raise ConfigError(f"config file {file}: cannot read it ({e.strerror or e})") from None
    if isinstance(d.get("env"), str):
        d["env"] = {"name": d["env"]}
    elif d.get("env") is not None and not isinstance(d["env"], dict):
        raise ConfigError(f"config file {file}: 'env' must be an env name or a mapping such as "
                          f"{{name: frozenlake, options: {{}}}}, got {d['env']!r}")
    return d


def run_settings(config_yaml: str) -> dict:
    """A run's settings from its config.yaml text, without what a resume may change freely
    (the folder's spelling, the iteration count): two runs with equal settings train alike.
    Raises ConfigError for text that is not a YAML mapping."""
    d = parse_config_yaml(config_yaml, "config.yaml")
    for key in ("output_dir", "iterations"):
        (d.get("trainer") or {}).pop(key, None)
    return d


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested mapping as {dotted key: leaf value} (an empty mapping is a leaf)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def dig(dicts: list[dict], path: tuple[str, ...]) -> Any:
    found = None
    for d in dicts:
        node: Any = d
        for p in path:
            node = node.get(p) if isinstance(node, dict) else None
        if node is not None:
            found = node
    return found


def dump_yaml(cfg: TrainConfig) -> str:
    """The configuration as YAML text (what `OUT/config.yaml` holds)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
