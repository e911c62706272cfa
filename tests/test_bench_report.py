"""bench/report.py picks which committed runs the README shows (synthetic results, no timing)."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report():
    spec = importlib.util.spec_from_file_location("_bench_report", os.path.join(ROOT, "bench", "report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(date, part="all", device="cpu", quick=False, name="x"):
    machine = dict(date=date, cpu="c", cores=2, device=device, model="m", model_weights="pretrained", gpu=None,
                   torch="t", triton="t", transformers="t")
    rec = dict(part=part if part != "all" else "envs", name=name, unit="s", fastpo=1.0, baseline=2.0, ratio=2.0,
               target=None, met=None, baseline_name="b", fastpo_spread=0.0, baseline_spread=0.0)
    return dict(machine=machine, args=dict(part=part, quick=quick, device=device), records=[rec], errors={})


def test_newest_full_run_then_newer_single_parts(tmp_path):
    report = _report()
    runs = {
        "old_full.json": _run("2026-01-01T00:00:00", name="old-full"),
        "full.json": _run("2026-02-01T00:00:00", name="new-full"),
        "part_before.json": _run("2026-01-15T00:00:00", part="rollout", name="stale-part"),
        "part_after.json": _run("2026-02-02T00:00:00", part="rollout", name="fresh-part"),
        "part_after_old.json": _run("2026-02-01T12:00:00", part="rollout", name="older-fresh-part"),
        "quick.json": _run("2026-03-01T00:00:00", quick=True, name="quick-run"),
        "gpu.json": _run("2026-01-20T00:00:00", part="kernels", device="cuda", name="gpu-part"),
    }
    for fname, r in runs.items():
        (tmp_path / fname).write_text(json.dumps(r))
    text = report.section(str(tmp_path))
    for shown in ("new-full", "fresh-part", "gpu-part"):
        assert shown in text, shown
    for hidden in ("old-full", "stale-part", "older-fresh-part", "quick-run"):
        assert hidden not in text, hidden
    assert text.index("new-full") < text.index("fresh-part") < text.index("gpu-part")  # cpu before cuda
    assert "--part rollout" in text
