"""bench/part_kernels.py: a method that fails, or a Liger that does not import, shows up in
the records (and so in the JSON and the table) instead of only on stderr."""
import pathlib
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(str(pathlib.Path(__file__).resolve().parents[3]), "bench"))
import part_kernels  # noqa: E402


def test_failed_methods_become_records_that_miss_their_target():
    err = "TypeError: LigerFusedLinearGRPOLoss.forward() got an unexpected keyword argument\n  'old_per_token_logps'"
    times = {"fastpo-triton": (0.012, 0.001), "naive": (0.05, 0.002)}
    recs = part_kernels._failure_records("N=4096 H=896 V=151936 bf16", "fastpo-triton", times,
                                         {part_kernels.LIGER: err}, None)
    (r,) = recs
    assert r.met is False and r.target == 2.0 and r.ratio is None
    assert r.baseline_name == part_kernels.LIGER and r.fastpo == 12.0 and r.notes == err
    assert "failed (TypeError" in r.name and "\n" not in r.name
    d = json.loads(json.dumps(r.to_dict()))
    assert d["met"] is False and d["notes"] == err
    # the fused path itself failing: no time of its own, the four-matmul target missed
    (r,) = part_kernels._failure_records("s", "fastpo-triton", {}, {"fastpo-triton": "RuntimeError: boom"}, None)
    assert math.isnan(r.fastpo) and r.met is False and r.target == 1 / 1.5 and r.baseline_name == ""


def test_liger_that_does_not_import_is_recorded():
    data = part_kernels._inputs(8, 4, 16, torch.float32, "cpu", 0)
    fn, why = part_kernels._liger_fn(data)
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        assert fn is None and why.startswith("liger_kernel not importable (")
    else:
        assert callable(fn) and why is None
    (r,) = part_kernels._failure_records("s", "fastpo-triton", {"fastpo-triton": (0.01, 0.0)}, {},
                                         "liger_kernel not importable (ModuleNotFoundError: x)")
    assert "not measured" in r.name and r.target is None and r.met is None


def test_throughput_against_four_matmuls_and_the_device_peak():
    assert part_kernels.dense_bf16_peak("NVIDIA H100 80GB HBM3") == 989.0
    assert part_kernels.dense_bf16_peak("NVIDIA H200") == 989.0
    assert part_kernels.dense_bf16_peak("NVIDIA H100 PCIe") == 756.0
    assert part_kernels.dense_bf16_peak("NVIDIA GeForce RTX 4090") is None
    n, h, v = 16384, 896, 151936
    flops = 8.0 * n * h * v  # 17.8 TFLOP: 36 ms at 494 TFLOP/s, half the H200's peak
    mm, peak = part_kernels.throughput_records("s", n, h, v, flops / 494e12, flops / 741e12, "NVIDIA H200")
    assert mm.unit == peak.unit == "TFLOP/s" and math.isclose(mm.fastpo, 494) and math.isclose(mm.baseline, 741)
    assert math.isclose(mm.ratio, 494 / 741) and mm.met is True and mm.target == 1 / 1.5
    assert peak.baseline == 989.0 and math.isclose(peak.ratio, 494 / 989) and peak.target is None
    assert "49.9% and 74.9% of the 989 TFLOP/s peak" in peak.notes
    (_, unknown) = part_kernels.throughput_records("s", n, h, v, 0.05, 0.03, "Some GPU")
    assert unknown.baseline is None and unknown.ratio is None and "no dense bf16 peak known" in unknown.notes


def test_bare_matmuls_and_the_limit_record():
    """The CPU path's three bare matmuls (6 N H V FLOPs) and the record that sets a method's time
    against them: within 1.15x meets the target, 1.2x misses it; FLOP/s as a fraction of the machine's."""
    run, flops = part_kernels.bare_matmuls(4, 3, 5, torch.float32, "cpu")
    run()
    assert flops == 6.0 * 4 * 3 * 5
    sq, sq_flops = part_kernels.square_matmul("cpu", torch.float32, size=8)
    sq()
    assert sq_flops == 2.0 * 8 ** 3
    ok = part_kernels.limit_record("kernels", "s", "fastpo-chunked", 1.1, 1.0, 3, 6e9, 10e9, target=1 / 1.15)
    assert ok.met is True and math.isclose(ok.ratio, 1 / 1.1) and ok.unit == "s"
    assert "1.10x the 3 bare matmuls" in ok.notes and "5.5 GFLOP/s = 55% of the machine's measured matmul" in ok.notes
    miss = part_kernels.limit_record("kernels", "s", "fastpo-chunked", 1.2, 1.0, 3, 6e9, 10e9, target=1 / 1.15)
    assert miss.met is False


def test_cce_peer_implementation_per_device():
    import part_peers

    assert part_peers.cce_impl("cuda") == "cce" and part_peers.cce_impl("cuda:1") == "cce"
    assert part_peers.cce_impl("cpu") == "torch_compile"
    assert part_peers._peer_label("cce-torch_compile").startswith("Cut Cross-Entropy 25.1.1")
    assert part_peers._peer_label("liger-eager").startswith("Liger 0.8.5")
