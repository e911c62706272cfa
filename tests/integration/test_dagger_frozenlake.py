"""experiments/dagger_frozenlake.py, a thin wrapper of fastpo.dagger (its labels and conversations are
tested in tests/integration/test_dagger.py): a bad argument gets one line."""
import pathlib
import os
import subprocess
import sys

import pytest

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
TOOL = os.path.join(ROOT, "experiments", "dagger_frozenlake.py")


@pytest.mark.parametrize("args, msg", [
    (["--model", "/nonexistent/run", "--out", "x.jsonl"], "dagger_frozenlake: "),
    (["--model", "m", "--seeds", "0", "--out", "x.jsonl"], "dagger_frozenlake: --seeds 0: must be >= 1"),
    (["--model", "m", "--chunk", "0", "--out", "x.jsonl"], "dagger_frozenlake: --chunk 0: must be >= 1"),
])
def test_bad_argument_is_one_line(args, msg):
    r = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, encoding="utf-8",
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith(msg) and len(r.stderr.strip().splitlines()) == 1, r.stderr
