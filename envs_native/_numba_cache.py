"""Numba's on-disk cache for this package, invalidated when any of its sources changes.

Numba checks a cached function against the file that defines it and nothing else. The
environments' compiled functions have helpers from ``_core.py`` compiled into them, so after
an edit to ``_core.py`` (a ``git pull``) the cached FrozenLake, Sokoban and Bandit functions
would go on running the old helper code until someone deleted ``__pycache__/*.nb[ic]``.

``install(package_dir)`` puts one cache locator in front of numba's list. For functions
defined in a ``.py`` file directly inside ``package_dir`` it takes whatever locator numba
itself would pick (so the cache folder, ``NUMBA_CACHE_DIR`` and the read-only fallbacks stay
numba's) and replaces its source stamp with a hash of every ``.py`` file in ``package_dir``:
one edit anywhere in the package recompiles the package's functions once, and a stale entry
is never loaded. The file names get a hash of the name the module was imported under: the
package is ``fastpo.envs_native`` when installed and ``envs_native`` to a script with the
repository on sys.path, an entry pickles that name, and loading it where the name is not
importable fails; with files of their own the two never meet. Functions from anywhere else
get numba's locator unchanged, and a second process still loads from the cache. The numba
version needs no place in the stamp: numba already discards an index written by another
version.

Chosen over deleting stale cache files at import: nothing is deleted under another process
that may be reading or writing the same cache, and numba overwrites stale entries itself.
"""
from __future__ import annotations

import hashlib
import os
import zlib

# Marks our locator classes in numba's list (one per installed package directory).
_MARK = "_fastpo_package_dir"


def package_sources_hash(package_dir: str) -> str:
    """SHA-256 (hex) over the names and bytes of every ``*.py`` file directly in `package_dir`."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(package_dir)):
        if name.endswith(".py"):
            with open(os.path.join(package_dir, name), "rb") as f:
                data = f.read()
            # lengths keep (name, content) pairs unambiguous when concatenated
            h.update(b"%d:%s%d:" % (len(name), name.encode(), len(data)))
            h.update(data)
    return h.hexdigest()


def install(package_dir: str) -> bool:
    """Make numba's cache for functions defined in `package_dir` depend on all its sources.

    Must run before the package's ``@njit(cache=True)`` modules are imported (numba reads the
    stamp when the decorator runs). Idempotent per directory. Returns False, changing
    nothing, when numba's caching internals are not the ones this relies on (another numba
    version): caching then works as numba's default, per file, and never fails the import.
    ``NUMBA_CACHE_LOCATOR_CLASSES``, when set, replaces numba's list and thereby this too.
    """
    try:
        return _install(package_dir)
    except Exception:  # any difference in numba's internals: keep numba's behaviour
        return False


def _install(package_dir: str) -> bool:
    from numba.core import caching

    base = caching._CacheLocator
    classes = caching.CacheImpl._locator_classes
    if not isinstance(classes, list):
        return False
    package_dir = os.path.realpath(package_dir)
    if any(getattr(c, _MARK, None) == package_dir for c in classes):
        return True
    # Hashed once, at install: the package's modules are imported right after.
    stamp = ("fastpo-package-sources", package_sources_hash(package_dir))

    class PackageSourcesLocator(base):
        """Numba's own locator for the function, with the package-wide source stamp."""

        def __init__(self, inner, module):
            self._inner = inner
            # An entry pickles the name of the module whose globals it uses, so one written
            # under `envs_native` (the folder on sys.path) fails to load in a process that
            # knows the package only as `fastpo.envs_native`: each name its own files.
            self._module_tag = "%08x" % zlib.crc32(module.encode())

        def __getattr__(self, name):  # e.g. _py_file, read by numba's warnings
            if name == "_inner":
                raise AttributeError(name)
            return getattr(self._inner, name)

        def ensure_cache_path(self):
            return self._inner.ensure_cache_path()

        def get_cache_path(self):
            return self._inner.get_cache_path()

        def get_disambiguator(self):
            return f"{self._inner.get_disambiguator()}-{self._module_tag}"

        def get_source_stamp(self):
            return stamp

        @classmethod
        def from_function(cls, py_func, py_file):
            try:
                if os.path.dirname(os.path.realpath(py_file)) != package_dir:
                    return None
                for other in classes:
                    if getattr(other, _MARK, None) is None:
                        inner = other.from_function(py_func, py_file)
                        if inner is not None:
                            return cls(inner, py_func.__module__)
            except Exception:  # numba then tries its own locators, as without us
                return None
            return None

    setattr(PackageSourcesLocator, _MARK, package_dir)
    classes.insert(0, PackageSourcesLocator)
    return True
