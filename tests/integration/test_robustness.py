"""Robustness of the trainer and CLI: no run is destroyed, bad input exits 2 with one line.

All tests here are cheap: the model load is replaced by a function that raises, which
asserts that validation (and the run-folder checks) happen before any model loads.
"""
import os
import types

import pytest

from fastpo.run.checkpoint import prune_checkpoints
from fastpo.run.folder import fresh_run_folder, run_folder_in_use
from fastpo.cli import main
from run_helpers import ModelLoadReached as _ModelLoad


def _old_run(folder):
    os.makedirs(os.path.join(folder, "checkpoints", "iter_000200"))
    with open(os.path.join(folder, "config.yaml"), "w") as f:
        f.write("old: run\n")
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write('{"iteration": 1}\n')


def test_named_out_with_a_run_is_refused(tmp_path, no_model, capsys):
    out = str(tmp_path / "run")
    _old_run(out)
    assert main(["train", "--env", "frozenlake", "--preset", "cpu", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite" in err
    assert open(os.path.join(out, "config.yaml")).read() == "old: run\n"
    assert os.path.isdir(os.path.join(out, "checkpoints", "iter_000200"))


def test_overwrite_clears_the_old_run_deliberately(tmp_path, no_model):
    out = str(tmp_path / "run")
    _old_run(out)
    with pytest.raises(_ModelLoad):
        main(["train", "--env", "frozenlake", "--preset", "cpu", "--out", out, "--overwrite"])
    assert run_folder_in_use(out) == []


def test_default_folder_with_a_run_picks_a_fresh_one(tmp_path, monkeypatch, no_model, capsys):
    monkeypatch.chdir(tmp_path)
    _old_run("runs/frozenlake")
    _old_run("runs/frozenlake-2")
    assert fresh_run_folder("runs/frozenlake") == "runs/frozenlake-3"
    with pytest.raises(_ModelLoad):
        main(["train", "--env", "frozenlake", "--preset", "cpu"])
    assert "runs/frozenlake-3" in capsys.readouterr().out
    assert open("runs/frozenlake/config.yaml").read() == "old: run\n"
    assert not os.path.exists("runs/frozenlake-3")  # the failed start left no empty folder behind


def test_trainer_refuses_a_used_folder_without_overwrite(tmp_path, no_model):
    from fastpo.config import load_config
    from fastpo.trainer import Trainer

    out = str(tmp_path / "run")
    _old_run(out)
    cfg = load_config(env="bandit", preset="tiny", overrides=[f"trainer.output_dir={out}"])
    with pytest.raises(FileExistsError, match="already holds a run"):
        Trainer(cfg).setup()
    assert os.path.exists(os.path.join(out, "metrics.jsonl"))


def _intact(folder):
    """A checkpoint folder that passes `verify_checkpoint` (one without a manifest: its three files)."""
    (folder / "model").mkdir(parents=True)
    for f in ("model/config.json", "state.pt", "optimizer.pt"):
        (folder / f).write_text("{}")


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (200, 300, 3, 1000000):
        _intact(root / f"iter_{n:06d}")
    # the newly written iter_000003 survives although older-run folders have higher numbers
    dropped = prune_checkpoints(str(root), keep=2, protect="iter_000003")
    assert sorted(os.listdir(root)) == ["iter_000003", "iter_1000000"]
    assert sorted(dropped) == ["iter_000200", "iter_000300"]
    # by iteration number, not by name: iter_1000000 is newer than iter_999999
    _intact(root / "iter_999999")
    prune_checkpoints(str(root), keep=2, protect="iter_999999")
    assert sorted(os.listdir(root)) == ["iter_1000000", "iter_999999"]


def test_error_during_eval_saves_the_trained_iteration(tmp_path):
    """The loop (real run(), real logger) with the model parts replaced: eval of iteration 2 fails."""
    from rich.console import Console

    from fastpo.config import load_config
    from fastpo.report.metrics import EchoTrapDetector, MetricsLogger
    from fastpo.trainer import Trainer

    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.iterations=3", "trainer.eval_every=2",
        "trainer.save_every=0", "trainer.plots=false"])
    saved = []

    class Loop(Trainer):
        def setup(self):  # the loop's parts only: a logger, an Echo-Trap detector, where it starts,
            # no model (nothing to gather for the evaluation) and no engine (nothing to shut down)
            self.parts = types.SimpleNamespace(logger=MetricsLogger(self.out), echo=EchoTrapDetector(0.5, 1),
                                               start_iteration=1, last_eval={}, eval_pending=False,
                                               models=types.SimpleNamespace(fsdp_root=None),
                                               sampler=types.SimpleNamespace(shutdown=lambda: None))

        def iteration(self, it):
            return {"train/success_rate": 0.0, "train/score_mean": 0.0, "train/rollout_entropy": 1.0}

        def evaluate(self, it):
            raise OSError("disk full while writing eval samples")

        def save(self, it, **kw):
            saved.append(it)

    with pytest.raises(OSError, match="disk full"):
        Loop(cfg, console=Console(quiet=True)).run()
    assert saved == [2]

    class Mid(Loop):
        def iteration(self, it):
            if it == 2:
                raise RuntimeError("failed half-way through the update")
            return super().iteration(it)

    # an error inside the update: the weights are half-updated, so no checkpoint is written
    saved.clear()
    cfg.trainer.output_dir = str(tmp_path / "run2")
    with pytest.raises(RuntimeError, match="half-way"):
        Mid(cfg, console=Console(quiet=True)).run()
    assert saved == []


@pytest.mark.parametrize("override", ["trainer.seed=-1", "trainer.eval_seed_offset=-5"])
def test_negative_seeds_refused(override, capsys):
    assert main(["train", "--env", "bandit", "--preset", "cpu", override]) == 2
    assert override.split("=")[0] in capsys.readouterr().err


def _resumable(tmp_path, overrides=None):
    """A run folder as `fastpo train` leaves it: config.yaml and a (stand-in) checkpoint; with
    `overrides`, the checkpoint holds its own copy of the config (as real ones do)."""
    from fastpo.config import load_config
    from fastpo.config.files import dump_yaml

    out = tmp_path / "run"
    cfg = load_config(env="bandit", preset="tiny", overrides=[f"trainer.output_dir={out}", *(overrides or [])])
    ckpt = out / "checkpoints" / "iter_000002"
    (ckpt / "model").mkdir(parents=True)
    for f in ("state.pt", "optimizer.pt", "model/config.json"):  # what a checkpoint without a manifest needs
        (ckpt / f).write_bytes(b"")
    (out / "config.yaml").write_text(dump_yaml(cfg))
    if overrides is not None:
        (ckpt / "config.yaml").write_text(dump_yaml(cfg))
    return str(out)


def test_resume_applies_iterations_and_device(tmp_path, monkeypatch):
    import fastpo.trainer

    out = _resumable(tmp_path)
    seen = {}
    monkeypatch.setattr(fastpo.trainer, "train", lambda cfg, resume, **k: seen.update(cfg=cfg, resume=resume))
    assert main(["train", "--resume", out, "--iterations", "7", "--device", "cpu", "trainer.eval_every=7"]) == 0
    assert seen["resume"] and seen["cfg"].trainer.iterations == 7 and seen["cfg"].trainer.device == "cpu"
    assert seen["cfg"].trainer.eval_every == 7 and seen["cfg"].trainer.output_dir == out


@pytest.mark.parametrize("extra, word", [
    (["--config", "x.yaml"], "--config"), (["--preset", "grpo"], "--preset"), (["--env", "sokoban"], "--env"),
    (["--model", "random:tiny"], "--model"), (["--out", "elsewhere"], "--out"), (["--seed", "3"], "--seed"),
    (["env.options={size: 3}"], "env.options"), (["model.lora_rank=4"], "model.lora_rank"),
    # the dotted spellings of --seed, --out and --preset (trainer.seed=3 used to pass where --seed 3 was refused)
    (["trainer.seed=3"], "trainer.seed"), (["trainer.output_dir=elsewhere"], "trainer.output_dir"),
    (["preset=grpo"], "preset"),
    # a mapping spelling of the same settings (it bypassed the refusal)
    (["trainer={seed: 3}"], "trainer.seed"), (["trainer={output_dir: elsewhere, eval_every: 2}"], "trainer.output_dir"),
])
def test_resume_refuses_what_cannot_change(tmp_path, no_model, extra, word, capsys):
    out = _resumable(tmp_path)
    assert main(["train", "--resume", out, *extra]) == 2
    err = capsys.readouterr().err
    assert word in err and "cannot change on --resume" in err


def test_resume_bad_input(tmp_path, no_model, capsys):
    assert main(["train", "--resume", ""]) == 2
    assert "--resume needs the run folder" in capsys.readouterr().err
    out = _resumable(tmp_path)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write("rollout: [unclosed\n")
    assert main(["train", "--resume", out]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write("- a list\n")
    assert main(["train", "--resume", out]) == 2
    assert "mapping" in capsys.readouterr().err
    out2 = _resumable(tmp_path / "b")
    import shutil
    shutil.rmtree(os.path.join(out2, "checkpoints"))
    with open(os.path.join(out2, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.write('{"iteration": 2}\n')  # trained, and its checkpoints lost: no weights left to resume
    with pytest.raises(_ModelLoad):  # started again from iteration 1 (issue 58 item 7), not refused
        main(["train", "--resume", out2])
    said = " ".join(capsys.readouterr().out.split())
    assert f"iteration 2 was trained, but {out2} holds no checkpoint" in said and "starting it again" in said
    with open(os.path.join(out2, "metrics.unsaved.jsonl"), encoding="utf-8") as f:
        assert f.read() == '{"iteration": 2}\n'  # its record kept beside the new start
    assert os.path.isfile(os.path.join(out2, "config.yaml"))  # kept until the new start writes its own
    os.remove(os.path.join(out2, "metrics.unsaved.jsonl"))
    os.makedirs(os.path.join(out2, "checkpoints", "iter_000002"))  # a checkpoint folder, damaged: not a start
    assert main(["train", "--resume", out2]) == 2
    assert "no checkpoint found" in capsys.readouterr().err


@pytest.mark.parametrize("damage, word", [
    (lambda text: "", "lacks"),                                   # emptied: every default would apply
    (lambda text: text[:200], "lacks"),                           # truncated, still valid YAML
    (lambda text: text.replace("name: random:tiny-llama", "name: smollm2-135m-instruct"), "model.name"),
    (lambda text: text.replace("seed: 0", "seed: 7"), "trainer.seed"),
])
def test_resume_refuses_a_damaged_run_config(tmp_path, no_model, monkeypatch, damage, word, capsys):
    # a run config.yaml that cannot be the checkpoint's run used to start the resume with
    # defaults in its place (another model), ending in a traceback from the weights or optimizer
    import fastpo.trainer

    out = _resumable(tmp_path, ["model.name=random:tiny-llama"])
    monkeypatch.setattr(fastpo.trainer, "train", lambda cfg, **k: None)
    assert main(["train", "--resume", out, "--iterations", "3", "trainer.eval_every=3"]) == 0  # intact: resumes
    path = os.path.join(out, "config.yaml")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(damage(text))
    assert main(["train", "--resume", out, "--iterations", "3"]) == 2
    err = capsys.readouterr().err
    assert word in err and "iter_000002/config.yaml" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("out, model", [("runs/exp #1", "./my model #2"), ("2024", "a: b"), ("[x]", "null")])
def test_out_and_model_are_literal_strings(tmp_path, monkeypatch, out, model):
    import fastpo.model_loading
    import fastpo.trainer

    monkeypatch.chdir(tmp_path)
    seen = {}
    monkeypatch.setattr(fastpo.trainer, "train", lambda cfg, **k: seen.update(cfg=cfg))
    # names no model: the check before the run's banner would refuse it (the point here is the string)
    monkeypatch.setattr(fastpo.model_loading, "check_model_name", lambda name: None)
    assert main(["train", "--env", "bandit", "--preset", "cpu", "--out", out, "--model", model]) == 0
    assert seen["cfg"].trainer.output_dir == out and seen["cfg"].model.name == model


def test_empty_out_refused(capsys):
    assert main(["train", "--env", "bandit", "--out", ""]) == 2
    assert "--out needs a folder" in capsys.readouterr().err


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00\x81binary")
    (tmp_path / "broken.yaml").write_text("rollout: {group_size: [\n")
    (tmp_path / "adir").mkdir()
    return tmp_path


@pytest.mark.parametrize("cmd", ["train", "eval"])
@pytest.mark.parametrize("name, word", [("list.yaml", "mapping"), ("bin.yaml", "not valid YAML"),
                                        ("broken.yaml", "not valid YAML"), ("adir", "cannot read"),
                                        ("missing.yaml", "No such file")])
def test_bad_config_file_is_one_line_exit_2(bad_files, no_model, capsys, cmd, name, word):
    assert main([cmd, "--env", "bandit", "--model", "random:tiny", "--config", str(bad_files / name)]) == 2
    err = capsys.readouterr().err
    assert word in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("cmd", ["train", "eval"])
@pytest.mark.parametrize("model, word", [("/nonexistent/model/folder", "cannot be loaded"),
                                         ("random:nosuchshape", "cannot be loaded")])
def test_unknown_model_is_exit_2(tmp_path, capsys, cmd, model, word):
    extra = ["--out", str(tmp_path / "run")] if cmd == "train" else []
    assert main([cmd, "--env", "bandit", "--preset", "cpu", "--model", model, *extra]) == 2
    err = capsys.readouterr().err
    assert word in err and model in err


@pytest.mark.parametrize("cmd", ["train", "eval"])
@pytest.mark.parametrize("device", ["cuda:x", "gpu", "cpu:0:1", "cuda:99"])
def test_bad_device_is_exit_2(no_model, capsys, cmd, device):
    assert main([cmd, "--env", "bandit", "--model", "random:tiny", "--device", device]) == 2
    assert "trainer.device" in capsys.readouterr().err


def test_cuda_without_cuda_is_exit_2(no_model, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["train", "--env", "bandit", "--device", "cuda"]) == 2
    assert "cuda.is_available() is False" in capsys.readouterr().err


def test_bad_out_path_and_huge_seed(tmp_path, no_model, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["train", "--env", "bandit", "--out", str(tmp_path / "afile")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["train", "--env", "bandit", "--out", str(tmp_path / "afile" / "sub")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["train", "--env", "bandit", "--seed", str(2**64)]) == 2
    assert "trainer.seed" in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [
    ("rollout.temperature=.inf", "rollout.temperature"), ("algorithm.clip_high=.inf", "algorithm.clip_high"),
    ("optim.grad_clip=.inf", "optim.grad_clip"), ("rollout.format_penalty=-.inf", "rollout.format_penalty"),
    ("optim.betas=[0.9, .nan]", "optim.betas"), ("algorithm.dual_clip=.inf", "algorithm.dual_clip"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"), ("trainer.num_samples=-1", "trainer.num_samples"),
    ("model.lora_alpha=-16", "model.lora_alpha"), ("model.lora_dropout=1.0", "model.lora_dropout"),
    ("model.lora_dropout=-0.1", "model.lora_dropout"),
    ("rollout.max_actions_per_turn=1000000", "rollout.max_actions_per_turn"),
    ("env.options={size: -3}", "env.options"), ("env.options={bogus: 1}", "env.options"),
    ("env.options={size: abc}", "env.options"),
])
def test_values_refused_before_model_load(no_model, capsys, override, key):
    assert main(["train", "--env", "frozenlake", "--preset", "cpu", override]) == 2
    assert key in capsys.readouterr().err


def test_sokoban_options_checked(no_model, capsys):
    assert main(["train", "--env", "sokoban", "--preset", "cpu", "env.options={nope: 1}"]) == 2
    assert "env.options" in capsys.readouterr().err
    # a room too small for its boxes: found by one reset, before any model loads
    assert main(["train", "--env", "sokoban", "--preset", "cpu", "env.options={size: 6, num_boxes: 14}"]) == 2
    assert "env.options" in capsys.readouterr().err


def test_wandb_without_wandb_and_empty_preset(no_model, capsys):
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        assert main(["train", "--env", "bandit", "trainer.wandb=true"]) == 2
        assert "pip install wandb" in capsys.readouterr().err
    assert main(["train", "--env", "bandit", "--preset", ","]) == 2
    assert "names no preset" in capsys.readouterr().err


def test_triton_kernels_without_cuda_are_refused_before_loading(tmp_path, no_model, capsys, monkeypatch):
    """kernel_impl=triton on a CPU-only run used to load the model, roll out, then end in a
    traceback inside the kernels, leaving a folder that blocked the next run."""
    out = str(tmp_path / "run")
    args = ["train", "--env", "bandit", "--preset", "tiny", "--model", "random:tiny-llama", "--out", out,
            "trainer.device=cpu", "trainer.kernel_impl=triton"]
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "trainer.kernel_impl='triton' needs a CUDA device" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(out)  # nothing to clear before the same command runs again
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs them on the CPU: allowed
    with pytest.raises(_ModelLoad):
        main(args)


def test_one_iteration_is_said_in_the_singular(tmp_path, no_model, capsys):
    with pytest.raises(_ModelLoad):
        main(["train", "--env", "bandit", "--preset", "tiny", "--out", str(tmp_path / "r"), "--iterations", "1"])
    said = " ".join(capsys.readouterr().out.split())
    assert "1 iteration ->" in said and "1 iterations" not in said
