"""A run stopped or failed before its first checkpoint leaves a folder the next run reuses
(issue 25 items 4, 5 and 8's LoRA targets; issue 58 item 7), and what the end of such a run
says (item 9).

The folder then holds config.yaml (and maybe the evaluation before training, or records of
iterations trained but never saved) but no trained weights: the same command reuses it without
--overwrite, and `--resume` starts it again from iteration 1 with its config.yaml. A folder
holding a checkpoint or a file that is not fastpo's is still refused. Small real runs on
random:tiny-llama.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import fastpo.trainer
from fastpo.run.manifest import latest_checkpoint
from fastpo.run.folder import run_folder_in_use
from fastpo.cli import main
from run_helpers import records

TINY = ["--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--iterations", "1"]
QUIET = ["trainer.plots=false", "trainer.eval_every=0", "rollout.think=false", "rollout.max_new_tokens=8"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _stranded(folder, metrics=None, extra=()):
    """A folder as a run stopped before its first checkpoint leaves it, plus `extra` paths."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.yaml"), "w", encoding="utf-8") as f:
        f.write("preset: tiny\n")
    open(os.path.join(folder, ".lock"), "w").close()
    if metrics is not None:
        with open(os.path.join(folder, "metrics.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in metrics)
    for rel in extra:
        p = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "w").close()


def _holds_no_run(out):
    """What a stop or failure before the first checkpoint leaves: its config.yaml, no
    checkpoint, no iteration past the evaluation before training (iteration 0)."""
    if not os.path.exists(os.path.join(out, "config.yaml")) or os.path.exists(os.path.join(out, "checkpoints")):
        return False
    return not os.path.exists(os.path.join(out, "metrics.jsonl")) or {r["iteration"] for r in records(out)} <= {0}


def test_untrained_start_is_only_a_folder_without_a_checkpoint_or_foreign_files(tmp_path):
    from fastpo.run.folder import unsaved_iterations, untrained_start

    ok = [({}, ()), ({"metrics": [{"iteration": 0, "eval/success_rate": 0.5}]}, ("eval/iter_000000.json",
                                                                                 "samples/iter_000000.txt")),
          ({}, ("checkpoints/.tmp-iter_000001/model.safetensors",)),
          # iterations trained but never saved (a second Ctrl-C, kill -9): no weights kept (issue 58 item 7)
          ({"metrics": [{"iteration": 0}, {"iteration": 1}]}, ("metrics.unsaved.jsonl",))]
    for i, (kw, extra) in enumerate(ok):
        _stranded(str(tmp_path / f"ok{i}"), extra=extra, **kw)
        assert untrained_start(str(tmp_path / f"ok{i}")) and run_folder_in_use(str(tmp_path / f"ok{i}")) == []
    assert unsaved_iterations(str(tmp_path / "ok1")) == [] and unsaved_iterations(str(tmp_path / "ok3")) == [1]
    kept = [({}, ("checkpoints/iter_000001/model.safetensors",)),   # a checkpoint
            ({"metrics": None}, ("notes.txt",)),                      # a file that is not fastpo's
            ({}, ("config.until_iter_000003.yaml",))]                # a resumed run's
    for i, (kw, extra) in enumerate(kept):
        _stranded(str(tmp_path / f"kept{i}"), extra=extra, **kw)
        assert not untrained_start(str(tmp_path / f"kept{i}")) and run_folder_in_use(str(tmp_path / f"kept{i}"))
    with open(tmp_path / "torn.jsonl", "w") as f:
        f.write('{"iteration": 0}\n{"iter')
    _stranded(str(tmp_path / "torn"))
    os.replace(tmp_path / "torn.jsonl", tmp_path / "torn" / "metrics.jsonl")
    assert untrained_start(str(tmp_path / "torn")) and unsaved_iterations(str(tmp_path / "torn")) is None
    assert not untrained_start(str(tmp_path / "absent"))


@pytest.mark.parametrize("extra", ["notes.txt", "checkpoints/iter_000001/model.safetensors"])
def test_a_folder_holding_more_than_an_untrained_start_is_still_refused(tmp_path, no_model, extra, capsys):
    out = str(tmp_path / "run")
    _stranded(out, extra=(extra,))
    assert main(["train", *TINY, "--out", out]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert os.path.exists(os.path.join(out, extra)) and os.path.exists(os.path.join(out, "config.yaml"))


def test_a_failure_after_set_up_leaves_a_folder_the_same_command_and_resume_reuse(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "run")
    cmd = ["train", *TINY, "--out", out, *QUIET]
    real = fastpo.trainer.Trainer.iteration

    def fails(self, it):
        raise RuntimeError("a bug in the first iteration")

    monkeypatch.setattr(fastpo.trainer.Trainer, "iteration", fails)
    with pytest.raises(RuntimeError, match="a bug"):
        main(cmd)
    said = capsys.readouterr().out.replace("\n", " ")
    assert "error before the first checkpoint" in said and "run the same command again" in said
    assert f"fastpo train --resume {out}" in said
    assert _holds_no_run(out)
    # the same command, without --overwrite
    monkeypatch.setattr(fastpo.trainer.Trainer, "iteration", real)
    assert main(cmd) == 0
    assert "reusing the folder of a run that stopped before its first checkpoint" in capsys.readouterr().out
    assert [r["iteration"] for r in records(out)] == [1] and latest_checkpoint(out).endswith("iter_000001")
    # a failure again, on a fresh folder, then --resume: iteration 1 with the saved config.yaml
    out2 = str(tmp_path / "run2")
    monkeypatch.setattr(fastpo.trainer.Trainer, "iteration", fails)
    with pytest.raises(RuntimeError):
        main(["train", *TINY, "--out", out2, *QUIET, "trainer.seed=5"])
    monkeypatch.setattr(fastpo.trainer.Trainer, "iteration", real)
    capsys.readouterr()
    assert main(["train", "--resume", out2]) == 0
    said = capsys.readouterr().out.replace("\n", " ")
    assert "starting it again from iteration 1 with its config.yaml" in said
    assert [r["iteration"] for r in records(out2)] == [1] and latest_checkpoint(out2).endswith("iter_000001")
    from fastpo.config import load_run_config

    assert load_run_config(out2).trainer.seed == 5


_SLOW_ROLLOUT = """
import sys, time
import fastpo.rollout.multiturn as mt
score = mt.MultiTurnRollout._score_turn
def slow(self, *a, **k):  # each turn of the rollout takes 5 s: the signal comes during the first
    print("ROLLOUT STARTED", flush=True)
    time.sleep(5)
    return score(self, *a, **k)
mt.MultiTurnRollout._score_turn = slow
from fastpo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_in_the_first_iteration_says_how_to_reuse_the_folder(tmp_path):
    """SIGTERM during the first rollout (a real process; the rollout ends after the turn under
    way): exit 143, the message and the end of the run say that nothing was trained and how to
    reuse the folder, and the same command then trains in it without --overwrite."""
    out = str(tmp_path / "run")
    cmd = ["train", "--env", "frozenlake", "--preset", "tiny", "--model", "random:tiny-llama", "--out", out,
           "--iterations", "1", *QUIET]
    p = subprocess.Popen([sys.executable, "-c", _SLOW_ROLLOUT, *cmd], env=ENV, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8")
    try:
        lines = []
        end = time.monotonic() + 240
        for line in p.stdout:
            lines.append(line)
            if "ROLLOUT STARTED" in line or time.monotonic() > end:
                break
        assert "ROLLOUT STARTED" in "".join(lines), "".join(lines)[-3000:]
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    said = ("".join(lines) + rest).replace("\n", " ")
    assert p.returncode == 143, said[-3000:]
    assert "stopped in iteration 1 before its update: nothing was trained yet" in said, said[-3000:]
    assert "run the same command again" in said and "dropped (a resume redoes it)" not in said
    assert "no iteration was trained;" in said and "holds config.yaml" in said  # not an empty summary
    assert _holds_no_run(out)
    assert main(cmd) == 0
    assert latest_checkpoint(out).endswith("iter_000001")


def test_fastpo_sft_stopped_before_its_first_checkpoint_is_reused(tmp_path, monkeypatch, capsys):
    from fastpo.sft import SFTTrainer

    out = str(tmp_path / "sft")
    cmd = ["sft", "--env", "sokoban", "--preset", "cpu,tiny", "--model", "random:tiny-llama", "--out", out,
           "--iterations", "1", "trainer.eval_every=0", "trainer.plots=false", "sft.trajectories=4",
           "sft.batch_size=2"]
    real = SFTTrainer.iteration

    def stop_at_once(self, it):  # Ctrl-C twice in step 1: abort without saving
        self.stop.request_stop(None, None)
        self.stop.request_stop(None, None)

    monkeypatch.setattr(SFTTrainer, "iteration", stop_at_once)
    assert main(cmd) == 130
    said = capsys.readouterr().out.replace("\n", " ")
    assert "aborted; nothing was trained yet" in said and "fastpo sft --resume" in said
    assert _holds_no_run(out)
    monkeypatch.setattr(SFTTrainer, "iteration", real)
    assert main(["sft", "--resume", out]) == 0
    assert "starting it again from step 1" in capsys.readouterr().out
    assert latest_checkpoint(out).endswith("iter_000001")
    out2 = str(tmp_path / "sft2")
    cmd2 = [out2 if a == out else a for a in cmd]
    monkeypatch.setattr(SFTTrainer, "iteration", stop_at_once)
    assert main(cmd2) == 130
    monkeypatch.setattr(SFTTrainer, "iteration", real)
    assert main(cmd2) == 0  # the same command, without --overwrite
    assert latest_checkpoint(out2).endswith("iter_000001")


def test_lora_targets_that_match_no_layer_are_one_line_and_leave_the_folder_free(tmp_path, capsys):
    out = str(tmp_path / "run")
    os.makedirs(out)
    assert main(["train", *TINY, "--out", out, *QUIET, "model.lora_rank=8",
                 "model.lora_target_modules=[nonexistent_proj, q_proj, k_prj]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "model.lora_target_modules" in err[0] and "nonexistent_proj, k_prj" in err[0]
    assert "did you mean k_proj?" in err[0] and "q_proj, up_proj, v_proj" in err[0]
    assert run_folder_in_use(out) == []


def test_resume_of_a_folder_that_cannot_be_written_names_it_not_out(tmp_path, monkeypatch, capsys):
    from fastpo.config import load_config
    from fastpo.config.files import dump_yaml

    out = tmp_path / "run"
    cfg = load_config(env="bandit", preset="tiny", overrides=[f"trainer.output_dir={out}"])
    (out / "checkpoints" / "iter_000002" / "model").mkdir(parents=True)
    for f in ("state.pt", "optimizer.pt", "model/config.json"):
        (out / "checkpoints" / "iter_000002" / f).write_bytes(b"")
    (out / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
    real = os.access
    # (the tests may run as root, for whom a read-only mode still writes: the OS's answer is faked)
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if os.path.abspath(p) == str(out) and mode & os.W_OK
                        else real(p, mode, **k))
    assert main(["train", "--resume", str(out), "--iterations", "3"]) == 2
    err = capsys.readouterr().err
    assert f"--resume {out}: the run folder is not writable" in err and "--out" not in err


def test_without_an_evaluation_before_training_there_is_no_before_after_table_but_a_line():
    from fastpo.report.summary import before_after, before_after_table

    ev = {"eval/success_rate": 0.25, "eval/success_rate_se": 0.1, "eval/format_valid": 1.0, "eval/num_seeds": 8}
    recs = [{"iteration": 1, "train/success_rate": 0.1}, {"iteration": 2, **ev},
            {"iteration": 4, **ev, "eval/success_rate": 0.5}]
    assert before_after(recs) is None and before_after_table(recs) is None  # 2 against 4 is no "before"
    from fastpo.report.summary import before_after_note

    note = before_after_note(recs)
    assert "no evaluation before training" in note
    from fastpo.report.summary import result_line

    assert result_line(recs) == "result (eval at iteration 4): success 0.500 +- 0.100 (no random-policy line in " \
        "this evaluation)"  # the last evaluation, nothing to compare it with
    with_before = [{"iteration": 0, **ev}] + recs
    assert before_after(with_before)["before"] == 0 and before_after_note(with_before) is None


def test_a_second_ctrl_c_before_the_first_checkpoint_leaves_both_ways_back(tmp_path, monkeypatch, capsys):
    """Issue 58 item 7: iteration 1 trained, no checkpoint yet (save_every 10), Ctrl-C twice in
    iteration 2. The abort line names no checkpoint that does not exist; the same command and
    `--resume` both start again from iteration 1; the unsaved iteration's record is kept aside."""
    import shutil

    out = str(tmp_path / "run")
    cmd = ["train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--out", out,
           "--iterations", "2", *QUIET, "trainer.save_every=10"]
    real = fastpo.trainer.Trainer.iteration

    def abort_in_2(self, it):
        if it == 2:  # Ctrl-C twice: abort without saving
            self.stop.request_stop(None, None)
            self.stop.request_stop(None, None)
        return real(self, it)

    monkeypatch.setattr(fastpo.trainer.Trainer, "iteration", abort_in_2)
    assert main(cmd) == 130
    said = capsys.readouterr().out.replace("\n", " ")
    assert "last checkpoint is iteration 0" not in said
    assert f"aborted; iteration 1 was trained, but {out} holds no checkpoint: run the same command again" in said
    assert f"fastpo train --resume {out}" in said
    assert [r["iteration"] for r in records(out)] == [1] and not os.path.exists(os.path.join(out, "checkpoints"))
    shutil.copytree(out, out + "-copy")
    monkeypatch.setattr(fastpo.trainer.Trainer, "iteration", real)
    # --resume: from iteration 1 with its config.yaml
    assert main(["train", "--resume", out]) == 0
    said = capsys.readouterr().out.replace("\n", " ")
    assert "starting it again from iteration 1" in said and "iteration 1 was trained, but" in said
    assert [r["iteration"] for r in records(out)] == [1, 2] and latest_checkpoint(out).endswith("iter_000002")
    from fastpo.run.folder import UNSAVED_METRICS

    with open(os.path.join(out, UNSAVED_METRICS)) as f:
        assert [json.loads(x)["iteration"] for x in f] == [1]
    # the same command, on the copy: reused without --overwrite, the same records
    copy = out + "-copy"
    assert main([copy if a == out else a for a in cmd]) == 0
    assert "reusing the folder of a run that stopped before its first checkpoint" in capsys.readouterr().out
    assert [r["iteration"] for r in records(copy)] == [1, 2] and os.path.exists(os.path.join(copy, UNSAVED_METRICS))
    # --overwrite clears the kept records with the rest
    assert main([copy if a == out else a for a in cmd] + ["--overwrite"]) == 0
    assert not os.path.exists(os.path.join(copy, UNSAVED_METRICS))
