"""The run folder: durable writes, the markers of a run, the one-process lock.

`atomic_write_text` replaces a file so that a crash at any moment leaves the old contents
or the new ones (every file of a run folder that is rewritten goes through it). A folder
holds a run when it has one of `RUN_MARKERS`, unless that run stopped or failed before its first
checkpoint (`untrained_start`: no checkpoint, nothing but fastpo's files; the next run reuses
such a folder); `fresh_run_folder` picks a free one;
`RunLock` holds a run folder for one process (an OS lock, released when the process dies).
What interrupted writes leave behind is cleared by `fastpo.run.checkpoint.tidy_run_folder`.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from typing import Optional

from fastpo.config.fields import ConfigError


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
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json(path: str, record: dict) -> str:
    """Write `record` as indented JSON to `path` (parent folders created; replaced atomically,
    `atomic_write_text`; values JSON cannot hold are written as their str). Returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1, default=str) + "\n")
    return path


#: What marks a folder as holding a fastpo run.
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
#: The lock file in a run folder (see RunLock).
LOCK_FILE = ".lock"
#: The `sft.*` settings of a `fastpo sft` run: what marks its folder as SFT's.
SFT_FILE = "sft.yaml"
#: The `dagger.*` and `sft.*` settings of a `fastpo dagger` run: what marks its folder as DAgger's.
DAGGER_FILE = "dagger.yaml"


#: Where a folder reused after a stop before the first checkpoint keeps the records of iterations
#: that were trained but never saved (a second Ctrl-C, kill -9): their weights are gone, and the
#: new start trains them again, but what they measured is not deleted.
UNSAVED_METRICS = "metrics.unsaved.jsonl"
#: What a run writes into its folder before its first checkpoint (besides the markers): a folder
#: holding anything else is never taken for an untrained start.
_START_FILES = ("plots", "samples", "eval", "tensorboard", "wandb", SFT_FILE, LOCK_FILE, UNSAVED_METRICS)
#: What an interrupted write leaves (cleared by fastpo.run.checkpoint.tidy_run_folder).
_TEMPORARIES = ("metrics.jsonl.tmp", "config.yaml.tmp", "sft.yaml.tmp")


def unsaved_iterations(out_dir: str) -> Optional[list]:
    """The iterations >= 1 that `out_dir`'s metrics.jsonl records ([] when none or no file;
    None when it cannot be read). In a folder without a checkpoint these were trained but
    never saved."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.lexists(path):
        return []
    found = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    it = json.loads(line).get("iteration", 1)
                    if it != 0:
                        found.append(it)
    except (OSError, ValueError, AttributeError):
        return None
    return found


def untrained_start(out_dir: str) -> bool:
    """True when `out_dir` holds only what a run stopped or failed before its first checkpoint
    leaves: config.yaml, a metrics.jsonl, the evaluation before training's eval/, samples/,
    plots/, tensorboard or wandb files, the lock, the records kept from an earlier such start
    (UNSAVED_METRICS), and no checkpoint (checkpoints/ absent, or holding only interrupted
    temporaries). No trained weights are kept there (iterations the metrics record past 0 were
    trained but never saved: `unsaved_iterations`), so the next run may reuse it, the same
    command or `--resume` starting again from iteration 1; a folder holding a checkpoint or any
    file that is not fastpo's is not one (False)."""
    found = run_markers(out_dir)
    if not found:
        return False
    for name in os.listdir(out_dir):
        if name in RUN_MARKERS + _START_FILES or name.startswith(_TEMPORARIES):
            continue
        return False
    ckpts = os.path.join(out_dir, "checkpoints")
    if os.path.lexists(ckpts):
        if not os.path.isdir(ckpts) or os.path.islink(ckpts):
            return False
        if any(not n.startswith((".tmp-iter_", ".trash-", "latest.tmp")) for n in os.listdir(ckpts)):
            return False
    return True


def run_markers(out_dir: str) -> list[str]:
    """The run markers (config.yaml, metrics.jsonl, checkpoints/) present in `out_dir`."""
    return [m for m in RUN_MARKERS if os.path.lexists(os.path.join(out_dir, m))]


def run_folder_in_use(out_dir: str) -> list[str]:
    """The run markers present in `out_dir` when it holds a run to keep; empty when it is free
    (no marker, or an `untrained_start` the next run reuses)."""
    return [] if untrained_start(out_dir) else run_markers(out_dir)


def clear_run_folder(out_dir: str, keep_unsaved: bool = False) -> None:
    """Delete a previous run's outputs in `out_dir` (markers, plots/, samples/, eval/ outcomes,
    tensorboard files, the configs kept from earlier resumes, and UNSAVED_METRICS); with
    `keep_unsaved` (a start reusing the folder) UNSAVED_METRICS and config.yaml stay (the new
    start replaces config.yaml with its own once its model has loaded, and until then a
    `--resume` that starts again still finds it)."""
    kept = [f for f in os.listdir(out_dir) if f.startswith("config.until_iter_")] if os.path.isdir(out_dir) else []
    markers = tuple(m for m in RUN_MARKERS if not (keep_unsaved and m == "config.yaml"))
    unsaved = () if keep_unsaved else (UNSAVED_METRICS,)
    for m in markers + ("plots", "samples", "eval", "tensorboard", "wandb", *unsaved, *kept):
        p = os.path.join(out_dir, m)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.remove(p)


def reuse_untrained_start(out_dir: str) -> Optional[str]:
    """Clear an `untrained_start` folder for the run starting again there, keeping the records
    of iterations trained but never saved as UNSAVED_METRICS (replacing an older such file).
    Returns the file name when records were kept, else None."""
    unsaved = unsaved_iterations(out_dir)
    kept = None
    if unsaved is None or unsaved:
        os.replace(os.path.join(out_dir, "metrics.jsonl"), os.path.join(out_dir, UNSAVED_METRICS))
        fsync_dir(out_dir)
        kept = UNSAVED_METRICS
    clear_run_folder(out_dir, keep_unsaved=True)
    return kept


def unsaved_note(out_dir: str) -> str:
    """What a folder without a checkpoint holds, for the stop and restart lines: "nothing was
    trained yet and OUT holds no checkpoint", or "iterations 1-3 were trained, but OUT holds no
    checkpoint" (a stop before the first one, or checkpoints deleted since)."""
    unsaved = unsaved_iterations(out_dir)
    if unsaved is None:
        return f"{out_dir} holds no checkpoint, and its metrics.jsonl cannot be read"
    if not unsaved:
        return f"nothing was trained yet and {out_dir} holds no checkpoint"
    lo, hi = min(unsaved), max(unsaved)
    its = f"iteration {lo} was" if lo == hi else f"iterations {lo}-{hi} were"
    return f"{its} trained, but {out_dir} holds no checkpoint"


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
            with open(self.path, encoding="utf-8") as f:
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
