"""fastpo.kernels' Triton kernels compiled ahead of time for sm_80, sm_90 and sm_100, no GPU needed.

`bench/kernel_compile.py` (run here in a fresh process, since this test run sets
TRITON_INTERPRET=1 for the interpreter tests and the compiled kernels must not be the
interpreter's) compiles every kernel (forward, dlogits, combine) for each dtype (bf16, fp16,
fp32), each autotune config and the fixed config, runs ptxas -v on the PTX and fails on a
config that does not compile, exceeds the target's shared memory per block or spills
registers. A deliberately oversized forward config (256 x 256 logits tile on 4 warps) must
be reported as spilling: the proof that the check sees a spill. Results are cached on the
kernels' source hash (a cold run compiles ~52 configs: about a minute on 2 idle cores).
Skipped only where Triton, its NVIDIA backend or ptxas is missing.
"""
import pathlib
import json
import os
import subprocess
import sys

import pytest

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
SCRIPT = os.path.join(ROOT, "bench", "kernel_compile.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))
import kernel_compile  # noqa: E402  (helpers only: nothing compiled in this process)


# The test's own deliberately oversized config (kernel:dtype:BLOCK_N:BLOCK_V:BLOCK_D:warps:stages):
# a 256 x 256 fp32 logits tile on 4 warps is 512 accumulator registers per thread, twice the
# 255 a thread can have, so ptxas must spill. The proof that a spill is seen and fails the check.
OVERSIZED = "fwd:bf16:256:256:64:4:2"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel_compile") / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, SCRIPT, "--targets", "80,90,100", "--oversized", OVERSIZED, "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode == 3:  # Triton / its NVIDIA backend / ptxas missing: the one reason to skip
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert out.exists(), f"kernel_compile.py wrote no result (rc {r.returncode}): {r.stderr[-3000:]}"
    with open(out, encoding="utf-8") as f:
        return r, json.load(f)


def test_every_kernel_config_compiles_without_spills(result):
    r, res = result
    normal = [x for x in res["records"] if x["origin"] != "oversized"]
    bad = [line for line in kernel_compile.failures(res) if "oversized" not in line]
    assert not bad, "\n".join(bad)
    assert r.returncode == 0, r.stderr[-3000:]
    # sm_80 and sm_90 are required; sm_100 only where this Triton has a ptxas for it
    targets = {x["target"] for x in normal}
    assert {80, 90} <= targets, res["skipped_targets"]
    for x in normal:
        assert x["shared"] <= kernel_compile.SHARED_PER_BLOCK[x["target"]]
        assert x["spill_stores"] == 0 and x["spill_loads"] == 0 and 0 < x["registers"] <= 255


def test_every_runtime_config_is_covered(result):
    """Per target: every (kernel, dtype) with the fixed config and each autotune config."""
    from fastpo.kernels import _triton as kt

    _, res = result
    got = {}
    for x in res["records"]:
        if x["origin"] != "oversized":
            c = x["constexprs"]
            got.setdefault((x["target"], x["kernel"], x["dtype"]), []).append(
                (c.get("BLOCK_N", c.get("BLOCK")), x["num_warps"], x["num_stages"], x["origin"]))
    for t in {k[0] for k in got}:
        assert got[t, "combine", "fp32"] == [(kt.COMBINE_BLOCK, kt.COMBINE_WARPS, 3, "fixed")]
        for dtype in ("bf16", "fp16", "fp32"):
            for kernel in ("fwd", "dlogits"):
                rows = got[t, kernel, dtype]
                want = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kt._TUNE_CONFIGS[dtype == "fp32"]}
                assert want <= {r[:3] for r in rows}, (t, kernel, dtype)
                assert sum(r[3].startswith("fixed") for r in rows) == 1, (t, kernel, dtype, rows)


def test_oversized_config_is_reported_as_spilling(result):
    """The check can fail: the deliberately oversized config is caught as spilling."""
    r, res = result
    big = [x for x in res["records"] if x["origin"] == "oversized"]
    k, d, bn, bv, bd, w, st = OVERSIZED.split(":")
    assert [(x["kernel"], x["dtype"], x["constexprs"]["BLOCK_N"], x["constexprs"]["BLOCK_V"], x["num_warps"])
            for x in big] == [(k, d, int(bn), int(bv), int(w))]
    assert big and all(x["spills"] and x["spill_stores"] > 0 and not x["ok"] for x in big), big
    assert not [line for line in kernel_compile.failures(res) if "oversized" in line]


def test_failures_and_occupancy_by_hand():
    rec = dict(kernel="fwd", dtype="bf16", arch="sm_90a", origin="autotune 0", constexprs={"BLOCK_N": 128},
               num_warps=8, num_stages=3, ok=False, error="spills 8 B stores / 8 B loads", spills=True)
    assert kernel_compile.failures({"records": [rec]}) == [
        "fwd bf16 sm_90a autotune 0 {'BLOCK_N': 128} warps=8 stages=3: spills 8 B stores / 8 B loads"]
    # an oversized config that does not spill means the check is blind: a failure too
    blind = dict(rec, origin="oversized", spills=False, spill_stores=0, error=None)
    assert "expected to spill" in kernel_compile.failures({"records": [blind]})[0]
    # a malformed oversized spec is refused with one line (exit 2) before anything compiles
    r = subprocess.run([sys.executable, SCRIPT, "--oversized", "fwd:bf16:big"], capture_output=True, text=True)
    assert r.returncode == 2 and "--oversized must be" in r.stderr
    # 255 registers x 256 threads: 8192 registers per warp, 8 warps per SM, one block: 12.5 %
    assert kernel_compile.occupancy(255, 96 * 1024, 8, 90) == {"blocks_per_sm": 1, "occupancy": 0.125,
                                                               "limited_by": "registers"}
    # 128 registers x 128 threads, 16 KiB shared: 16 warps -> 4 blocks of 4 warps: 25 %
    assert kernel_compile.occupancy(128, 16 * 1024, 4, 80) == {"blocks_per_sm": 4, "occupancy": 0.25,
                                                               "limited_by": "registers"}
    # shared memory as the limit: 100 KiB per block, 164 KiB per sm_80 SM
    assert kernel_compile.occupancy(64, 100 * 1024, 4, 80)["limited_by"] == "shared"
