"""What the probe-learning tests share: the tiny random model taught the answer format once per
test session (every xdist worker reuses it), and one StarPO run of a probe game in-process.

The format model: `fastpo sft` on probe:recall (three turns, so every turn position is seen)
with the probes' uniformly random expert, so the model answers A or B in the format with no
preference, and what a StarPO run adds after it is StarPO's own. Measured on 2 cores: the
docs' probe table (docs/probes.md)."""
from __future__ import annotations

import json
import os
import time

import torch
from filelock import FileLock
from rich.console import Console

from fastpo import registry

#: Overrides of every probe run (and the format SFT): answer-only, room for "B</answer>".
COMMON = ("rollout.think=false", "rollout.max_new_tokens=6", "trainer.plots=false", "trainer.progress=false",
          "trainer.collapse_every=0", "trainer.eval_seeds=64")
#: The format SFT: steps of 16 expert trajectories at this learning rate (its NLL per answer
#: token levels off at ~0.18 = ln 2 / 4 by step ~60: the A-or-B coin, the rest learnt).
SFT_STEPS, SFT_LR = 80, 3e-3
#: Every advantage estimator (a new one is put to the probes as it registers), and the success a probe must reach.
ESTIMATORS = tuple(registry.ESTIMATORS)
TARGET = 0.95
#: StarPO's batch and learning rate on the tiny model (lr 3e-3 collapsed the format: "<answer></").
RL = ("rollout.env_groups=4", "rollout.group_size=4", "optim.mini_batch_size=16", "optim.actor_lr=1e-3")


def format_model(root) -> str:
    """The run folder of the tiny model after the format SFT (made once under `root`, a folder
    every test worker sees, behind a file lock)."""
    out = os.path.join(str(root), "probe-format-model")
    with FileLock(out + ".lock"):
        if not os.path.exists(os.path.join(out, "checkpoints")):
            from fastpo.config import load_config
            from fastpo.sft.trainer import SFTTrainer

            cfg = load_config(env="probe:recall", preset="tiny", overrides=[
                f"trainer.output_dir={out}", "model.name=random:tiny-llama", *COMMON, f"optim.actor_lr={SFT_LR}",
                f"trainer.iterations={SFT_STEPS}", "trainer.eval_every=0", "trainer.save_every=0",
                "sft.trajectories=256", "sft.batch_size=16"], sections=("sft",))
            SFTTrainer(cfg, console=Console(quiet=True), overwrite=True).run()
    return out


def starpo(model: str, probe: str, out, estimator: str, iterations: int, *extra: str) -> list[dict]:
    """The metric records of a StarPO run of `probe:<probe>` from `model` with `estimator`, for
    `iterations` iterations, evaluated at the end on 64 seeds (temperature 0.5)."""
    from fastpo.config import load_config
    from fastpo.trainer import Trainer

    cfg = load_config(env=f"probe:{probe}", preset="tiny", overrides=[
        f"trainer.output_dir={out}", f"model.name={model}", *COMMON, *RL, f"algorithm.adv_estimator={estimator}",
        f"trainer.iterations={iterations}", f"trainer.eval_every={iterations}", "trainer.save_every=0",
        f"trainer.seed={os.environ.get('FASTPO_PROBE_SEED', '0')}", *extra])  # another seed: docs/probes.md's table
    start = time.perf_counter()
    records = Trainer(cfg, console=Console(quiet=True), overwrite=True).run()
    if os.environ.get("FASTPO_PROBE_LOG"):  # one JSON line per run: the docs' probe table is made from it
        with open(os.environ["FASTPO_PROBE_LOG"], "a") as f:
            f.write(json.dumps({"probe": probe, "estimator": estimator, "extra": list(extra), "iterations": iterations,
                                "seed": cfg.trainer.seed, "success": eval_success(records),
                                "wall_s": round(time.perf_counter() - start, 1),
                                "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}) + "\n")
    return records


def eval_success(records: list[dict]) -> float:
    """The last evaluation's success rate."""
    return [r for r in records if "eval/success_rate" in r][-1]["eval/success_rate"]


# --- the breaks: each one undoes the property a probe guards (monkeypatch: pytest's fixture) ---

def last_turn_only(monkeypatch):
    """Credit for the last turn only: every earlier turn's advantages set to 0."""
    from fastpo.trainer.batch_advantages import Advantages

    compute = Advantages.compute

    def broken(self, batch, *args, **kw):
        adv, ret, m = compute(self, batch, *args, **kw)
        turns = [torch.as_tensor(t)[: a.numel()] for t, a in zip(batch.turn_index, adv)]
        return [torch.where(t == t.max(), a, torch.zeros_like(a)) for t, a in zip(turns, adv)], ret, m

    monkeypatch.setattr(Advantages, "compute", broken)


def shifted_loss_mask(monkeypatch):
    """The loss mask one token late: the loss scores the token after each sampled one."""
    from fastpo.trainer.batch import TrainBatch

    from_rollout = TrainBatch.from_rollout.__func__

    def broken(cls, rollout, iteration):
        batch = from_rollout(cls, rollout, iteration)
        batch.loss_mask = [torch.cat([torch.zeros(1, dtype=torch.bool), m[:-1]]) for m in batch.loss_mask]
        return batch

    monkeypatch.setattr(TrainBatch, "from_rollout", classmethod(broken))


def value_loss_off(monkeypatch):
    """The critic's value loss zeroed: the value head never learns."""
    from fastpo import algorithms

    loss = algorithms.clipped_value_loss

    def broken(*args, **kw):
        value, metrics = loss(*args, **kw)
        return value * 0.0, metrics

    monkeypatch.setattr(algorithms, "clipped_value_loss", broken)


def turn_discount_ignored(monkeypatch):
    """Bi-level GAE computed with high_level_gamma = 1 whatever the setting."""
    from fastpo.algorithms import estimators

    bilevel = estimators.compute_bilevel_gae
    monkeypatch.setattr(estimators, "compute_bilevel_gae",
                        lambda r, v, m, turn, gamma, lam, high: bilevel(r, v, m, turn, gamma, lam, 1.0))
