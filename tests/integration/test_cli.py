"""CLI: bad configuration is refused with a message naming the key, before any model loads."""
import subprocess
import sys

import pytest

CHECK = """
import sys
from fastpo.cli import main
rc = main(sys.argv[1:])
assert 'fastpo.model_loading' not in sys.modules and 'fastpo.rollout' not in sys.modules, 'a model module was imported'
sys.exit(rc)
"""


@pytest.mark.parametrize("args, words", [
    (["train", "--env", "frozenlake", "rollout.group_size=0"], ["rollout.group_size", ">= 1"]),
    (["train", "--env", "bandit", "--preset", "paper", "algorithm.clip_high=0.1"], ["algorithm.clip_high"]),
    (["train", "--env", "sokoban", "--preset", "cpu", "optim.mini_batch_size=17"], ["optim.mini_batch_size", "larger"]),
    (["train", "--env", "frozenlake", "algorithm.adv_estimatorr=grpo"], ["unknown config key", "adv_estimatorr"]),
    (["train", "--env", "frozenlake", "rollout.max_turns=many"], ["rollout.max_turns", "expected int"]),
    (["train", "--preset", "turbo"], ["unknown preset", "turbo"]),
    (["eval", "--env", "bandit", "--model", "x", "--k", "0"], ["trainer.eval_group_size"]),
    (["train", "--resume", "/nonexistent/run"], ["config.yaml", "not found"]),
    # overrides after an option are overrides too (they were "unrecognized arguments"), validated the same
    (["train", "--env", "bandit", "rollout.group_size=4", "--out", "/tmp/x", "trainer.seed=abc"],
     ["trainer.seed", "expected int"]),
    (["train", "--env", "bandit", "rollout.group_size=4", "--nproc", "2", "--out", "/tmp/x", "rollout.group_size=0"],
     ["rollout.group_size", ">= 1"]),
    (["eval", "--env", "bandit", "rollout.max_turns=3", "--model", "x", "rollout.max_turnz=3"],
     ["unknown config key", "max_turnz"]),
    (["train", "--env", "bandit", "model.lora_rank=8", "model.lora_target_modules=[]"],
     ["model.lora_target_modules", "[]"]),
    (["train", "--env", "bandit", "trainer.output_dir="], ["trainer.output_dir", "must name a folder"]),
    (["train", "--env", "bandit", "--out", "/tmp/x", "stray"], ["stray", "section.key=value"]),
    # the flag would do nothing without --resume: said, not ignored
    (["train", "--env", "bandit", "--trust-checkpoint"], ["--trust-checkpoint", "--resume"]),
])
def test_cli_refuses_bad_config_before_loading(args, words, tmp_path):
    # in an empty folder: a default run folder (runs/<env>) must not exist already
    p = subprocess.run([sys.executable, "-c", CHECK, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    for w in words:
        assert w in p.stderr


def test_sft_refuses_trust_without_resume(no_model, tmp_path, monkeypatch, capsys):
    from fastpo.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["sft", "--env", "bandit", "--trust-checkpoint"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trust-checkpoint" in err[0] and "--resume" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_overrides_on_both_sides_of_an_option_are_applied(no_model, tmp_path, monkeypatch):
    import fastpo.cli
    from run_helpers import ModelLoadReached

    seen = {}
    real = fastpo.cli.train.build_config

    def spy(*a):
        seen["cfg"] = cfg = real(*a)
        return cfg

    monkeypatch.setattr(fastpo.cli.train, "build_config", spy)
    with pytest.raises(ModelLoadReached):
        fastpo.cli.main(["train", "--env", "bandit", "rollout.group_size=4", "--out", str(tmp_path / "r"),
                         "trainer.seed=3", "--iterations", "2", "rollout.group_size=8"])
    cfg = seen["cfg"]
    assert (cfg.trainer.seed, cfg.rollout.group_size, cfg.trainer.iterations) == (3, 8, 2)  # in argv order


def test_help_says_what_each_command_reads(capsys):
    """Issue 58 item 15: `--env` did not mention `a,b` mixtures; `fastpo sft --help` listed no
    sft.* key and gave algorithm.* examples SFT does not read."""
    import dataclasses

    from fastpo.cli import main
    from fastpo.config.imitation import SFTConfig

    helps = {}
    for cmd in ("train", "sft", "eval"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        helps[cmd] = " ".join(capsys.readouterr().out.split())
    assert "a,b (e.g. bandit,frozenlake)" in helps["train"] and "a,b" in helps["eval"]
    assert "with --model RUN" in helps["eval"]
    keys = [f"sft.{f.name}" for f in dataclasses.fields(SFTConfig) if f.name != "data_sha256"]  # (set by the run)
    assert all(k in helps["sft"] for k in keys), [k for k in keys if k not in helps["sft"]]
    assert "algorithm.adv_estimator=grpo" not in helps["sft"] and "not read by SFT" in helps["sft"]


_CTRL_C_AT_SET_UP = """
import signal, sys, time
# a terminal's Ctrl-C: SIGINT deliverable with Python's own handler (a test worker's process may
# pass a blocked or ignored SIGINT on to its children; the state it passed is in the message below)
started = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}))
signal.signal(signal.SIGINT, signal.default_int_handler)
import fastpo.sft.data
def interrupted(*a, **k):  # a Ctrl-C while the expert's data is made (before any model loads)
    signal.raise_signal(signal.SIGINT)
    # the handler ends the command; wait for it (a signal sent with os.kill may reach another
    # thread and the main thread's handler only later: under load the set-up ran on without data)
    for _ in range(300):
        time.sleep(0.1)
    raise AssertionError(f"the SIGINT handler did not end the command within 30 s (SIGINT now "
                         f"{signal.getsignal(signal.SIGINT)}; at start: handler, blocked {started})")
fastpo.sft.data.load_sft_data = interrupted
from fastpo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_ctrl_c_before_the_run_began_is_one_line_and_130(tmp_path):
    """A real Ctrl-C during set-up printed a KeyboardInterrupt traceback; the command's own
    SIGINT handler (which tells a Ctrl-C from a game raising KeyboardInterrupt, issue 58 item
    9) ends it with one line and 130."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", _CTRL_C_AT_SET_UP, "sft", "--env", "bandit", "--preset", "cpu,tiny",
                        "--model", "random:tiny-llama", "--out", str(out)], capture_output=True, text=True,
                       encoding="utf-8", timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    err = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 130 and err == ["fastpo sft: interrupted by Ctrl-C before the run began; nothing was "
                                           "written or trained"], (p.returncode, p.stderr[-2000:])
    assert not out.exists()
