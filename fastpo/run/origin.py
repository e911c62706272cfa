"""Where a checkpoint's weights came from (`MODEL_META` in its model/ folder: the model its
run trained from and whether that started from random weights), and checkpoints named by any
of their folders (`find_checkpoint`: the model/ folder, the checkpoint folder, the run)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Optional

from fastpo.config.fields import ConfigError
from fastpo.config.files import parse_config_yaml
from fastpo.run.manifest import MANIFEST, iteration_of, search_checkpoints

#: File in a checkpoint's model/ folder recording the weights' origin (see the module docstring).
MODEL_META = "fastpo_model.json"


@dataclasses.dataclass
class CheckpointRef:
    """A fastpo checkpoint found from a path.

    folder: the checkpoint folder (``.../checkpoints/iter_000003``). model_dir: its HF model
    folder. run_dir: the run folder holding it (None when it is not under ``checkpoints/``).
    iteration: its iteration (from the folder name). config_path: the configuration it was
    trained with: the checkpoint's own config.yaml, else the run's, else None.
    """

    folder: str
    model_dir: str
    run_dir: Optional[str]
    iteration: Optional[int]
    config_path: Optional[str]


def find_checkpoint(path: str, warn: Optional[Callable[[str], None]] = None) -> Optional[CheckpointRef]:
    """Read `path` as a fastpo checkpoint: its ``model/`` folder, the checkpoint folder
    ``iter_NNNNNN`` itself, or a run folder or its ``checkpoints/`` (meaning its newest intact
    checkpoint, `latest_checkpoint`; `warn` gets the line naming damaged newer ones).

    Returns None when `path` is none of these (a plain HF model folder, a hub id, a missing
    path). Raises ValueError for a run folder without an intact checkpoint. A checkpoint named
    directly is returned as found: check it with `verify_checkpoint` before loading it.
    """
    if not isinstance(path, str) or not path:
        return None
    p = os.path.normpath(os.path.expanduser(path))
    if not os.path.isdir(p):
        return None
    if os.path.isfile(os.path.join(p, "config.json")):
        parent = os.path.dirname(os.path.abspath(p))
        if os.path.basename(p) != "model" or iteration_of(os.path.basename(parent)) is None:
            return None
        if not any(os.path.exists(os.path.join(parent, f)) for f in ("state.pt", "config.yaml")) \
                and not os.path.isfile(os.path.join(p, MODEL_META)):
            return None
        folder = os.path.dirname(p) if os.path.dirname(p) else parent
    elif iteration_of(os.path.basename(p)) is not None and any(
            os.path.isfile(os.path.join(p, f)) for f in ("model/config.json", MANIFEST, "state.pt")):
        folder = p  # (one missing model/ is damage for verify_checkpoint to name)
    else:
        if os.path.basename(p) == "checkpoints" and not os.path.isdir(os.path.join(p, "checkpoints")):
            p = os.path.dirname(os.path.abspath(p))  # run/checkpoints: the run's latest
        if not os.path.isdir(os.path.join(p, "checkpoints")):
            return None
        found = search_checkpoints(p)
        folder = found.folder
        if folder is None and not found.damaged and not os.path.isfile(os.path.join(p, "config.yaml")):
            return None  # a folder that merely holds a "checkpoints" folder: not a fastpo run
        if folder is None or not os.path.isfile(os.path.join(folder, "model", "config.json")):
            why = found.note() or f"nothing with model/config.json under {os.path.join(p, 'checkpoints')}"
            raise ValueError(f"{path!r} is a fastpo run folder without a complete checkpoint yet ({why})")
        if warn is not None and found.note():
            warn(found.note())
    checkpoints = os.path.dirname(folder)
    run_dir = os.path.dirname(checkpoints) if os.path.basename(checkpoints) == "checkpoints" else None
    config_path = None
    for cand in (os.path.join(folder, "config.yaml"), os.path.join(run_dir, "config.yaml") if run_dir else None):
        if cand and os.path.isfile(cand):
            config_path = cand
            break
    return CheckpointRef(folder=folder, model_dir=os.path.join(folder, "model"), run_dir=run_dir or None,
                         iteration=iteration_of(os.path.basename(folder)), config_path=config_path)


def _model_name(config_yaml: str) -> Optional[str]:
    """`model.name` in a run's config.yaml text, or None when it names none."""
    try:
        name = parse_config_yaml(config_yaml, "config.yaml")["model"]["name"]
    except (ConfigError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) and name else None


def _config_model_name(config_path: str) -> Optional[str]:
    """`model.name` in a run's config.yaml file, or None when unreadable."""
    try:
        with open(config_path, encoding="utf-8") as f:
            return _model_name(f.read())
    except (OSError, UnicodeDecodeError):
        return None


def local_path_shaped(name: str) -> bool:
    """Whether a model name can only be a local path, never an HF hub id: it starts with ".",
    "/" or "~", has more than one "/", or the folder before its last "/" exists here."""
    parent = os.path.dirname(os.path.expanduser(name).rstrip("/"))
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (bool(parent) and os.path.isdir(parent))


def model_origin(name: str, _depth: int = 0) -> dict:
    """Where a model named `name` (a `model.name` value) started: {"init_model": str,
    "random_init": True | False | None}.

    ``random:<shape>`` -> random init; a fastpo checkpoint -> its own origin (so a run trained
    from a checkpoint of a random-init run is still random-init); a missing local path ->
    None (unknown); anything else (the embedded model, an HF id or folder) -> pretrained.
    """
    if name.startswith("random:"):
        return {"init_model": name, "random_init": True}
    try:
        ref = find_checkpoint(name)
    except ValueError:
        ref = None
    if ref is not None:
        found = checkpoint_origin(ref.model_dir, _depth + 1) if _depth < 16 else None
        if found:
            return {"init_model": found["init_model"], "random_init": found["random_init"]}
        return {"init_model": name, "random_init": None}
    if local_path_shaped(name) and not os.path.exists(os.path.expanduser(name)):
        return {"init_model": name, "random_init": None}
    return {"init_model": name, "random_init": False}


def checkpoint_origin(model_dir: str, _depth: int = 0) -> Optional[dict]:
    """The origin record of a checkpoint's model folder: `MODEL_META` when present, else
    (checkpoints written before it existed) worked out from the checkpoint's config.yaml.

    Returns {"init_model", "random_init", "trained_from", "iteration", "run"} (some may be
    None), or None when `model_dir` is not a fastpo checkpoint's model folder.
    """
    meta_path = os.path.join(model_dir, MODEL_META)
    if os.path.isfile(meta_path):
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
            if isinstance(meta, dict) and isinstance(meta.get("init_model"), str):
                return {k: meta.get(k) for k in ("init_model", "random_init", "trained_from", "iteration", "run")}
        except (OSError, ValueError):
            pass  # unreadable: fall back to the config below
    try:
        ref = find_checkpoint(model_dir)
    except ValueError:
        return None
    if ref is None or ref.config_path is None:
        return None
    name = _config_model_name(ref.config_path)
    if name is None:
        return None
    return {**model_origin(name, _depth), "trained_from": name, "iteration": ref.iteration, "run": ref.run_dir}


def model_meta(out_dir: str, iteration: int, config_yaml: str) -> Optional[dict]:
    """The `MODEL_META` record of checkpoint `iteration` of run `out_dir` (None when the
    configuration names no model)."""
    name = _model_name(config_yaml)
    if name is None:
        return None
    return {"run": os.path.abspath(out_dir), "iteration": iteration, "trained_from": name, **model_origin(name)}
