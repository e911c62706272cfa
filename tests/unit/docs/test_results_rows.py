"""The results rows that come from recorded runs (tools/results_row.py): each still matches the
configuration its command resolves to and the evaluation code, and the README and docs/results.md
show the record's own rows (the README's short one, docs/results.md's full one). A change to the
preset or the evaluation code fails here until the run is made again and re-recorded."""
import pathlib
import copy
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(str(pathlib.Path(__file__).resolve().parents[3]), "tools"))
import results_row  # noqa: E402

import fastpo.config.presets  # noqa: E402


def test_recorded_rows_are_current():
    assert os.listdir(results_row.RECORDS), "no recorded run"
    bad = results_row.problems()
    assert not bad, "\n".join(bad)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A record of `--env frozenlake --preset cpu` made now, its README row, its eval source."""
    src = tmp_path / "evaluate.py"
    src.write_text("x = 1\n")
    monkeypatch.setattr(results_row, "EVAL_SOURCES", (str(src),))
    monkeypatch.setattr(results_row, "RECORDS", str(tmp_path / "runs"))
    monkeypatch.setattr(results_row, "README", str(tmp_path / "README.md"))
    monkeypatch.setattr(results_row, "PAGE", str(tmp_path / "results.md"))
    argv = ["--env", "frozenlake", "--preset", "cpu"]
    row = {"before": 0.2, "after": 0.3, "before_se": 0.05, "after_se": 0.05, "change": 0.1, "z": 1.4,
           "z_paired": 2.0}
    rec = {"name": "t", "title": "`make train`", "argv": argv, "commit": "0" * 40, "recorded": "2026-12-02",
           "wall_s": 600.0, "config_sha256": results_row._sha(results_row._config_text(argv)),
           "eval_code_sha256": results_row._eval_fingerprint("frozenlake"),
           "figures": {"eval/success_rate": row, "eval/random_success": {**row, "after": 0.224}}}
    os.makedirs(results_row.RECORDS)
    with open(os.path.join(results_row.RECORDS, "t.json"), "w") as f:
        json.dump(rec, f)
    (tmp_path / "README.md").write_text("# x\n" + results_row.render(rec) + "\n")
    (tmp_path / "results.md").write_text("# x\n" + results_row.render_full(rec) + "\n")
    return src


def test_a_moved_preset_eval_code_or_readme_row_is_named(fake, monkeypatch, tmp_path):
    assert results_row.problems() == []
    cpu = copy.deepcopy(fastpo.config.presets.PRESETS["cpu"])
    cpu["trainer"]["eval_seeds"] = 32
    monkeypatch.setitem(fastpo.config.presets.PRESETS, "cpu", cpu)
    said = results_row.problems()
    assert len(said) == 1 and "the configuration of `fastpo train --env frozenlake --preset cpu` changed" in said[0]
    monkeypatch.undo()
    monkeypatch.setattr(results_row, "EVAL_SOURCES", (str(fake),))
    monkeypatch.setattr(results_row, "RECORDS", str(tmp_path / "runs"))
    monkeypatch.setattr(results_row, "README", str(tmp_path / "README.md"))
    monkeypatch.setattr(results_row, "PAGE", str(tmp_path / "results.md"))
    fake.write_text("x = 2\n")
    said = results_row.problems()
    assert len(said) == 1 and "the evaluation code" in said[0] and "changed since 0000000" in said[0]
    fake.write_text("x = 1\n")
    (tmp_path / "README.md").write_text("# x\n| `make train` | success 0.2 -> 0.9 |\n")
    said = results_row.problems()
    assert len(said) == 1 and "README.md's row is not the record's" in said[0]
    (tmp_path / "results.md").write_text("# x\n| `make train` | success 0.2 -> 0.9 |\n")
    said = results_row.problems()
    assert len(said) == 2 and "docs/results.md's row is not the record's" in said[1]


def test_a_docstring_or_comment_keeps_a_record_current_and_code_does_not(fake):
    """The evaluation fingerprint ignores docstrings and whole-line comments, not code."""
    assert results_row.problems() == []
    fake.write_text('"""A module docstring,\nover two lines."""\n# a comment\n\nx = 1   \n')
    assert results_row.problems() == []
    fake.write_text('x = 1\n\n\ndef f():\n    """f\'s docstring."""\n    return x\n')
    moved = results_row._eval_fingerprint("frozenlake")
    fake.write_text('x = 1\n\n\ndef f():\n    """Reworded."""\n    # why\n    return x\n')
    assert results_row._eval_fingerprint("frozenlake") == moved
    fake.write_text('x = 1\n\n\ndef f():\n    """Reworded."""\n    return -x\n')
    assert results_row._eval_fingerprint("frozenlake") != moved
    fake.write_text('x = "# not a comment"\n')
    said = results_row.problems()
    assert len(said) == 1 and "the evaluation code" in said[0]
    fake.write_text('x = 1\ny = """\n# a line of a string\n"""\n')
    inside = results_row._eval_fingerprint("frozenlake")
    fake.write_text('x = 1\ny = """\n# another line of a string\n"""\n')
    assert results_row._eval_fingerprint("frozenlake") != inside
    fake.write_text('x = 1  # a comment after code\n')
    assert results_row.problems() != []
