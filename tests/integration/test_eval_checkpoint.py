"""A fastpo checkpoint knows where its weights came from and how it was trained.

One tiny Bandit run (random:tiny-llama, answer-only, 8 new tokens, one iteration) is shared:

- `find_checkpoint` reads the run folder, its checkpoints/, the checkpoint folder and its
  model/ folder as the same checkpoint; anything else is not one.
- Loading any of those forms says "trained from random:tiny-llama, random init" and
  `info.random` is True; also for checkpoints written before `fastpo_model.json` existed
  (from their config.yaml), and for a run trained from such a checkpoint.
- `fastpo eval` of the checkpoint uses the run's env and rollout settings unless the command
  line sets them, says so in one line, names its sample file after the checkpoint's
  iteration and writes `--json`.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from rich.console import Console

from fastpo.run.checkpoint import save_checkpoint
from fastpo.run.origin import MODEL_META, checkpoint_origin, find_checkpoint, model_origin
from fastpo.config import load_config
from fastpo.config.fields import ConfigError
from fastpo.evaluation.settings import eval_config
from fastpo.model_loading import load_model_and_tokenizer
from run_helpers import ModelLoadReached

ORIGIN = "trained from random:tiny-llama, random init"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from fastpo.trainer import Trainer

    out = str(tmp_path_factory.mktemp("ckpt") / "run")
    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={out}", "model.name=random:tiny-llama", "trainer.iterations=1",
        "trainer.eval_every=0", "trainer.plots=false", "rollout.think=false", "rollout.max_new_tokens=8"])
    Trainer(cfg, console=Console(quiet=True)).run()
    return out


def test_every_form_of_the_checkpoint_is_found(run, tmp_path):
    folder = os.path.join(run, "checkpoints", "iter_000001")
    for form in (run, run + "/", os.path.join(run, "checkpoints"), folder, os.path.join(folder, "model")):
        ref = find_checkpoint(form)
        assert ref is not None, form
        assert os.path.samefile(ref.folder, folder) and os.path.samefile(ref.model_dir, os.path.join(folder, "model"))
        assert ref.iteration == 1 and os.path.samefile(ref.run_dir, run)
        assert os.path.samefile(ref.config_path, os.path.join(folder, "config.yaml"))  # the checkpoint's own copy
    # not checkpoints: a plain HF folder, a missing path, a hub id, a folder with an empty checkpoints/
    plain = tmp_path / "plain"
    shutil.copytree(os.path.join(folder, "model"), plain)
    (tmp_path / "other" / "checkpoints").mkdir(parents=True)
    for form in (str(plain), str(tmp_path / "missing"), "org/name", str(tmp_path / "other")):
        assert find_checkpoint(form) is None, form
    # a run folder (config.yaml) that has no checkpoint yet is an error naming it
    (tmp_path / "early" / "checkpoints").mkdir(parents=True)
    (tmp_path / "early" / "config.yaml").write_text("preset: tiny\n")
    with pytest.raises(ValueError, match="early' is a fastpo run folder without a complete checkpoint"):
        find_checkpoint(str(tmp_path / "early"))


def test_checkpoint_records_its_origin(run):
    meta = json.load(open(os.path.join(run, "checkpoints", "iter_000001", "model", MODEL_META)))
    assert meta == {"run": os.path.abspath(run), "iteration": 1, "trained_from": "random:tiny-llama",
                    "init_model": "random:tiny-llama", "random_init": True}


def test_loading_a_checkpoint_says_it_started_from_random_weights(run):
    folder = os.path.join(run, "checkpoints", "iter_000001")
    weights = None
    for form in (os.path.join(folder, "model"), folder, run):
        model, _, info = load_model_and_tokenizer(form)
        assert info.random is True and info.random_init is True and info.source == "local", form
        assert info.trained_from == "random:tiny-llama" and info.iteration == 1
        assert os.path.samefile(info.checkpoint, folder) and os.path.samefile(info.path, os.path.join(folder, "model"))
        w = model.get_input_embeddings().weight
        weights = w if weights is None else weights
        assert torch.equal(w, weights)
    assert load_model_and_tokenizer(os.path.join(folder, "model"))[2].label == f"{os.path.join(folder, 'model')} ({ORIGIN})"
    assert load_model_and_tokenizer(folder)[2].label == f"{folder} ({ORIGIN})"
    # a run folder names the checkpoint it resolved to
    assert load_model_and_tokenizer(run)[2].label == f"{run} (iter_000001, {ORIGIN})"
    # the untrained random model keeps its own label
    assert load_model_and_tokenizer("random:tiny-llama")[2].label == "random:tiny-llama (random weights)"


def test_older_checkpoint_without_the_record_reads_its_config(run, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(run, old)
    os.remove(old / "checkpoints" / "iter_000001" / "model" / MODEL_META)
    _, _, info = load_model_and_tokenizer(str(old / "checkpoints" / "iter_000001" / "model"))
    assert info.random is True and ORIGIN in info.label
    # a model folder copied out of its run keeps its record; without it, it is a plain HF model
    alone = tmp_path / "alone"
    shutil.copytree(os.path.join(run, "checkpoints", "iter_000001", "model"), alone)
    assert load_model_and_tokenizer(str(alone))[2].label == f"{alone} ({ORIGIN})"
    os.remove(alone / MODEL_META)
    info = load_model_and_tokenizer(str(alone))[2]
    assert info.label == f"{alone} (pretrained weights)" and not info.random and checkpoint_origin(str(alone)) is None


def test_a_run_trained_from_a_checkpoint_keeps_the_first_origin(run, tmp_path):
    parent = os.path.join(run, "checkpoints", "iter_000001", "model")
    assert model_origin(parent) == {"init_model": "random:tiny-llama", "random_init": True}
    assert model_origin("smollm2-135m-instruct") == {"init_model": "smollm2-135m-instruct", "random_init": False}
    assert model_origin(str(tmp_path / "gone" / "x" / "model"))["random_init"] is None  # unknown, not "pretrained"
    model, tok, info = load_model_and_tokenizer(parent)
    second = str(tmp_path / "second")
    path = save_checkpoint(second, 4, model=model, tokenizer=tok, optimizers={}, state={},
                           config_yaml=f"model:\n  name: {parent}\n")
    meta = json.load(open(os.path.join(path, "model", MODEL_META)))
    assert meta["trained_from"] == parent and meta["init_model"] == "random:tiny-llama" and meta["random_init"] is True
    info2 = load_model_and_tokenizer(path)[2]
    assert info2.random and info2.iteration == 4 and info2.label == f"{path} ({ORIGIN})"


def test_eval_config_takes_the_runs_settings(run, tmp_path):
    # the command's defaults would be frozenlake and the CPU preset's 16 tokens with answer examples
    cfg, rs = eval_config(values={"model.name": run})
    assert cfg.env.name == "bandit" and cfg.rollout.think is False and cfg.rollout.max_new_tokens == 8
    assert cfg.rollout.max_turns == 1 and not rs.env_mismatch and cfg.rollout.prompt_examples is False
    assert rs.taken["rollout.prompt_examples"] is False and rs.taken["rollout.max_new_tokens"] == 8 and not rs.kept
    line = rs.describe()
    assert line.startswith(f"settings of run {run} (") and "env bandit" in line and "rollout.max_new_tokens=8" in line
    # explicit command-line values win and are named
    cfg, rs = eval_config(overrides=["rollout.max_new_tokens=4"], values={"model.name": run})
    assert cfg.rollout.max_new_tokens == 4 and cfg.rollout.think is False
    assert rs.kept == {"rollout.max_new_tokens": (4, 8)} and "rollout.max_new_tokens=4 (run: 8)" in rs.describe()
    conf = tmp_path / "c.yaml"
    conf.write_text("rollout:\n  think: true\n")
    cfg, rs = eval_config(file=str(conf), values={"model.name": run})
    assert cfg.rollout.think is True and cfg.rollout.max_new_tokens == 8 and "rollout.think" in rs.kept
    # another env: allowed, said, and bandit's one-turn limit is not carried over
    cfg, rs = eval_config(env="sokoban", values={"model.name": run})
    assert cfg.env.name == "sokoban" and rs.env_mismatch and cfg.rollout.max_turns > 1
    assert cfg.rollout.think is False and "trained on bandit and is evaluated on sokoban" in rs.mismatch_note()
    # a model that is not a checkpoint: the command's settings, nothing taken
    cfg, rs = eval_config(env="bandit", values={"model.name": "random:tiny-llama"})
    assert rs is None and cfg.rollout.max_new_tokens == 16 and cfg.rollout.prompt_examples is True
    (tmp_path / "early" / "checkpoints").mkdir(parents=True)
    (tmp_path / "early" / "config.yaml").write_text("preset: tiny\n")
    with pytest.raises(ConfigError, match="without a complete checkpoint"):
        eval_config(values={"model.name": str(tmp_path / "early")})


def test_eval_config_env_options_of_the_runs_env(run):
    # an option of the run's env (bandit) without --env: it used to be checked against the
    # command's default env first and refused ("unknown config key(s) ['high_prob'] for 'frozenlake'")
    cfg, rs = eval_config(overrides=["env.options.high_prob=0.5"], values={"model.name": run})
    assert cfg.env.name == "bandit" and cfg.env.options["high_prob"] == 0.5 and not rs.env_mismatch
    with pytest.raises(ConfigError, match="'bandit'.*size"):  # still checked, against the run's env
        eval_config(overrides=["env.options.size=4"], values={"model.name": run})


def test_fastpo_eval_of_a_checkpoint(run, tmp_path, capsys):
    from fastpo.cli import main

    model_dir = os.path.join(run, "checkpoints", "iter_000001", "model")
    out_json = tmp_path / "res" / "eval.json"
    assert main(["eval", "--model", model_dir, "--seeds", "2", "--k", "1", "--samples", str(tmp_path / "s"),
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert f"settings of run {run}" in " ".join(text.split())
    label = f"{model_dir} ({ORIGIN})"
    sample = (tmp_path / "s" / "iter_000001.txt").read_text()
    assert sample.startswith(f"model: {label}\n")
    assert "Max response length: 8 tokens" in sample and "<think>" not in sample  # the prompt it trained on
    rec = json.loads(out_json.read_text())
    assert rec["model"] == label and rec["model_random_weights"] is True and rec["iteration"] == 1
    assert rec["env"] == "bandit" and rec["trained_env"] == "bandit" and rec["trained_from"] == "random:tiny-llama"
    assert rec["rollout"]["think"] is False and rec["rollout"]["max_new_tokens"] == 8
    assert rec["eval"]["seeds"] == 2 and rec["eval"]["samples_per_seed"] == 1
    assert 0.0 <= rec["metrics"]["success_rate"] <= 1.0 and rec["metrics"]["num_seeds"] == 2
    # --json naming a folder is refused before any model loads
    assert main(["eval", "--model", model_dir, "--json", str(tmp_path)]) == 2
    assert "--json" in capsys.readouterr().err


def _fake_run(folder, cfg):
    """A run's checkpoint folder as `fastpo eval` reads it for its settings (the run's config.yaml;
    the checkpoint's files are there, unread: no model loads in these tests)."""
    from fastpo.config.files import dump_yaml

    ckpt = folder / "checkpoints" / "iter_000001"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "config.json").write_text("{}")
    (ckpt / "state.pt").write_bytes(b"")
    (folder / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
    return str(ckpt)


def test_eval_of_a_run_repeats_its_evaluation_settings(tmp_path):
    """Issue 58 item 12: without --seeds, `fastpo eval --model RUN` took the preset's 64 seeds, not
    the run's 32 (and the run's eval temperature, samples per seed and sampling seed)."""
    run = _fake_run(tmp_path / "run", load_config(env="frozenlake", preset="cpu", overrides=[
        "trainer.eval_seeds=32", "trainer.eval_temperature=0.7", "trainer.eval_group_size=2", "trainer.seed=3",
        "trainer.eval_seed_offset=5000"]))
    cfg, rs = eval_config(values={"model.name": run})
    t = cfg.trainer
    assert (t.eval_seeds, t.eval_temperature, t.eval_group_size, t.seed, t.eval_seed_offset) == (32, 0.7, 2, 3, 5000)
    assert "trainer.eval_seeds=32" in rs.describe()
    # the command line still wins, and is named
    cfg, rs = eval_config(overrides=["trainer.eval_seeds=8", "trainer.seed=1"], values={"model.name": run})
    assert (cfg.trainer.eval_seeds, cfg.trainer.seed) == (8, 1) and rs.kept["trainer.eval_seeds"] == (8, 32)


def test_eval_of_one_game_of_a_mixture_says_what_it_carried_and_takes_a_label(tmp_path, no_model, capsys):
    """Issue 58 item 8: evaluating one game of a mixture printed that the run's options and limits
    were not carried over, while they were; item 16: a second entry of the same game can be named
    by its label (`--env LABEL`)."""
    from fastpo.cli import main

    mix = ["env.mixture=[{name: frozenlake, label: slippery}, {name: frozenlake, label: dry, options: "
           "{is_slippery: false}, settings: {max_turns: 4}}, {name: bandit}]"]
    run = _fake_run(tmp_path / "run", load_config(preset="cpu", overrides=mix))
    cfg, rs = eval_config(env="frozenlake", values={"model.name": run})
    assert cfg.env.options.get("is_slippery", True) is True and rs.member == "slippery"
    assert "not carried over" not in rs.mismatch_note() and "its game 'slippery' alone" in rs.mismatch_note()
    cfg, rs = eval_config(env="dry", values={"model.name": run})
    assert cfg.env.name == "frozenlake" and cfg.env.options["is_slippery"] is False and cfg.rollout.max_turns == 4
    assert "its game 'dry' alone, with that entry's options and turn and action limits" in rs.mismatch_note()
    with pytest.raises(ModelLoadReached):
        main(["eval", "--model", run, "--env", "dry"])
    said = " ".join(capsys.readouterr().out.split())
    assert "env frozenlake" in said and "is_slippery" in said and "not carried over" not in said
    # a label of no entry is still an unknown env
    assert main(["eval", "--model", run, "--env", "nosuchlabel"]) == 2
