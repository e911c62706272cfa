"""One train step read top to bottom, and stopping as a flag (issue 57, item 1).

The StarPO iteration is one function (`fastpo.trainer.step.Trainer.iteration`) that calls each
step's part in order, a few frames below `train()`; the run loop asks the trainer, not its
parts or its metrics; a SIGTERM sets a flag that the rollout reads between turns, so nothing
is thrown through the rollout. Tiny model (random:tiny-llama), a few seconds per run.
"""
import ast
import inspect
import os
import pathlib
import re
import signal

import torch
from rich.console import Console

import fastpo.rollout
from fastpo.cli import main
from fastpo.config import load_config
from fastpo.trainer import train

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ["--model", "random:tiny-llama", "--preset", "tiny", "--device", "cpu"]
QUIET = ["trainer.plots=false", "trainer.eval_every=0", "trainer.eval_before_training=false", "rollout.think=false",
         "rollout.max_new_tokens=8"]


def _function(path: pathlib.Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls(fn: ast.AST) -> list[str]:
    """The dotted names of the calls in `fn`, in source order."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                found.append((node.lineno, node.col_offset, ".".join([f.id, *reversed(parts)])))
    return [name for _, _, name in sorted(found)]


def test_the_iteration_is_one_function_calling_each_step_in_order():
    """rollout -> filter -> batch -> old log-probs -> advantages -> update, each a call into its
    part, in one function that fits on a screen."""
    fn = _function(ROOT / "fastpo" / "trainer" / "step.py", "Trainer", "iteration")
    steps = ["p.sampler.roll_out", "self.filter", "TrainBatch.from_rollout", "p.logprobs.old_logprobs",
             "self.advantages.estimate", "p.updater.update"]
    calls = _calls(fn)
    assert [c for c in calls if c in steps] == steps, calls
    assert fn.end_lineno - fn.lineno + 1 <= 60


def test_the_run_loop_neither_reaches_into_parts_by_name_nor_names_a_trainers_metric():
    """RunLoop asks the trainer (`iteration`, `evaluate`, `progress_fields`), not getattr on its
    parts, and the only metric keys written in it are its own (the iteration's seconds, a
    failed evaluation's mark)."""
    tree = ast.parse((ROOT / "fastpo" / "trainer" / "loop.py").read_text())
    loop = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunLoop")
    assert "getattr" not in _calls(loop)
    keys = {n.value for n in ast.walk(loop) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and re.fullmatch(r"[a-z_]+/[a-z0-9_@/]*[a-z0-9_@]", n.value)}
    assert keys <= {"time/iteration_s", "eval/failed"}, keys


def test_train_reaches_the_optimizer_step_in_six_frames(tmp_path, monkeypatch):
    """From `train()` to the call of the optimizer's step: train -> RunLoop.run ->
    Trainer.iteration -> PolicyUpdater.update -> step -> optimizer_step (it was 11 frames)."""
    seen = []
    real = torch.optim.AdamW.step

    def step(self, *a, **k):
        if not seen:
            frames = [f for f in inspect.stack() if f.filename.startswith(str(ROOT / "fastpo"))]
            seen.append([f.function for f in reversed(frames)])
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    cfg = load_config(env="bandit", preset="tiny", overrides=[
        f"trainer.output_dir={tmp_path / 'run'}", "model.name=random:tiny-llama", "trainer.iterations=1",
        "trainer.save_every=0", *QUIET])
    train(cfg, console=Console(quiet=True))
    chain = seen[0][seen[0].index("train"):]
    assert chain == ["train", "run", "iteration", "update", "step", "optimizer_step"], seen[0]


def test_a_sigterm_in_a_rollout_ends_it_between_turns_and_throws_nothing_through_it(tmp_path, monkeypatch, capsys):
    """A real SIGTERM during turn 1 of 3: the handler only sets the flag (the code it
    interrupted goes on), the rollout returns after that turn without generating turn 2, the
    iteration is dropped before its update, and the run exits 143 saying so. (Before, the
    handler raised an exception from inside the rollout.)"""
    seen = {"turns": 0, "went_on": False, "raised": None, "returned": 0}
    real_score, real_generate = fastpo.rollout.MultiTurnRollout._score_turn, fastpo.rollout.MultiTurnRollout.generate

    def score(self, st, texts, turn):
        seen["turns"] += 1
        try:
            signal.raise_signal(signal.SIGTERM)
            seen["went_on"] = True
        except BaseException as e:
            seen["raised"] = type(e).__name__
            raise
        return real_score(self, st, texts, turn)

    def generate(self, *a, **k):
        batch = real_generate(self, *a, **k)
        seen["returned"] += 1
        return batch

    monkeypatch.setattr(fastpo.rollout.MultiTurnRollout, "_score_turn", score)
    monkeypatch.setattr(fastpo.rollout.MultiTurnRollout, "generate", generate)
    out = str(tmp_path / "run")
    status = main(["train", "--env", "sokoban", *TINY, "--out", out, "--iterations", "2", *QUIET,
                   "rollout.max_turns=3", "trainer.save_every=1"])
    said = capsys.readouterr().out
    assert seen == {"turns": 1, "went_on": True, "raised": None, "returned": 1}, seen
    assert status == 143
    assert "stopped in iteration 1 before its update" in said
    assert not os.path.isdir(os.path.join(out, "checkpoints"))
