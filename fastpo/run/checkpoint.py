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

Trust: optimizer.pt and state.pt hold plain data only (containers, numbers, strings and
tensors; `plain_data`) and load with `torch.load(weights_only=True)`, so a run folder from
someone else runs no code when resumed (the weights are safetensors). A file that needs full
unpickling (an older fastpo's state.pt held NumPy objects) is refused in one line naming it
and TRUST_FLAG (`UntrustedCheckpoint`), and loads, with a warning, only with that flag.

Crash safety: the folder is written under a temporary name (`.tmp-iter_*`), every file is
fsynced, the manifest is written last (atomically), and only then is the folder renamed into
place; `OUT/checkpoints/latest` (a one-line text file, replaced atomically) names it. An
interrupted or failed save (a full disk: `CheckpointSaveError`) leaves the previous
checkpoints intact; `remove_stale_temporaries` clears what it left on the next start.
`verify_checkpoint` checks a folder against its manifest; `latest_checkpoint` is the newest
checkpoint that passes, so a damaged one is skipped with a note naming the damage, and
pruning keeps the `keep` newest intact checkpoints (a damaged one never counts). `RunLock`
holds a run folder for one process (an OS lock, released when the process dies).

This module saves, loads, prunes and plans the resume; the manifest and the search for the
newest intact checkpoint are in fastpo.run.manifest, durable writes and the run
folder's markers and lock in fastpo.run.folder, the weights' origin and `find_checkpoint` in
fastpo.run.origin (all importable from here too).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pickle
import random
import re
import shutil
from typing import Any, Optional

import numpy as np
import torch

from fastpo.config.files import flatten, parse_config_yaml
# The manifest (fastpo.run.manifest), the run folder (fastpo.run.folder) and the weights'
# origin (fastpo.run.origin) live in their own modules: import their names from there.
from fastpo.run.manifest import (MANIFEST, checkpoint_names, files_under, checkpoint_iteration,
                                        search_checkpoints, verify_checkpoint, write_manifest)
from fastpo.run.origin import MODEL_META, model_meta
from fastpo.config.fields import ConfigError
from fastpo.run.folder import atomic_write_text, fsync_dir


def rng_state() -> dict:
    """Python, NumPy, torch CPU (and CUDA where present) RNG states, as plain data (a checkpoint's
    state.pt loads them without pickle's code paths): python: `random.getstate()`, a tuple of
    ints; numpy: the global MT19937 state as `np.random.get_state(legacy=False)` gives it, its
    key a [624] int64 tensor; torch: a uint8 tensor; cuda: a list of uint8 tensors."""
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = torch.from_numpy(np_state["state"]["key"].astype(np.int64))
    st = {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    """Restore what `rng_state` captured (or an older fastpo's checkpoint held: NumPy's state as
    the tuple `np.random.get_state()` gives)."""
    version, internal, gauss_next = st["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = st["numpy"]
    if isinstance(np_state, dict):
        key = np.asarray(np_state["state"]["key"], dtype=np.int64).astype(np.uint32)
        np_state = {**np_state, "state": {**np_state["state"], "key": key}}
    np.random.set_state(np_state)
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def plain_data(x: Any, where: str = "the state") -> Any:
    """`x` as plain data, which `torch.load(weights_only=True)` reads back with no code of its
    own running: dicts with str or int keys, lists, tuples, str, int, float, bool, None and
    tensors; NumPy scalars become Python numbers and NumPy arrays tensors.

    Raises TypeError naming where anything else sits (`where`: what `x` is, for the message):
    a checkpoint holding it could not be resumed without --trust-checkpoint.
    """
    if isinstance(x, np.generic):  # before float: np.float64 is a float that pickles as a NumPy object
        return x.item()
    if x is None or isinstance(x, torch.Tensor) or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x, dtype=np.int64 if x.dtype == np.uint32 else x.dtype))
    if isinstance(x, dict):
        bad = [k for k in x if type(k) not in (str, int)]
        if bad:
            raise TypeError(f"{where} has a key of type {type(bad[0]).__name__} ({bad[0]!r}): not plain data")
        return {k: plain_data(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        items = [plain_data(v, f"{where}[{i}]") for i, v in enumerate(x)]
        return tuple(items) if isinstance(x, tuple) else items
    raise TypeError(f"{where} holds a {type(x).__module__}.{type(x).__qualname__}: not plain data")


#: The command-line flag that lets a resume unpickle checkpoint files (named in the messages).
TRUST_FLAG = "--trust-checkpoint"
#: The torch files of a checkpoint: plain data, loaded with `weights_only=True`.
TORCH_FILES = ("state.pt", "optimizer.pt")


class UntrustedCheckpoint(ConfigError):
    """A checkpoint file needs full unpickling to load (it holds Python objects beyond plain
    data: an older fastpo's state.pt, or a file fastpo did not write), which can run any code,
    and the user did not say they trust it (TRUST_FLAG). One line naming the file and the flag."""


def _untrusted(path: str) -> UntrustedCheckpoint:
    return UntrustedCheckpoint(
        f"{path} holds pickled Python objects, which can run any code when loaded (a checkpoint of an older "
        f"fastpo, or a file fastpo did not write): not loaded; if you trust whoever made it, resume with {TRUST_FLAG}")


def _load_torch_file(path: str, trust: bool = False) -> Any:
    """torch.load of checkpoint file `path` as plain data (`weights_only=True`: nothing in the
    file runs). A file that needs full unpickling raises UntrustedCheckpoint, or with `trust`
    loads with it."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        if not trust:
            raise _untrusted(path) from None
    return torch.load(path, weights_only=False)


def check_trust(ckpt: str, trust: bool = False) -> Optional[str]:
    """Check, without reading their tensors, that checkpoint `ckpt`'s torch files load as plain
    data. Returns None when they do; with `trust`, one warning line naming those that need full
    unpickling (they will be loaded with it). Raises UntrustedCheckpoint naming the first such
    file and TRUST_FLAG otherwise."""
    needs = []
    for name in TORCH_FILES:
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            continue
        try:  # mmap: the pickled structure is read, the tensors' bytes are not
            torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except pickle.UnpicklingError:
            if not trust:
                raise _untrusted(path) from None
            needs.append(path)
        except RuntimeError:  # not torch's zip format (mmap needs it): the full load decides
            pass
    if not needs:
        return None
    return (f"{' and '.join(needs)} hold{'s' if len(needs) == 1 else ''} pickled Python objects (an older fastpo's "
            f"checkpoint?): loaded with full unpickling because of {TRUST_FLAG}; the checkpoints this run saves "
            f"are plain data")


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



def load_state(ckpt: str, optimizers: bool = True, trust: bool = False) -> tuple[dict, Optional[dict]]:
    """(loop state with RNG, optimizer state dicts) of checkpoint folder `ckpt` (without
    `optimizers`: None for the second), loaded as plain data (`torch.load(weights_only=True)`).

    Raises FileNotFoundError naming the missing file; UntrustedCheckpoint (one line naming the
    file and TRUST_FLAG) for a file that needs full unpickling, which only `trust` allows.
    """
    for f in ("state.pt", "optimizer.pt") if optimizers else ("state.pt",):
        if not os.path.exists(os.path.join(ckpt, f)):
            raise FileNotFoundError(f"checkpoint {ckpt} is incomplete: {f} is missing")
    state = _load_torch_file(os.path.join(ckpt, "state.pt"), trust)
    opt = _load_torch_file(os.path.join(ckpt, "optimizer.pt"), trust) if optimizers else None
    return state, opt


def load_checkpoint(ckpt: str, *, model: Optional[torch.nn.Module] = None,
                    optimizers: Optional[dict[str, torch.optim.Optimizer]] = None,
                    critic_backbone: Optional[torch.nn.Module] = None, value_head: Optional[torch.nn.Module] = None,
                    rng: bool = False, trust: bool = False) -> dict:
    """Restore into the given objects what `save_checkpoint` wrote into folder `ckpt` (the same
    keywords); returns the loop's `state` dict (iteration, last_eval, ...).

    model: a peft model gets its LoRA adapter (model/adapter/), any other the full weights of
    model/ (a tied LM head, stored once, may be missing); optimizers: name -> optimizer, each
    loaded from its saved state; critic_backbone: the weights of critic/; value_head:
    critic/value_head.safetensors; rng: set the RNG states saved with it; trust: allow files
    that need full unpickling (`load_state`).
    Raises FileNotFoundError naming a missing file, RuntimeError when the weights do not fit
    the module (missing or unexpected keys), UntrustedCheckpoint (see `load_state`).
    """
    from safetensors.torch import load_file

    state, opts = load_state(ckpt, optimizers=bool(optimizers), trust=trust)
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
    damaged newer checkpoints that were skipped (None when there were none); `trust`, whether
    its files may be fully unpickled (TRUST_FLAG); `trust_note`, the warning line when some
    need it (None when all are plain data)."""

    checkpoint: str
    iteration: int
    note: Optional[str]
    trust: bool = False
    trust_note: Optional[str] = None

    def eval_pending(self) -> bool:
        """Whether its evaluation was stopped (by SIGTERM) and is still to run (reads its state)."""
        state, _ = load_state(self.checkpoint, optimizers=False, trust=self.trust)
        return bool(state.get("eval_pending"))

    def check_run_config(self, out_dir: str) -> None:
        """Refuse a run `out_dir/config.yaml` that cannot be what this checkpoint's run trained
        with: a key the checkpoint's own config.yaml holds is missing (emptied or truncated: the
        defaults would take its place), or a setting that cannot change on resume (model.*,
        env.*, trainer.seed) differs. A checkpoint without its own config.yaml is not compared.

        Raises ConfigError (one line naming the file, the checkpoint and the first keys).
        """
        ran_path, run_path = os.path.join(self.checkpoint, "config.yaml"), os.path.join(out_dir, "config.yaml")
        if not os.path.isfile(ran_path):
            return
        with open(ran_path, encoding="utf-8") as f:
            ran = flatten(parse_config_yaml(f, ran_path))
        with open(run_path, encoding="utf-8") as f:
            run = flatten(parse_config_yaml(f, run_path))
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


def plan_resume(out_dir: str, trust: bool = False) -> ResumePlan:
    """The ResumePlan of `--resume out_dir`: its newest intact checkpoint, whose torch files
    are checked to load as plain data (`check_trust`; `trust`: those that do not may load
    with full unpickling, said in the plan's `trust_note`).

    Raises FileNotFoundError (one line, naming damaged checkpoints) when there is none,
    UntrustedCheckpoint (one line naming the file and TRUST_FLAG) for a file that needs full
    unpickling without `trust`.
    """
    found = search_checkpoints(out_dir)
    if found.folder is None:
        why = f" ({found.note()})" if found.note() else ""
        raise FileNotFoundError(f"--resume {out_dir}: no checkpoint found under {os.path.join(out_dir, 'checkpoints')}"
                                f"{why}; if nothing was trained yet, start again with --out {out_dir} --overwrite")
    return ResumePlan(found.folder, checkpoint_iteration(found.folder), found.note(), trust,
                      check_trust(found.folder, trust))


def nothing_to_train_note(out_dir: str, done: int, iterations: int) -> str:
    """What a resume of a run that already ran `done` of `iterations` iterations says."""
    return (f"{out_dir} already ran {done} iteration{'s' if done != 1 else ''} (trainer.iterations = {iterations}): nothing to train; "
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
    return sum(os.path.getsize(os.path.join(folder, rel)) for rel in files_under(folder))


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


def _save_error(e: BaseException, step: str, tmp: str, root: str, name: str, keep: int,
                modules: tuple, optimizers: dict) -> CheckpointSaveError:
    """The one-line error of a failed save of checkpoint `name`: the file being written (`step`,
    or the very file the error names under `tmp`), the cause, the space a checkpoint of this run
    takes (its tensors, or the previous checkpoint's size if larger) against the free space,
    and whether earlier checkpoints remain. `modules`: (model, critic backbone, value head),
    the last two possibly None."""
    where = str(getattr(e, "filename", None) or "")
    if where.startswith(tmp + os.sep):  # the very file (save_pretrained writes several)
        step = re.sub(r"\.tmp\d+$", "", os.path.relpath(where, tmp).replace(os.sep, "/"))
    needed = _tensor_bytes([m.state_dict() for m in modules if m is not None],
                           [o.state_dict() for o in optimizers.values()])
    prev = [d for d in checkpoint_names(root) if d != name]
    if prev:
        needed = max(needed, _folder_bytes(os.path.join(root, prev[-1])))
    cause = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).strip().splitlines()
    cause = (cause[0] if cause else type(e).__name__)[:160]
    free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
    full = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or free < needed
    held = min(len(prev), keep) + 1  # the new one is written before pruning
    room = f"; saving needs room for {held} checkpoints at once ({held - 1} kept + the new one)" if held > 1 else ""
    return CheckpointSaveError(
        f"checkpoint {name} not saved: writing {step} failed ({'disk full: ' if full else ''}{cause}); "
        f"a checkpoint of this run takes about {_size(needed)}, {_size(free)} free in {root}{room}; "
        + (f"the earlier checkpoints are intact (newest: {prev[-1]})" if prev else "no earlier checkpoint exists"))


def save_checkpoint(out_dir: str, iteration: int, *, model: torch.nn.Module, tokenizer: Any,
                    optimizers: dict[str, torch.optim.Optimizer], state: dict, config_yaml: str,
                    critic_backbone: Optional[torch.nn.Module] = None,
                    value_head: Optional[torch.nn.Module] = None, keep: int = 2,
                    rng: Optional[dict] = None) -> str:
    """Write checkpoint `iteration` under `out_dir/checkpoints/` atomically; returns its folder.

    `state` is the loop's own state (iteration counters, echo-trap state, ...); the RNG states
    are added here (`rng`, else the current ones); state.pt holds them as plain data
    (`plain_data`), as optimizer.pt does torch's optimizer state dicts. Then all but the
    `keep` newest intact checkpoints and this one are deleted (`prune_checkpoints`).
    Raises ValueError if keep < 1, TypeError when `state` holds anything but plain data,
    CheckpointSaveError (one line: the file, the cause, the space a checkpoint needs and the
    free space) when writing fails; nothing of the failed save remains and the earlier
    checkpoints are untouched.
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
        meta = model_meta(out_dir, iteration, config_yaml)
        if meta is not None:
            step = f"model/{MODEL_META}"
            with open(os.path.join(tmp, "model", MODEL_META), "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
        if value_head is not None:
            from safetensors.torch import save_file

            step = "critic/"
            os.makedirs(os.path.join(tmp, "critic"), exist_ok=True)
            if critic_backbone is not None:
                critic_backbone.save_pretrained(os.path.join(tmp, "critic"))
            save_file({k: v.detach().contiguous().cpu() for k, v in value_head.state_dict().items()},
                      os.path.join(tmp, "critic", "value_head.safetensors"))
        # plain data only: a resume loads these files with torch.load(weights_only=True), which
        # runs no code of theirs (torch's optimizer state dicts are; plain_data makes the loop's)
        step = "optimizer.pt"
        torch.save({k: o.state_dict() for k, o in optimizers.items()}, os.path.join(tmp, "optimizer.pt"))
        step = "state.pt"
        torch.save(plain_data({"iteration": iteration, "rng": rng if rng is not None else rng_state(), **state}),
                   os.path.join(tmp, "state.pt"))
        step = "config.yaml"
        with open(os.path.join(tmp, "config.yaml"), "w", encoding="utf-8") as f:
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
        modules = (model, critic_backbone, value_head)
        raise _save_error(e, step, tmp, root, name, keep, modules, optimizers) from e
    try:
        atomic_write_text(os.path.join(root, "latest"), name + "\n")
    except OSError as e:  # the checkpoint is complete; `latest` only names it (found by its manifest)
        raise CheckpointSaveError(f"checkpoint {name} saved, but writing {os.path.join(root, 'latest')} failed "
                                  f"({e.strerror or e}); resume still finds {name}") from e
    prune_checkpoints(root, keep=keep, protect=name)
    return final


def prune_checkpoints(root: str, keep: int, protect: str) -> list[str]:
    """Delete all checkpoints in `root` but the `keep` newest intact ones and `protect` (the
    checkpoint just written, never deleted); returns the deleted names.

    Only checkpoints that pass `verify_checkpoint(quick=True)` count towards `keep` (the
    protected one too, when intact): a damaged checkpoint is deleted (a resume skips it
    anyway) and never takes the place of an intact one. Newest means the highest iteration
    number (not the name's sort order).
    """
    names = checkpoint_names(root)
    kept = {protect} if protect in names else set()
    intact = int(protect in kept and verify_checkpoint(os.path.join(root, protect), quick=True) is None)
    for d in reversed(names):
        if intact >= keep:
            break
        if d != protect and verify_checkpoint(os.path.join(root, d), quick=True) is None:
            kept.add(d)
            intact += 1
    dropped = [d for d in names if d not in kept]
    for d in dropped:
        _remove_folder(root, d)
    return dropped



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
            with open(ptr, encoding="utf-8") as f:
                named = f.read().strip()
        except OSError:
            named = None
        if named != os.path.basename(newest):
            atomic_write_text(ptr, os.path.basename(newest) + "\n")
            removed.append(f"checkpoints/latest now names {os.path.basename(newest)}")
    return removed
