"""Checkpoints: an HF-format model folder plus optimizer, RNG and loop state, written atomically.

Layout of `OUT/checkpoints/iter_000010/`:

    model/          save_pretrained + tokenizer: loadable by AutoModelForCausalLM.from_pretrained
                    (with LoRA: the merged full weights, plus the adapter in model/adapter/)
    critic/         the separate critic's backbone (save_pretrained) and value_head.safetensors,
                    or only value_head.safetensors for a critic sharing the policy trunk
    optimizer.pt    torch.save of every optimizer's state_dict
    state.pt        iteration, RNG states (python, numpy, torch CPU and CUDA), loop state
    config.yaml     the run's configuration

`model/fastpo_model.json` records where the weights came from (`MODEL_META`): the run, the
iteration, the `model.name` the run trained from and the model its training started from
(`init_model`, followed through checkpoints trained from checkpoints) with `random_init`, so
a checkpoint of a `random:<shape>` run still says it started from random weights.
`find_checkpoint` reads a model folder, a checkpoint folder or a run folder (its latest
checkpoint) as a checkpoint.

The folder is written under a temporary name and renamed into place (atomic on POSIX), then
`OUT/checkpoints/latest` (a one-line text file, also replaced atomically) points at it. An
interrupted save leaves the previous checkpoint intact.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import Any, Optional

import numpy as np
import torch


def rng_state() -> dict:
    """Python, NumPy, torch CPU (and CUDA where present) RNG states."""
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    """Restore what `rng_state` captured."""
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_hf_model(model: torch.nn.Module, tokenizer: Any, path: str) -> None:
    """save_pretrained of `model` (merged full weights for a peft model) and the tokenizer into `path`."""
    os.makedirs(path, exist_ok=True)
    if hasattr(model, "peft_config"):
        model.save_pretrained(os.path.join(path, "adapter"))
        # Merged copy without touching the live model: fold each LoRA delta into a state dict.
        base = model.get_base_model()
        merged = {}
        with torch.no_grad():
            model.merge_adapter()
            try:
                for k, v in base.state_dict().items():
                    if "lora_" in k:
                        continue
                    merged[k.replace(".base_layer", "")] = v.detach().clone()
            finally:
                model.unmerge_adapter()
        base.save_pretrained(path, state_dict=merged)
    else:
        model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def save_checkpoint(out_dir: str, iteration: int, *, model: torch.nn.Module, tokenizer: Any,
                    optimizers: dict[str, torch.optim.Optimizer], state: dict, config_yaml: str,
                    critic_backbone: Optional[torch.nn.Module] = None,
                    value_head: Optional[torch.nn.Module] = None, keep: int = 2) -> str:
    """Write checkpoint `iteration` under `out_dir/checkpoints/` atomically; returns its folder.

    `state` is the loop's own state (iteration counters, echo-trap state, ...); RNG states
    are added here. Older checkpoints beyond the newest `keep` are deleted.
    Raises ValueError if keep < 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = os.path.join(out_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    name = f"iter_{iteration:06d}"
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_hf_model(model, tokenizer, os.path.join(tmp, "model"))
    meta = _model_meta(out_dir, iteration, config_yaml)
    if meta is not None:
        with open(os.path.join(tmp, "model", MODEL_META), "w") as f:
            json.dump(meta, f, indent=1)
    if value_head is not None:
        from safetensors.torch import save_file

        os.makedirs(os.path.join(tmp, "critic"), exist_ok=True)
        if critic_backbone is not None:
            critic_backbone.save_pretrained(os.path.join(tmp, "critic"))
        save_file({k: v.detach().contiguous().cpu() for k, v in value_head.state_dict().items()},
                  os.path.join(tmp, "critic", "value_head.safetensors"))
    torch.save({k: o.state_dict() for k, o in optimizers.items()}, os.path.join(tmp, "optimizer.pt"))
    torch.save({"iteration": iteration, "rng": rng_state(), **state}, os.path.join(tmp, "state.pt"))
    with open(os.path.join(tmp, "config.yaml"), "w") as f:
        f.write(config_yaml)
    if os.path.exists(final):
        old = final + f".old{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _atomic_write_text(os.path.join(root, "latest"), name + "\n")
    prune_checkpoints(root, keep=keep, protect=name)
    return final


def _iteration_of(name: str) -> Optional[int]:
    """The iteration number of a checkpoint folder name ``iter_000010`` (None for anything else)."""
    if not name.startswith("iter_"):
        return None
    digits = name[len("iter_"):]
    return int(digits) if digits.isdigit() else None


def prune_checkpoints(root: str, keep: int, protect: str) -> list[str]:
    """Delete all but the `keep` highest-iteration checkpoints in `root`; returns the deleted names.

    Ordered by iteration number (not by name), and `protect` (the checkpoint just written)
    is never deleted, even if folders with higher iteration numbers exist.
    """
    found = []
    for d in os.listdir(root):
        n = _iteration_of(d)
        if n is not None and os.path.isdir(os.path.join(root, d)):
            found.append((n, d))
    found.sort()
    others = [d for _, d in found if d != protect]
    n_drop = max(0, len(others) - (keep - 1))
    dropped = others[:n_drop]
    for d in dropped:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    return dropped


#: What marks a folder as holding a fastpo run.
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")


def run_folder_in_use(out_dir: str) -> list[str]:
    """The run markers (config.yaml, metrics.jsonl, checkpoints/) present in `out_dir` (empty: free)."""
    return [m for m in RUN_MARKERS if os.path.exists(os.path.join(out_dir, m))]


def clear_run_folder(out_dir: str) -> None:
    """Delete a previous run's outputs in `out_dir` (markers, plots/, samples/, tensorboard files,
    the configs kept from earlier resumes)."""
    kept = [f for f in os.listdir(out_dir) if f.startswith("config.until_iter_")] if os.path.isdir(out_dir) else []
    for m in RUN_MARKERS + ("plots", "samples", "tensorboard", *kept):
        p = os.path.join(out_dir, m)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.remove(p)


def fresh_run_folder(out_dir: str) -> str:
    """`out_dir` if it holds no run, else the first free `out_dir-2`, `out_dir-3`, ..."""
    if not run_folder_in_use(out_dir):
        return out_dir
    base = out_dir.rstrip("/\\") or out_dir
    i = 2
    while run_folder_in_use(f"{base}-{i}"):
        i += 1
    return f"{base}-{i}"


def latest_checkpoint(out_dir: str) -> Optional[str]:
    """Folder of the newest complete checkpoint of run `out_dir`, or None."""
    root = os.path.join(out_dir, "checkpoints")
    ptr = os.path.join(root, "latest")
    if os.path.exists(ptr):
        with open(ptr) as f:
            name = f.read().strip()
        if name and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
    if os.path.isdir(root):
        done = sorted((_iteration_of(d), d) for d in os.listdir(root) if _iteration_of(d) is not None
                      and os.path.exists(os.path.join(root, d, "state.pt")))
        if done:
            return os.path.join(root, done[-1][1])
    return None


def load_state(ckpt: str) -> tuple[dict, dict]:
    """(loop state with RNG, optimizer state dicts) of checkpoint folder `ckpt`.

    Raises FileNotFoundError naming the missing file.
    """
    for f in ("state.pt", "optimizer.pt"):
        if not os.path.exists(os.path.join(ckpt, f)):
            raise FileNotFoundError(f"checkpoint {ckpt} is incomplete: {f} is missing")
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
    opt = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=False)
    return state, opt


# ---------------------------------------------------------------------------------------------
# Where a checkpoint's weights came from, and checkpoints named by any of their folders
# ---------------------------------------------------------------------------------------------

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


def find_checkpoint(path: str) -> Optional[CheckpointRef]:
    """Read `path` as a fastpo checkpoint: its ``model/`` folder, the checkpoint folder
    ``iter_NNNNNN`` itself, or a run folder or its ``checkpoints/`` (meaning the latest checkpoint).

    Returns None when `path` is none of these (a plain HF model folder, a hub id, a missing
    path). Raises ValueError for a run folder without a complete checkpoint.
    """
    if not isinstance(path, str) or not path:
        return None
    p = os.path.normpath(os.path.expanduser(path))
    if not os.path.isdir(p):
        return None
    if os.path.isfile(os.path.join(p, "config.json")):
        parent = os.path.dirname(os.path.abspath(p))
        if os.path.basename(p) != "model" or _iteration_of(os.path.basename(parent)) is None:
            return None
        if not any(os.path.exists(os.path.join(parent, f)) for f in ("state.pt", "config.yaml")) \
                and not os.path.isfile(os.path.join(p, MODEL_META)):
            return None
        folder = os.path.dirname(p) if os.path.dirname(p) else parent
    elif _iteration_of(os.path.basename(p)) is not None and os.path.isfile(os.path.join(p, "model", "config.json")):
        folder = p
    else:
        if os.path.basename(p) == "checkpoints" and not os.path.isdir(os.path.join(p, "checkpoints")):
            p = os.path.dirname(os.path.abspath(p))  # run/checkpoints: the run's latest
        if not os.path.isdir(os.path.join(p, "checkpoints")):
            return None
        folder = latest_checkpoint(p)
        if folder is None and not os.path.isfile(os.path.join(p, "config.yaml")):
            return None  # a folder that merely holds a "checkpoints" folder: not a fastpo run
        if folder is None or not os.path.isfile(os.path.join(folder, "model", "config.json")):
            raise ValueError(f"{path!r} is a fastpo run folder without a complete checkpoint yet (nothing with "
                             f"model/config.json under {os.path.join(p, 'checkpoints')})")
    checkpoints = os.path.dirname(folder)
    run_dir = os.path.dirname(checkpoints) if os.path.basename(checkpoints) == "checkpoints" else None
    config_path = None
    for cand in (os.path.join(folder, "config.yaml"), os.path.join(run_dir, "config.yaml") if run_dir else None):
        if cand and os.path.isfile(cand):
            config_path = cand
            break
    return CheckpointRef(folder=folder, model_dir=os.path.join(folder, "model"), run_dir=run_dir or None,
                         iteration=_iteration_of(os.path.basename(folder)), config_path=config_path)


def _model_name(config_yaml: str) -> Optional[str]:
    """`model.name` in a run's config.yaml text, or None when it names none."""
    import yaml

    try:
        name = (yaml.safe_load(config_yaml) or {})["model"]["name"]
    except (yaml.YAMLError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) and name else None


def _config_model_name(config_path: str) -> Optional[str]:
    """`model.name` in a run's config.yaml file, or None when unreadable."""
    try:
        with open(config_path) as f:
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
            with open(meta_path) as f:
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


def _model_meta(out_dir: str, iteration: int, config_yaml: str) -> Optional[dict]:
    """The `MODEL_META` record of checkpoint `iteration` of run `out_dir` (None when the
    configuration names no model)."""
    name = _model_name(config_yaml)
    if name is None:
        return None
    return {"run": os.path.abspath(out_dir), "iteration": iteration, "trained_from": name, **model_origin(name)}
