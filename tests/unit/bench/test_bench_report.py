"""bench/report.py picks which committed runs docs/performance.md shows (synthetic results, no timing)."""
import pathlib
import importlib.util
import json
import os

ROOT = str(pathlib.Path(__file__).resolve().parents[3])


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


def test_a_part_that_failed_everywhere_says_why(tmp_path):
    report = _report()
    run = _run("2026-02-01T00:00:00")
    run["errors"] = {"rollout": "RuntimeError: boom"}
    (tmp_path / "full.json").write_text(json.dumps(run))
    text = report.section(str(tmp_path))
    assert "Part `rollout` (cpu) did not run: RuntimeError: boom" in text


def _result(date, parts_names, part="all", errors=None):
    machine = dict(date=date, cpu="c", cores=2, device="cpu", model="m", model_weights="pretrained", gpu=None,
                   torch="t", triton="t", transformers="t")
    recs = [dict(part=p, name=n, unit="s", fastpo=1.0, baseline=2.0, ratio=2.0, target=None, met=None,
                 baseline_name="b", fastpo_spread=0.0, baseline_spread=0.0) for p, n in parts_names]
    return dict(machine=machine, args=dict(part=part, quick=False, device="cpu"), records=recs,
                errors=errors or {}, part_seconds={p: 1.0 for p, _ in parts_names})


def test_a_full_run_killed_midway_does_not_hide_the_complete_one(tmp_path):
    """A full run stopped by a time limit (its JSON holds only its first parts) does not hide
    the older complete run's other parts."""
    (tmp_path / "old.json").write_text(json.dumps(_result(
        "2026-01-01T00:00:00+00:00", [("envs", "env-old"), ("kernels", "kernel-old"), ("rollout", "rollout-old")])))
    (tmp_path / "new.json").write_text(json.dumps(_result("2026-02-01T00:00:00+00:00", [("envs", "env-new")])))
    text = _report().section(str(tmp_path))
    assert "kernel-old" in text and "rollout-old" in text, text


def test_a_full_run_whose_part_failed_does_not_hide_an_older_good_part_run(tmp_path):
    """A part that failed in the newest full run is shown from an older run that measured it."""
    (tmp_path / "part.json").write_text(json.dumps(_result(
        "2026-01-15T00:00:00+00:00", [("rollout", "rollout-good")], part="rollout")))
    (tmp_path / "full.json").write_text(json.dumps(_result(
        "2026-02-01T00:00:00+00:00", [("envs", "env-new")], errors={"rollout": "RuntimeError: boom"})))
    text = _report().section(str(tmp_path))
    assert "rollout-good" in text, text


def test_dates_with_other_offsets_are_compared_as_times(tmp_path):
    """Dates are compared as times, not strings (09:30-02:00 is after 10:00 UTC)."""
    (tmp_path / "full.json").write_text(json.dumps(_result("2026-02-01T10:00:00+00:00", [("envs", "env")])))
    (tmp_path / "part.json").write_text(json.dumps(_result(
        "2026-02-01T09:30:00-02:00", [("rollout", "rollout-newer")], part="rollout")))
    assert "rollout-newer" in _report().section(str(tmp_path))


def test_performance_page_is_current():
    """docs/performance.md's tables are what bench/report.py renders from the committed JSON
    (run `python bench/report.py` after committing a result)."""
    assert _report().main(["--check"]) == 0, "docs/performance.md is stale: run python bench/report.py"
