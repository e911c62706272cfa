"""experiments/agreement_success.py: the success of an imitator that agrees with FrozenLake's expert with
probability p is exact: p = 1 gives the env's optimal_success and p = 1/4 its random_success on
every map, with and without slip; it rises with p; bad arguments get one line (exit 2)."""
import pathlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
TOOL = os.path.join(ROOT, "experiments", "agreement_success.py")
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from agreement_success import imitator_success  # noqa: E402
from fastpo.envs_native.frozenlake import FrozenLakeEnv  # noqa: E402


@pytest.mark.parametrize("slippery", [True, False])
def test_ends_are_the_optimal_and_random_policies(slippery):
    seeds = list(range(500, 532))
    env = FrozenLakeEnv(len(seeds), is_slippery=slippery)
    env.reset(seeds)
    for horizon in (3, 10):
        np.testing.assert_allclose(imitator_success(env, horizon, 1.0), env.optimal_success(seeds, horizon),
                                   rtol=0, atol=1e-12)
        np.testing.assert_allclose(imitator_success(env, horizon, 0.25), env.random_success(seeds, horizon),
                                   rtol=0, atol=1e-12)
    means = [imitator_success(env, 10, p).mean() for p in (0.25, 0.5, 0.75, 1.0)]
    assert all(a < b for a, b in zip(means, means[1:])), means


def test_cli_json(tmp_path):
    out = tmp_path / "a.json"
    r = subprocess.run([sys.executable, TOOL, "--seeds", "8", "--agreement", "0.25,1", "--json", str(out)],
                       capture_output=True, text=True, encoding="utf-8", timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text(encoding="utf-8"))
    assert res["seeds"] == 8 and res["is_slippery"] is True
    assert [row["success"] for row in res["rows"]] == pytest.approx([res["random"], res["optimal"]], abs=1e-12)


@pytest.mark.parametrize("args, msg", [
    (["--agreement", "0.5,1.2"], "agreement_success: --agreement 1.2: must be in [0, 1]"),
    (["--agreement", "half"], "agreement_success: --agreement 'half': must be numbers separated by commas"),
    (["--seeds", "0"], "agreement_success: --seeds 0: must be >= 1"),
])
def test_bad_argument_is_one_line(args, msg):
    r = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, encoding="utf-8",
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip() == msg
