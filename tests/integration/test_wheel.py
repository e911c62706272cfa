"""fastpo installed from a built wheel works, as a user who runs `pip install fastpo` gets it.

The wheel is built from a copy of the source tree (so the build leaves nothing in the
checkout), installed without dependencies into a fresh virtual environment, and run from a
folder outside the repository: `fastpo train` (tiny Bandit run on random:tiny-llama) and
`fastpo eval` of its checkpoint. The new environment reaches the test environment's
dependencies (torch, transformers, ...) through a path file, so nothing is downloaded; the
fastpo it imports is the wheel's (checked), never the checkout. This once failed: the wheel
listed fastpo, fastpo.kernels and fastpo.envs_native only, so `import fastpo.trainer`
found no fastpo.algorithms.
"""
from __future__ import annotations
import pathlib

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
SKIP = shutil.ignore_patterns(".venv", ".git", "runs", "build", "dist", "*.egg-info", "__pycache__",
                              ".pytest_cache", ".hypothesis", "out", ".whl")


def _source_packages() -> set[str]:
    """Import names of every package folder of the checkout (an __init__.py inside)."""
    names = set()
    for prefix, folder in (("fastpo", "fastpo"), ("fastpo.envs_native", "envs_native")):
        for here, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(here, os.path.join(ROOT, folder))
                names.add(prefix if rel == "." else prefix + "." + rel.replace(os.sep, "."))
    return names


def _source_modules() -> set[str]:
    """The wheel paths of every module of the checkout's fastpo/ and envs_native/."""
    out = set()
    for prefix, folder in (("fastpo", "fastpo"), ("fastpo/envs_native", "envs_native")):
        base = pathlib.Path(ROOT, folder)
        out |= {f"{prefix}/{p.relative_to(base).as_posix()}" for p in base.rglob("*.py") if "__pycache__" not in p.parts}
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "fastpo"
    shutil.copytree(ROOT, src, ignore=SKIP)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(src), "-w", str(dist)], check=True, capture_output=True, text=True)
    (whl,) = dist.glob("fastpo-*.whl")
    return whl


def test_wheel_holds_every_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    inits = {n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert inits == _source_packages()
    # the C routines' sources, compiled on first use (without them the slower PyTorch paths run)
    sources = {f"fastpo/kernels/{n}" for n in os.listdir(os.path.join(ROOT, "fastpo", "kernels")) if n.endswith(".c")}
    assert len(sources) == 2 and sources <= set(names)
    # the benchmarks' baseline rollout loop (bench/reference_rollout.py) is theirs, not the package's
    # (issue 57: it shipped as fastpo/rollout/reference.py)
    py = {n for n in names if n.endswith(".py")}
    assert py == _source_modules()
    assert not any(n.endswith(("/reference_rollout.py", "rollout/reference.py")) for n in py)


@pytest.mark.slow
def test_installed_wheel_trains_and_evaluates_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the test environment's dependencies, after the new environment's own site-packages
    with open(os.path.join(site, "zz_test_dependencies.pth"), "w", encoding="utf-8") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"

    def run(*args):
        p = subprocess.run([str(venv / "bin" / "fastpo"), *args], cwd=work, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
        return p.stdout

    where = subprocess.run([str(py), "-c", "import fastpo.trainer, fastpo.kernels, fastpo.envs_native; "
                            "print(fastpo.__file__)"], cwd=work, env=env, check=True, capture_output=True,
                           text=True).stdout.strip()
    assert where.startswith(site), where  # the wheel's fastpo, not the checkout's
    run("train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--out", "run",
        "trainer.iterations=1", "trainer.eval_every=0", "trainer.plots=false", "rollout.think=false",
        "rollout.max_new_tokens=8")
    assert (work / "run" / "checkpoints" / "iter_000001" / "model").is_dir()
    run("eval", "--model", "run", "--seeds", "2", "--k", "1", "--json", "eval.json")
    assert (work / "eval.json").is_file()
