"""Checkpoints: an HF-format model folder plus optimizer, RNG and loop state, written atomically.

Layout of `OUT/checkpoints/iter_000010/`:

    model/          save_pretrained + tokenizer: loadable by AutoModelForCausalLM.from_pretrained
                    (with LoRA: the merged full weights, plus the adapter in model/adapter/)
    critic/         the separate critic's backbone (save_pretrained) and value_head.safetensors,
                    or only value_head.safetensors for a critic sharing the policy trunk
    optimizer.pt    torch.save of every optimizer's state_dict
    state.pt        iteration, RNG states (python, numpy, torch CPU and CUDA), loop state
    config.yaml     the run's configuration

The folder is written under a temporary name and renamed into place (atomic on POSIX), then
`OUT/checkpoints/latest` (a one-line text file, also replaced atomically) points at it. An
interrupted save leaves the previous checkpoint intact.
"""
from __future__ import annotations

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
    """Delete a previous run's outputs in `out_dir` (markers, plots/, samples/, tensorboard files)."""
    for m in RUN_MARKERS + ("plots", "samples", "tensorboard"):
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
