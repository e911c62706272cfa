"""Random-weight models are labelled in every output fastpo writes outside the trainer's
console: metrics records, plot titles, sample files and `fastpo eval` results."""
from __future__ import annotations

import json

import pytest

from fastpo.config import load_config
from fastpo.report.metrics import MetricsLogger, write_samples
from fastpo.report.plots import plot_curves, plot_title

LABEL = "random:tiny-llama (random weights)"


def test_metrics_records_carry_the_model_label(tmp_path):
    log = MetricsLogger(str(tmp_path), model_label=LABEL)
    log.log(1, {"train/success_rate": 0.5})
    log.log(2, {"train/success_rate": 0.7})
    with open(tmp_path / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["model"] for r in recs] == [LABEL, LABEL]
    assert "ema/model" not in recs[1] and recs[1]["ema/train/success_rate"] == pytest.approx(0.52)
    # resuming keeps them (and the EMA ignores the string)
    again = MetricsLogger(str(tmp_path), model_label=LABEL, resume_from=2)
    assert again.records[0]["model"] == LABEL and "model" not in again.ema


def test_plot_titles_name_the_model(tmp_path, monkeypatch):
    import matplotlib.axes

    titles = []
    real = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda self, t, *a, **k: (titles.append(t), real(self, t, *a, **k))[1])
    recs = [{"iteration": i, "train/success_rate": 0.1 * i, "model": LABEL} for i in range(1, 4)]
    paths = plot_curves(recs, str(tmp_path / "a"), keys={"success_rate": "train/success_rate"})
    assert len(paths) == 1 and titles == [f"success rate\n{LABEL}"]
    plot_curves([{k: v for k, v in r.items() if k != "model"} for r in recs], str(tmp_path / "b"),
                keys={"success_rate": "train/success_rate"}, model_label="smollm2-135m-instruct (pretrained weights)")
    assert titles[-1].endswith("(pretrained weights)")
    assert plot_title("success_rate") == "success rate"


def test_sample_files_start_with_the_model_label(tmp_path):
    path = write_samples(str(tmp_path), 3, ["a trajectory"], header="eval at iteration 3", model_label=LABEL)
    lines = open(path).read().splitlines()
    assert lines[0] == f"model: {LABEL}" and lines[1] == "eval at iteration 3"


def test_eval_of_a_random_model_is_labelled(tmp_path):
    from fastpo.evaluation.policy import run_eval

    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "trainer.eval_seeds=2",
        "trainer.eval_group_size=1", "rollout.max_new_tokens=4", "rollout.max_turns=1"])
    res = run_eval(cfg, samples_dir=str(tmp_path / "samples"))
    assert res["model"] == LABEL and res["model_random_weights"] is True
    text = open(tmp_path / "samples" / "iter_000000.txt").read()
    assert text.startswith(f"model: {LABEL}\n")


def test_a_runs_trained_model_is_labelled_as_trained_not_as_its_start(tmp_path, capsys):
    """Issue 58 item 13: an SFT run's samples header, summary title and metrics records past
    iteration 0 named the starting model ("... (pretrained weights)"); they name the run's
    trained model, as `fastpo eval` labels its checkpoints. The evaluation before training
    keeps the starting model's label."""
    import os

    from fastpo.cli import main

    out = str(tmp_path / "sft")
    assert main(["sft", "--env", "sokoban", "--preset", "cpu,tiny", "--model", "random:tiny-llama", "--out", out,
                 "sft.trajectories=4", "sft.batch_size=2", "trainer.eval_seeds=2"]) == 0
    trained = "the run's model (trained from random:tiny-llama, random init)"
    said = " ".join(capsys.readouterr().out.split())
    assert f"fastpo: sokoban, {trained}" in said
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    assert [(r["iteration"], r["model"]) for r in recs] == [(0, LABEL), (1, trained), (2, trained)]
    for it, label in ((0, LABEL), (2, trained)):
        with open(os.path.join(out, "samples", f"iter_{it:06d}.txt")) as f:
            assert f.readline() == f"model: {label}\n"
