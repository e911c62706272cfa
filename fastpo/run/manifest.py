"""A checkpoint's manifest (size and SHA-256 of every file, written last), its verification,
and the search for the newest intact checkpoint of a run (fastpo.run.checkpoint saves them)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable, Optional

from fastpo.run.folder import atomic_write_text, fsync_dir

#: The file, in a checkpoint folder, listing every other file's size and SHA-256 (written last).
MANIFEST = "manifest.json"
#: What a checkpoint written before manifests existed must hold to be used.
_LEGACY_REQUIRED = ("model/config.json", "state.pt", "optimizer.pt")


def files_under(folder: str) -> list[str]:
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
    for rel in files_under(folder):
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
    for rel in files_under(folder):
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
        with open(mpath, encoding="utf-8") as f:
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


def iteration_of(name: str) -> Optional[int]:
    """The iteration number of a checkpoint folder name ``iter_000010`` (None for anything else)."""
    if not name.startswith("iter_"):
        return None
    digits = name[len("iter_"):]
    return int(digits) if digits.isdigit() else None


def checkpoint_names(root: str) -> list[str]:
    """The ``iter_*`` folders in `root`, oldest (lowest iteration) first."""
    if not os.path.isdir(root):
        return []
    found = [(n, d) for d in os.listdir(root)
             if (n := iteration_of(d)) is not None and os.path.isdir(os.path.join(root, d))]
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
    for name in reversed(checkpoint_names(root)):
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
    n = iteration_of(os.path.basename(os.path.normpath(folder)))
    if n is None:
        raise ValueError(f"{folder} is not a checkpoint folder (iter_NNNNNN)")
    return n
