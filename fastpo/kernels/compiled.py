"""Building and loading fastpo's C routines (`_cpu_rows.c`, `_cpu_attention.c`) with ctypes.

A C file is compiled on first use with the system's C compiler (`$CC`, else `cc` or `gcc`;
`-O3 -march=native -ffast-math -fno-finite-math-only -fopenmp`, glibc's vector expf/logf
where they link; linked without -ffast-math, so loading it leaves the process's
floating-point mode alone) into `$FASTPO_CACHE` or `~/.cache/fastpo` (a file per source,
flags, compiler and CPU), and later processes load the built file. `load` never raises: a
missing compiler or a failed build gives None and the reason, and the caller runs its
PyTorch ops instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

# Compiled to an object with these, then linked without -ffast-math: linking a shared library
# with it adds crtfastmath.o, whose constructor would turn on flush-to-zero for the whole process.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fno-finite-math-only", "-fopenmp",
          "-fPIC"]
LDFLAGS = ["-shared", "-fopenmp"]
# the vector expf/logf first; a libc without libmvec gets the scalar ones
_VARIANTS = (["-DFASTPO_VECTOR_EXP"], ["-lmvec"]), ([], [])
#: Values of a switch variable (e.g. FASTPO_CPU_ROWS) that turn its routines off.
OFF = ("0", "false", "off", "no")


def _cpu_key() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def compiler() -> list[str] | None:
    """The compiler command: $CC (split as a shell would: "ccache gcc"), else cc or gcc; None
    when there is none."""
    if os.environ.get("CC", "").strip():
        cmd = shlex.split(os.environ["CC"])
        return cmd if shutil.which(cmd[0]) else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def cache_dir() -> Path:
    """Where built libraries are kept: $FASTPO_CACHE, else ~/.cache/fastpo."""
    return Path(os.environ.get("FASTPO_CACHE") or Path.home() / ".cache" / "fastpo")


def _run(cmd: list[str]) -> str | None:
    """None when `cmd` succeeds, else its first line of error output (or its exit status)."""
    r = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=300)
    if r.returncode == 0:
        return None
    lines = (r.stderr or r.stdout).strip().splitlines()
    return (lines[0] if lines else f"{cmd[0]} exited with status {r.returncode}")[:200]


def build(source: Path, stem: str, cc: list[str]) -> Path:
    """The shared library of C file `source` for this compiler and CPU, named `stem`-<hash>.so:
    loaded from the cache, or built (into a temporary file, loaded once to check it, then
    renamed into place: concurrent processes each build and one file wins; a cached file that
    does not load is rebuilt). RuntimeError with the compiler's first line when no variant
    builds and loads."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, encoding="utf-8", errors="replace",
                             timeout=60).stdout.split("\n")[0]
    src = source.read_bytes()
    errors = []
    for defines, libs in _VARIANTS:
        key = hashlib.sha256(b"|".join([src, " ".join(cc + CFLAGS + LDFLAGS + defines + libs).encode(),
                                        version.encode(), _cpu_key().encode()])).hexdigest()[:16]
        out = cache_dir() / f"{stem}-{key}.so"
        if out.exists():
            try:
                ctypes.CDLL(str(out))
                return out
            except OSError:  # truncated or foreign: build it again
                pass
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        obj = tmp[:-3] + ".o"
        try:
            err = _run([*cc, *CFLAGS, *defines, "-c", "-o", obj, str(source)]) \
                or _run([*cc, *LDFLAGS, "-o", tmp, obj, *libs, "-lm"])
            if err is None:
                try:
                    ctypes.CDLL(tmp)
                except OSError as e:  # e.g. built against libmvec, which cannot be loaded
                    err = str(e)[:200]
            if err is not None:
                errors.append(err)
                continue
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep others sharing the cache out
            os.replace(tmp, out)
            return out
        finally:
            for leftover in (tmp, obj):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    raise RuntimeError("; ".join(errors))


def load(source: Path, stem: str, switch: str, failure: str) -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library of `source`, "ok"), or (None, why not): turned off by environment
    variable `switch` (one of OFF), no compiler, or a failed build or load. A failure (not a
    switch turned off) warns once with `failure` + the reason (RuntimeWarning). Never raises."""
    if os.environ.get(switch, "1").strip().lower() in OFF:
        return None, f"off ({switch}={os.environ[switch]})"
    cc = compiler()
    try:
        if cc is None:
            raise RuntimeError("no C compiler found ($CC, cc, gcc)")
        return ctypes.CDLL(str(build(source, stem, cc))), "ok"
    except Exception as e:  # any build or load failure: the caller's PyTorch ops are the fallback
        warnings.warn(f"{failure}: {e}", RuntimeWarning, stacklevel=4)
        return None, f"off ({type(e).__name__}: {e})"


#: ctypes' argument types, for `Routines` signatures.
P, I64, F, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class Routines:
    """The C routines of one source file, built and loaded on first use, once per process
    (thread-safe): `get()` is the library with `signatures` ({function name: (argtypes,
    restype)}) set, or None when it is off (`load`'s reasons); `status()` says which. Never
    raises; the caller runs its PyTorch ops when `get()` is None."""

    def __init__(self, source: Path, stem: str, switch: str, failure: str, signatures: dict):
        self.source, self.stem, self.switch, self.failure, self.signatures = source, stem, switch, failure, signatures
        self.lib: ctypes.CDLL | None = None
        self.state: str | None = None  # None: not tried; "ok"; else why it is off
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        with self._lock:
            if self.state is None:
                lib, self.state = load(self.source, self.stem, self.switch, self.failure)
                if lib is not None:
                    for name, (argtypes, restype) in self.signatures.items():
                        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
                self.lib = lib
            return self.lib

    def status(self) -> str:
        """"ok" when the routines are in use, else why not (builds them on first call)."""
        self.get()
        return self.state or "off"
