"""Checkpoints: an HF-format model folder plus optimizer, RNG and loop state, written atomically
and verified before use; the run folder's lock and its temporaries.

Layout of `OUT/checkpoints/iter_000010/`:

    model/          save_pretrained + tokenizer: loadable by AutoModelForCausalLM.from_pretrained
                    (with LoRA: the merged full weights, plus the adapter in model/adapter/)
    critic/         the separate critic's backbone (save_pretrained) and value_head.safetensors,
                    or only value_head.safetensors for a critic sharing the policy trunk
    optimizer.pt    torch.save of every optimizer's state_dict
    state.pt        iteration, RNG states (python, numpy, torch CPU and CUDA), loop state
    config.yaml     the run's configuration
    manifest.json   size and SHA-256 of every other file, written last

`model/fastpo_model.json` records where the weights came from (`MODEL_META`): the run, the
iteration, the `model.name` the run trained from and the model its training started from
(`init_model`, followed through checkpoints trained from checkpoints) with `random_init`, so
a checkpoint of a `random:<shape>` run still says it started from random weights.
`find_checkpoint` reads a model folder, a checkpoint folder or a run folder (its latest
checkpoint) as a checkpoint.

Crash safety: the folder is written under a temporary name (`.tmp-iter_*`), every file is
fsynced, the manifest is written last (atomically), and only then is the folder renamed into
place; `OUT/checkpoints/latest` (a one-line text file, replaced atomically) names it. An
interrupted or failed save (a full disk: `CheckpointSaveError`) leaves the previous
checkpoints intact; `remove_stale_temporaries` clears what it left on the next start.
`verify_checkpoint` checks a folder against its manifest; `latest_checkpoint` is the newest
checkpoint that passes, so a damaged one is skipped with a note naming the damage, and
pruning never deletes the newest intact checkpoint. `RunLock` holds a run folder for one
process (an OS lock, released when the process dies).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import random
import re
import shutil
from typing import Any, Callable, Optional

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


# ---------------------------------------------------------------------------------------------
# Durable, atomic writes
# ---------------------------------------------------------------------------------------------

def fsync_dir(path: str) -> None:
    """fsync a folder, so a rename or a new file in it survives a power loss (no-op where the
    OS cannot open folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Replace the file `path` with `text` so that a reader, or a crash at any moment, finds the
    old contents or the new ones, never a mix: written to `path.tmp<pid>`, fsynced, renamed over
    `path`, the folder fsynced. The temporary file is removed if the write fails (e.g. ENOSPC;
    the error is raised)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


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


# ---------------------------------------------------------------------------------------------
# Manifest and verification
# ---------------------------------------------------------------------------------------------

#: The file, in a checkpoint folder, listing every other file's size and SHA-256 (written last).
MANIFEST = "manifest.json"
#: What a checkpoint written before manifests existed must hold to be used.
_LEGACY_REQUIRED = ("model/config.json", "state.pt", "optimizer.pt")


def _files_under(folder: str) -> list[str]:
    """Paths of the files under `folder`, relative to it with "/" separators, sorted."""
    out = []
    for d, _, files in os.walk(folder):
        for f in files:
            out.append(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/"))
    return sorted(out)


def _digest(path: str, sync: bool = False) -> str:
    """SHA-256 (hex) of a file's bytes; `sync` also fsyncs it (it was just written)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def write_manifest(folder: str, iteration: int) -> None:
    """Fsync every file under `folder` and write `MANIFEST` (size and SHA-256 of each) last,
    atomically: a folder whose manifest verifies holds every file complete."""
    files = {}
    for rel in _files_under(folder):
        if rel == MANIFEST:
            continue
        p = os.path.join(folder, rel)
        files[rel] = {"size": os.path.getsize(p), "sha256": _digest(p, sync=True)}
    for d, _, _ in os.walk(folder):
        fsync_dir(d)
    atomic_write_text(os.path.join(folder, MANIFEST),
                      json.dumps({"format": 1, "iteration": iteration, "files": files}, indent=1) + "\n")


_verified: dict[tuple, tuple[tuple, Optional[str]]] = {}  # (folder, part) -> (file stat signature, result)


def _signature(folder: str) -> tuple:
    sig = []
    for rel in _files_under(folder):
        st = os.stat(os.path.join(folder, rel))
        sig.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sig)


def verify_checkpoint(folder: str, quick: bool = False, part: str = "") -> Optional[str]:
    """None when checkpoint `folder` is intact, else what is damaged, e.g. "optimizer.pt is
    missing" or "model/model.safetensors is 812 bytes, 1603584 when saved".

    Intact: every file its manifest lists is there with that size and (unless `quick`) that
    SHA-256; `part` (e.g. "model/") checks only the files under it. A folder without a
    manifest (written before fastpo had them) passes when it holds model/config.json,
    state.pt and optimizer.pt (those under `part`). A full check of an unchanged folder is
    remembered for the life of the process (the hashing reads every byte).
    """
    folder = os.path.abspath(folder)
    if not os.path.isdir(folder):
        return "the folder is missing"
    mpath = os.path.join(folder, MANIFEST)
    if not os.path.exists(mpath):
        for rel in _LEGACY_REQUIRED:
            if rel.startswith(part) and not os.path.isfile(os.path.join(folder, rel)):
                return f"{rel} is missing (and it has no {MANIFEST})"
        return None
    try:
        with open(mpath) as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files listed")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    files = {rel: meta if isinstance(meta, dict) else {} for rel, meta in files.items() if rel.startswith(part)}
    if part and not files:
        return f"nothing under {part} is listed in {MANIFEST}"
    for rel, meta in files.items():
        p = os.path.join(folder, rel)
        if not os.path.isfile(p):
            return f"{rel} is missing"
        size = os.path.getsize(p)
        if size != meta.get("size"):
            return f"{rel} is {size} bytes, {meta.get('size')} when saved"
    if quick:
        return None
    sig = _signature(folder)
    known = _verified.get((folder, part))
    if known is not None and known[0] == sig:
        return known[1]
    problem = None
    for rel, meta in files.items():
        if _digest(os.path.join(folder, rel)) != meta.get("sha256"):
            problem = f"{rel} differs from what was saved (SHA-256)"
            break
    _verified[(folder, part)] = (sig, problem)
    return problem


def _iteration_of(name: str) -> Optional[int]:
    """The iteration number of a checkpoint folder name ``iter_000010`` (None for anything else)."""
    if not name.startswith("iter_"):
        return None
    digits = name[len("iter_"):]
    return int(digits) if digits.isdigit() else None


def _checkpoint_names(root: str) -> list[str]:
    """The ``iter_*`` folders in `root`, oldest (lowest iteration) first."""
    if not os.path.isdir(root):
        return []
    found = [(n, d) for d in os.listdir(root)
             if (n := _iteration_of(d)) is not None and os.path.isdir(os.path.join(root, d))]
    return [d for _, d in sorted(found)]


@dataclasses.dataclass
class CheckpointSearch:
    """The newest intact checkpoint of a run (`folder`, None when there is none) and the damaged
    ones newer than it (`damaged`: (name, what is damaged), newest first)."""

    folder: Optional[str]
    damaged: list

    def note(self) -> Optional[str]:
        """One line about the damaged checkpoints, or None when there were none."""
        if not self.damaged:
            return None
        what = "; ".join(f"{name}: {problem}" for name, problem in self.damaged)
        used = f"using {os.path.basename(self.folder)}, the newest intact one" if self.folder else \
            "no intact checkpoint is left"
        return f"damaged checkpoint{'s' if len(self.damaged) > 1 else ''} skipped ({what}); {used}"


def search_checkpoints(out_dir: str) -> CheckpointSearch:
    """Verify the checkpoints of run `out_dir` from the newest (highest iteration) down and stop
    at the first intact one."""
    root = os.path.join(out_dir, "checkpoints")
    damaged = []
    for name in reversed(_checkpoint_names(root)):
        problem = verify_checkpoint(os.path.join(root, name))
        if problem is None:
            return CheckpointSearch(os.path.join(root, name), damaged)
        damaged.append((name, problem))
    return CheckpointSearch(None, damaged)


def latest_checkpoint(out_dir: str, warn: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """Folder of the newest intact checkpoint of run `out_dir`, or None; `warn` gets one line
    naming any newer checkpoint found damaged (see `verify_checkpoint`)."""
    found = search_checkpoints(out_dir)
    if warn is not None and found.note():
        warn(found.note())
    return found.folder


def checkpoint_iteration(folder: str) -> int:
    """The iteration checkpoint `folder` holds (from its name)."""
    n = _iteration_of(os.path.basename(os.path.normpath(folder)))
    if n is None:
        raise ValueError(f"{folder} is not a checkpoint folder (iter_NNNNNN)")
    return n


def load_state(ckpt: str, optimizers: bool = True) -> tuple[dict, Optional[dict]]:
    """(loop state with RNG, optimizer state dicts) of checkpoint folder `ckpt` (without
    `optimizers`: None for the second).

    Raises FileNotFoundError naming the missing file.
    """
    for f in ("state.pt", "optimizer.pt") if optimizers else ("state.pt",):
        if not os.path.exists(os.path.join(ckpt, f)):
            raise FileNotFoundError(f"checkpoint {ckpt} is incomplete: {f} is missing")
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
    opt = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=False) if optimizers else None
    return state, opt


def load_checkpoint(ckpt: str, *, model: Optional[torch.nn.Module] = None,
                    optimizers: Optional[dict[str, torch.optim.Optimizer]] = None,
                    critic_backbone: Optional[torch.nn.Module] = None, value_head: Optional[torch.nn.Module] = None,
                    rng: bool = False) -> dict:
    """Restore into the given objects what `save_checkpoint` wrote into folder `ckpt` (the same
    keywords); returns the loop's `state` dict (iteration, last_eval, ...).

    model: a peft model gets its LoRA adapter (model/adapter/), any other the full weights of
    model/ (a tied LM head, stored once, may be missing); optimizers: name -> optimizer, each
    loaded from its saved state; critic_backbone: the weights of critic/; value_head:
    critic/value_head.safetensors; rng: set the RNG states saved with it.
    Raises FileNotFoundError naming a missing file, RuntimeError when the weights do not fit
    the module (missing or unexpected keys).
    """
    from safetensors.torch import load_file

    state, opts = load_state(ckpt, optimizers=bool(optimizers))
    if model is not None:
        if hasattr(model, "get_base_model"):  # peft: the base stays as loaded, the adapter is the trained part
            adapter = os.path.join(ckpt, "model", "adapter", "adapter_model.safetensors")
            if os.path.isfile(adapter):
                from peft import set_peft_model_state_dict

                set_peft_model_state_dict(model, load_file(adapter))
        else:
            _load_weights(model, os.path.join(ckpt, "model"))
    for name, opt in (optimizers or {}).items():
        opt.load_state_dict(opts[name])
    if value_head is not None:
        value_head.load_state_dict(load_file(os.path.join(ckpt, "critic", "value_head.safetensors")))
    if critic_backbone is not None:
        _load_weights(critic_backbone, os.path.join(ckpt, "critic"), body=True)
    if rng:
        set_rng_state(state["rng"])
    return state


def _load_weights(module: torch.nn.Module, folder: str, body: bool = False) -> None:
    from transformers import AutoModel, AutoModelForCausalLM

    loaded = (AutoModel if body else AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32)
    missing, unexpected = module.load_state_dict(loaded.state_dict(), strict=False)
    # tied LM heads are stored once; anything else missing means a wrong checkpoint
    bad = [k for k in missing if "lm_head" not in k]
    if bad or unexpected:
        raise RuntimeError(f"checkpoint {folder} does not fit the model: missing {bad[:5]}, unexpected {unexpected[:5]}")


@dataclasses.dataclass
class ResumePlan:
    """How `--resume` continues a run, for the CLI and the trainer alike: `checkpoint`, the
    newest intact checkpoint folder; `iteration`, the one it holds; `note`, one line naming
    damaged newer checkpoints that were skipped (None when there were none)."""

    checkpoint: str
    iteration: int
    note: Optional[str]

    def eval_pending(self) -> bool:
        """Whether its evaluation was stopped (by SIGTERM) and is still to run (reads its state)."""
        state, _ = load_state(self.checkpoint, optimizers=False)
        return bool(state.get("eval_pending"))

    def check_run_config(self, out_dir: str) -> None:
        """Refuse a run `out_dir/config.yaml` that cannot be what this checkpoint's run trained
        with: a key the checkpoint's own config.yaml holds is missing (emptied or truncated: the
        defaults would take its place), or a setting that cannot change on resume (model.*,
        env.*, trainer.seed) differs. A checkpoint without its own config.yaml is not compared.

        Raises ConfigError (one line naming the file, the checkpoint and the first keys).
        """
        from fastpo.config import ConfigError, parse_config_yaml

        ran_path, run_path = os.path.join(self.checkpoint, "config.yaml"), os.path.join(out_dir, "config.yaml")
        if not os.path.isfile(ran_path):
            return
        with open(ran_path) as f:
            ran = _flat(parse_config_yaml(f, ran_path))
        with open(run_path) as f:
            run = _flat(parse_config_yaml(f, run_path))
        missing = [k for k in ran if k not in run]
        changed = [f"{k} = {run[k]!r} (checkpoint: {ran[k]!r})" for k in ran if k in run and run[k] != ran[k]
                   and (k.startswith(("model.", "env.")) or k == "trainer.seed")]
        if missing or changed:
            what = (f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}" if missing
                    else f"has {'; '.join(changed[:2])}, which cannot change on --resume")
            raise ConfigError(f"{run_path} {what} against {ran_path}: damaged or edited? restore it with "
                              f"`cp {ran_path} {run_path}` and give changes as overrides on the command line")

    def nothing_to_do(self, iterations: int) -> bool:
        """Whether a resume with `iterations` in all has nothing to train or evaluate."""
        return self.iteration >= iterations and not self.eval_pending()


def _flat(d: dict, prefix: str = "") -> dict:
    """A nested mapping as {dotted key: leaf value}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def plan_resume(out_dir: str) -> ResumePlan:
    """The ResumePlan of `--resume out_dir`: its newest intact checkpoint.

    Raises FileNotFoundError (one line, naming damaged checkpoints) when there is none.
    """
    found = search_checkpoints(out_dir)
    if found.folder is None:
        why = f" ({found.note()})" if found.note() else ""
        raise FileNotFoundError(f"--resume {out_dir}: no checkpoint found under {os.path.join(out_dir, 'checkpoints')}"
                                f"{why}; if nothing was trained yet, start again with --out {out_dir} --overwrite")
    return ResumePlan(found.folder, checkpoint_iteration(found.folder), found.note())


def nothing_to_train_note(out_dir: str, done: int, iterations: int) -> str:
    """What a resume of a run that already ran `done` of `iterations` iterations says."""
    return (f"{out_dir} already ran {done} iterations (trainer.iterations = {iterations}): nothing to train; "
            f"pass --iterations N with N > {done} to train further")


# ---------------------------------------------------------------------------------------------
# Saving and pruning
# ---------------------------------------------------------------------------------------------

class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (e.g. the disk is full); the message is one line saying
    what failed, how much space a checkpoint takes and what is free. Nothing of the failed save
    is left behind and the earlier checkpoints are untouched."""


_WRITE_FAILED = re.compile(r"writ|iostream|unexpected pos|no space|disk|quota", re.IGNORECASE)


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, rel)) for rel in _files_under(folder))


def _tensor_bytes(*objs: Any) -> int:
    """Bytes of the tensors in state dicts / optimizer states (nested dicts and lists)."""
    total = 0
    stack = list(objs)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _remove_folder(root: str, name: str) -> None:
    """Delete checkpoint folder `root/name`: renamed to `.trash-*` first (atomic), so a crash
    half-way through the deletion never leaves a partial folder under a checkpoint's name."""
    trash = os.path.join(root, f".trash-{name}-{os.getpid()}")
    os.replace(os.path.join(root, name), trash)
    shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(out_dir: str, iteration: int, *, model: torch.nn.Module, tokenizer: Any,
                    optimizers: dict[str, torch.optim.Optimizer], state: dict, config_yaml: str,
                    critic_backbone: Optional[torch.nn.Module] = None,
                    value_head: Optional[torch.nn.Module] = None, keep: int = 2,
                    rng: Optional[dict] = None) -> str:
    """Write checkpoint `iteration` under `out_dir/checkpoints/` atomically; returns its folder.

    `state` is the loop's own state (iteration counters, echo-trap state, ...); the RNG states
    are added here (`rng`, else the current ones). Older checkpoints beyond the newest `keep`
    are deleted, except the newest intact one (`prune_checkpoints`).
    Raises ValueError if keep < 1, CheckpointSaveError (one line: the file, the cause, the
    space a checkpoint needs and the free space) when writing fails; nothing of the failed
    save remains and the earlier checkpoints are untouched.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = os.path.join(out_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    name = f"iter_{iteration:06d}"
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    step = "the checkpoint folder"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        step = "model/"
        save_hf_model(model, tokenizer, os.path.join(tmp, "model"))
        meta = _model_meta(out_dir, iteration, config_yaml)
        if meta is not None:
            step = f"model/{MODEL_META}"
            with open(os.path.join(tmp, "model", MODEL_META), "w") as f:
                json.dump(meta, f, indent=1)
        if value_head is not None:
            from safetensors.torch import save_file

            step = "critic/"
            os.makedirs(os.path.join(tmp, "critic"), exist_ok=True)
            if critic_backbone is not None:
                critic_backbone.save_pretrained(os.path.join(tmp, "critic"))
            save_file({k: v.detach().contiguous().cpu() for k, v in value_head.state_dict().items()},
                      os.path.join(tmp, "critic", "value_head.safetensors"))
        step = "optimizer.pt"
        torch.save({k: o.state_dict() for k, o in optimizers.items()}, os.path.join(tmp, "optimizer.pt"))
        step = "state.pt"
        torch.save({"iteration": iteration, "rng": rng if rng is not None else rng_state(), **state},
                   os.path.join(tmp, "state.pt"))
        step = "config.yaml"
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            f.write(config_yaml)
        step = MANIFEST
        write_manifest(tmp, iteration)
        step = f"the rename of the folder to {name}"
        if os.path.exists(final):  # the same iteration saved again (e.g. over a damaged copy)
            _remove_folder(root, name)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # I/O errors become one line; torch's writer reports them as RuntimeError (e.g.
        # "PytorchStreamWriter failed writing file", "unexpected pos ... iostream error")
        if not (isinstance(e, OSError) or (isinstance(e, RuntimeError) and _WRITE_FAILED.search(str(e)))):
            raise
        where = str(getattr(e, "filename", None) or "")
        if where.startswith(tmp + os.sep):  # the very file (save_pretrained writes several)
            step = re.sub(r"\.tmp\d+$", "", os.path.relpath(where, tmp).replace(os.sep, "/"))
        needed = _tensor_bytes(model.state_dict(), [o.state_dict() for o in optimizers.values()],
                               critic_backbone.state_dict() if critic_backbone is not None else None,
                               value_head.state_dict() if value_head is not None else None)
        prev = [d for d in _checkpoint_names(root) if d != name]
        if prev:
            needed = max(needed, _folder_bytes(os.path.join(root, prev[-1])))
        cause = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).strip().splitlines()
        cause = (cause[0] if cause else type(e).__name__)[:160]
        free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
        full = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or free < needed
        held = min(len(prev), keep) + 1  # the new one is written before pruning
        room = f"; saving needs room for {held} checkpoints at once ({held - 1} kept + the new one)" if held > 1 else ""
        raise CheckpointSaveError(
            f"checkpoint {name} not saved: writing {step} failed ({'disk full: ' if full else ''}{cause}); "
            f"a checkpoint of this run takes about {_size(needed)}, {_size(free)} free in {root}{room}; "
            + (f"the earlier checkpoints are intact (newest: {prev[-1]})" if prev else "no earlier checkpoint exists")
        ) from e
    try:
        atomic_write_text(os.path.join(root, "latest"), name + "\n")
    except OSError as e:  # the checkpoint is complete; `latest` only names it (found by its manifest)
        raise CheckpointSaveError(f"checkpoint {name} saved, but writing {os.path.join(root, 'latest')} failed "
                                  f"({e.strerror or e}); resume still finds {name}") from e
    prune_checkpoints(root, keep=keep, protect=name)
    return final


def prune_checkpoints(root: str, keep: int, protect: str) -> list[str]:
    """Delete all but the `keep` highest-iteration checkpoints in `root`; returns the deleted names.

    Ordered by iteration number (not by name), and `protect` (the checkpoint just written)
    is never deleted, even if folders with higher iteration numbers exist. When none of the
    kept ones passes `verify_checkpoint(quick=True)`, the newest intact one among the others is
    kept as well: pruning never deletes the last intact checkpoint.
    """
    names = _checkpoint_names(root)
    others = [d for d in names if d != protect]
    n_drop = max(0, len(others) - (keep - 1))
    dropped = others[:n_drop]
    kept = [d for d in names if d not in dropped]
    if dropped and not any(verify_checkpoint(os.path.join(root, d), quick=True) is None for d in kept):
        for d in reversed(dropped):
            if verify_checkpoint(os.path.join(root, d), quick=True) is None:
                dropped.remove(d)
                break
    for d in dropped:
        _remove_folder(root, d)
    return dropped


# ---------------------------------------------------------------------------------------------
# The run folder: markers, the lock, temporaries
# ---------------------------------------------------------------------------------------------

#: What marks a folder as holding a fastpo run.
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
#: The lock file in a run folder (see RunLock).
LOCK_FILE = ".lock"


def run_folder_in_use(out_dir: str) -> list[str]:
    """The run markers (config.yaml, metrics.jsonl, checkpoints/) present in `out_dir` (empty: free)."""
    return [m for m in RUN_MARKERS if os.path.exists(os.path.join(out_dir, m))]


def clear_run_folder(out_dir: str) -> None:
    """Delete a previous run's outputs in `out_dir` (markers, plots/, samples/, eval/ outcomes,
    tensorboard files, the configs kept from earlier resumes)."""
    kept = [f for f in os.listdir(out_dir) if f.startswith("config.until_iter_")] if os.path.isdir(out_dir) else []
    for m in RUN_MARKERS + ("plots", "samples", "eval", "tensorboard", *kept):
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


class RunFolderBusy(RuntimeError):
    """Another process holds the run folder (one line naming it and its pid)."""


class RunLock:
    """An exclusive OS lock (flock) on `OUT/.lock`, held by the process writing the run folder.

    The kernel releases it when the process ends, however it ends (kill -9 included), so a
    lock never outlives its holder. The file holds the holder's pid, for the message.
    `acquire` raises RunFolderBusy naming the pid when another process holds it.
    """

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_FILE)
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        import fcntl

        try:
            os.makedirs(self.out_dir, exist_ok=True)
        except OSError as e:  # e.g. under /proc, or a file in the path: bad input, not a bug
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            from fastpo.config import ConfigError

            raise ConfigError(f"output folder {self.out_dir}: cannot create it ({e.strerror or e})") from None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunFolderBusy(self._busy()) from None
            # the file may have been deleted and re-created by a holder that let go meanwhile:
            # hold the lock on the file that is there now
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def check(self) -> None:
        """Raise RunFolderBusy when another process holds the lock now (without taking it: a
        probe, for refusing a command before it does anything)."""
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # no lock file: nobody has held this folder
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderBusy(self._busy()) from None
        finally:
            os.close(fd)

    def _busy(self) -> str:
        try:
            with open(self.path) as f:
                pid = f.read().strip()
        except OSError:
            pid = ""
        return (f"{self.out_dir} is in use by another fastpo process (pid {pid if pid.isdigit() else 'unknown'}); "
                f"wait for it to end or stop it first")

    def release(self, remove: bool = False) -> None:
        """Let go of the lock; `remove` also deletes the lock file (a folder left empty)."""
        if self.fd is None:
            return
        if remove:
            with contextlib.suppress(OSError):
                os.remove(self.path)
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = None


def tidy_run_folder(out_dir: str) -> list[str]:
    """Clear what interrupted writes left in run `out_dir` (call it holding its RunLock): the
    temporary checkpoint folders (`.tmp-iter_*`), half-deleted ones (`.trash-*`), `latest.tmp*`,
    and the temporaries of `metrics.jsonl` and `config.yaml`; and point `checkpoints/latest` at
    the newest intact checkpoint when it names another (a crash before it was rewritten, or a
    damaged one). Returns what was done, one short phrase per item."""
    removed = []
    root = os.path.join(out_dir, "checkpoints")
    for folder, prefixes in ((root, (".tmp-iter_", ".trash-", "latest.tmp")),
                             (out_dir, ("metrics.jsonl.tmp", "config.yaml.tmp"))):
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if not name.startswith(prefixes):
                continue
            p = os.path.join(folder, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(p)
            removed.append(f"removed {name}")
    newest = search_checkpoints(out_dir).folder
    ptr = os.path.join(root, "latest")
    if newest is not None:
        try:
            with open(ptr) as f:
                named = f.read().strip()
        except OSError:
            named = None
        if named != os.path.basename(newest):
            atomic_write_text(ptr, os.path.basename(newest) + "\n")
            removed.append(f"checkpoints/latest now names {os.path.basename(newest)}")
    return removed


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
        if os.path.basename(p) != "model" or _iteration_of(os.path.basename(parent)) is None:
            return None
        if not any(os.path.exists(os.path.join(parent, f)) for f in ("state.pt", "config.yaml")) \
                and not os.path.isfile(os.path.join(p, MODEL_META)):
            return None
        folder = os.path.dirname(p) if os.path.dirname(p) else parent
    elif _iteration_of(os.path.basename(p)) is not None and any(
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
                         iteration=_iteration_of(os.path.basename(folder)), config_path=config_path)


def _model_name(config_yaml: str) -> Optional[str]:
    """`model.name` in a run's config.yaml text, or None when it names none."""
    from fastpo.config import ConfigError, parse_config_yaml

    try:
        name = parse_config_yaml(config_yaml, "config.yaml")["model"]["name"]
    except (ConfigError, KeyError, TypeError):
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
