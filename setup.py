"""Package discovery for fastpo; all other metadata is in pyproject.toml.

Two folders make one import package: ``fastpo/`` is ``fastpo`` (``fastpo/kernels/`` among its
subpackages) and ``envs_native/`` is ``fastpo.envs_native`` (the mapping is
``[tool.setuptools.package-dir]``). setuptools' own ``find`` cannot express that mapping,
so each folder's subpackages are found here and named under their import prefix.
"""
from setuptools import find_packages, setup

FOLDERS = {"fastpo": "fastpo", "fastpo.envs_native": "envs_native"}


def all_packages() -> list[str]:
    """Every import package of the two folders, e.g. ``fastpo.rollout``."""
    packages = []
    for name, folder in FOLDERS.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return packages


setup(packages=all_packages())
