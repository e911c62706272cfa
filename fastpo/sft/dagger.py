"""DAgger for text games (`fastpo dagger`): the expert labels the states the model reaches.

DAgger (Ross, Gordon & Bagnell 2011, arXiv 1011.0686): a model trained on an expert's
trajectories meets, when it plays, states the expert never led it into, and its errors there
compound. Each round rolls the current model out, asks the expert what it would answer in
every state the model reached, and trains on those labels. `fastpo dagger` runs

- round 0 (`dagger.sft_round`, on by default): supervised fine-tuning on the expert's own
  trajectories, exactly what `fastpo sft` trains (the `sft` section; DAgger's first
  iteration, whose policy is the expert's);
- rounds 1..N: the previous round's model plays `dagger.levels` fresh training levels at
  `dagger.temperature`; each answered turn gets the expert's answer for the state it was
  given in (fastpo.sft.labels.label_trajectories); the conversations (`labelled_conversations`)
  are written as a JSONL chat file and the model is fine-tuned on them (`fastpo sft
  sft.data=FILE`'s trainer, one epoch by default) into the round's own run folder.

Conversations (TRL's chat format; `"weight": 0` marks context, OpenAI's fine-tuning format):
`dagger.history=own` (default; what the measurements in docs/sft.md found best) gives one
conversation per labelled turn, the model's own earlier answers as context and the label as
the one target, so the model learns to act from the histories it makes itself;
`dagger.history=expert` gives one conversation per trajectory with every answer replaced by
its label. By default a round trains on its own data only (continuing from the previous
round's weights); `dagger.aggregate=true` trains round k on the union of rounds 1..k, DAgger's
rule.

Run folder OUT: `config.yaml` (the run configuration every round shares, its `sft` and
`dagger` sections included; a run made before config.yaml held them kept them in
`dagger.yaml`), `round-0/` ... `round-N/` (each an ordinary `fastpo sft` run folder: its model
is what `--model OUT/round-k` loads), `data/round-k.jsonl` and its summary
`data/round-k.json`, `rounds.json` (one record per finished round). Every step can be
stopped and continued: a round's rollout is saved chunk by chunk (`dagger.chunk` levels),
its training checkpoint by checkpoint; `fastpo dagger --resume OUT` (or the same command
again) continues at the round and step where the run stopped.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from typing import Optional

import numpy as np
import torch
from rich.table import Table

from fastpo import rollout as ro
from fastpo.config.fields import ConfigError
from fastpo.config.files import dump_yaml, parse_config_yaml
from fastpo.config.loading import load_run_config
from fastpo.memory import release_free_memory
from fastpo.model_loading import load_model_checked, resolve_device
from fastpo.run.checkpoint import plan_resume
from fastpo.run.folder import DAGGER_FILE, RunLock, atomic_write_text
from fastpo.run.manifest import search_checkpoints
from fastpo.sft.config import handoff_command
from fastpo.sft.experts import expert_rollout
from fastpo.sft.labels import expert_conversations, jsonl, label_trajectories, labelled_conversations
from fastpo.sft.trainer import SFTTrainer

# (seed, round, salt) -> a round's rollout sampling seed (a chunk starting at level index i samples
# with it + i); (seed, round, chunk, salt) -> the labelled turns that chunk keeps. Pure functions of
# their arguments, so a resumed round redoes a chunk exactly. (Here rather than in fastpo.seeds,
# whose every change marks the recorded evaluations stale: tools/results_row.py.)
_SALT_SAMPLING = 49979687
_SALT_TURNS = 67867967


def round_sampling_seed(seed: int, k: int) -> int:
    """The sampling seed of DAgger round k's rollout (trainer.seed `seed`), in [0, 2**31)."""
    return int(np.random.default_rng([seed, k, _SALT_SAMPLING]).integers(2**31))


def chunk_turns_rng(seed: int, k: int, chunk: int) -> np.random.Generator:
    """The generator that draws the labelled turns chunk `chunk` of round k keeps."""
    return np.random.default_rng([seed, k, chunk, _SALT_TURNS])


#: Files and folders of a DAgger run folder besides the rounds (`round-K`; dagger.yaml: an older run's).
_RUN_FILES = (DAGGER_FILE, "config.yaml", "rounds.json", "data")
_ROUND = re.compile(r"round-(\d+)$")


def is_dagger_run(path: str) -> bool:
    """Whether folder `path` holds a `fastpo dagger` run: its config.yaml has a `dagger`
    section (or, made before config.yaml held it, the folder has a dagger.yaml)."""
    if os.path.isfile(os.path.join(path, DAGGER_FILE)):
        return True
    config = os.path.join(path, "config.yaml")
    try:
        with open(config, encoding="utf-8") as f:
            return parse_config_yaml(f, config).get("dagger") is not None
    except (OSError, ConfigError):  # no config.yaml, or not a config: not a DAgger run's
        return False


def dagger_folder_of(path: str) -> str:
    """The DAgger run folder that `path` names: itself, or the run holding it when `path` is
    one of its rounds (`OUT/round-k`, which the stop messages of a round name). `path`
    unchanged when it is neither."""
    p = path.rstrip("/\\") or path
    parent = os.path.dirname(os.path.abspath(p))
    if not is_dagger_run(p) and _ROUND.match(os.path.basename(p)) and is_dagger_run(parent):
        return os.path.dirname(p) or "."
    return path


def clear_dagger_run(out: str) -> None:
    """Delete a DAgger run's files and rounds in `out` (--overwrite); nothing else."""
    for name in os.listdir(out):
        p = os.path.join(out, name)
        if name in _RUN_FILES or _ROUND.match(name):
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.remove(p)


# ------------------------------------------------------------------------------------ the run

class DaggerStopped(KeyboardInterrupt):
    """A DAgger run stopped by a signal outside a round's training (its rollout); `signum`
    gives the exit status 128 + signum (the CLI's)."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = int(signum)


class DaggerRoundTrainer(SFTTrainer):
    """One round's SFT (`fastpo.sft.trainer.SFTTrainer`, on the round's config) inside a DAgger
    run: its stop and error messages name `fastpo dagger --resume OUT`; the DAgger run prints
    the hand-off at its end."""

    def __init__(self, cfg, dagger_out: str, **kw):
        super().__init__(cfg, **kw)
        self.dagger_out = dagger_out

    def resume_hint(self) -> str:
        return f"fastpo dagger --resume {self.dagger_out}"

    def finish(self, records: list[dict]) -> None:
        pass


class DaggerRun:
    """A `fastpo dagger` run in folder `cfg.trainer.output_dir` (OUT).

    cfg: the TrainConfig every round shares, with its `sft` section (round 0's data; its
    batch_size and common_prefix also the rounds') and `dagger` section (model.name: the
    starting model; round k's own config differs in model.name, its parent round's folder, in
    trainer.iterations, optim.actor_lr, the sft section and the output folder, and has no
    dagger section: each round is an ordinary SFT run). `run()` does what is left: each
    round's rollout and labels (saved chunk by chunk), then its training (resumed from its
    checkpoint); it returns None when every round is done, or the signal that stopped it (the
    CLI then exits 128 + signal). `console`: a rich Console. Raises ConfigError (bad input found
    late, e.g. a round whose rollout labelled nothing), EnvError, CheckpointSaveError, as the
    trainer does.
    """

    def __init__(self, cfg, console, trust_checkpoint: bool = False):
        if cfg.sft is None or cfg.dagger is None:
            raise ValueError("DaggerRun needs a TrainConfig with sft and dagger sections: "
                             "load_config(..., sections=('sft', 'dagger'))")
        self.cfg, self.sft, self.dag, self.console = cfg, cfg.sft, cfg.dagger, console
        self.out = cfg.trainer.output_dir
        self.trust = trust_checkpoint
        self.data_dir = os.path.join(self.out, "data")

    # -- where things are
    def round_dir(self, k: int) -> str:
        return os.path.join(self.out, f"round-{k}")

    def parent(self, k: int) -> str:
        """The model round k starts from (and, for k >= 1, whose rollout it learns from)."""
        if k == 0 or (k == 1 and not self.dag.sft_round):
            return self.cfg.model.name
        return os.path.abspath(self.round_dir(k - 1))

    def first_round(self) -> int:
        return 0 if self.dag.sft_round else 1

    # -- the whole run
    def run(self) -> Optional[int]:
        os.makedirs(self.out, exist_ok=True)
        with RunLock(self.out):
            # the settings the rounds run with (a resume's allowed changes included)
            atomic_write_text(os.path.join(self.out, "config.yaml"), dump_yaml(self.cfg))
            for k in range(self.first_round(), self.dag.rounds + 1):
                stopped = self.round(k)
                if stopped is not None:
                    return stopped
            self.report()
        return None

    def round(self, k: int) -> Optional[int]:
        """Round k: its data (k >= 1), then its training; the signal that stopped it, or None."""
        return self.train(k, self.round_config(k, self.collect(k) if k >= 1 else None))

    def round_config(self, k: int, data: Optional[dict]):
        """The TrainConfig of round k, an SFT run's (`data`: its training data's summary, k >= 1):
        the run's, without its dagger section, into the round's folder; rounds k >= 1 train on
        their data file from the previous round's model."""
        cfg = copy.deepcopy(self.cfg)
        cfg.trainer.output_dir = self.round_dir(k)
        cfg.dagger = None
        if k == 0:
            return cfg
        n = data["conversations"]
        batch = min(self.sft.batch_size, n)
        cfg.model.name = self.parent(k)
        cfg.optim.actor_lr = self.dag.lr or self.cfg.optim.actor_lr
        cfg.trainer.iterations = self.dag.steps or math.ceil(n / batch)
        # the parent's last evaluation is this round's "before" (same seeds, same sampling stream)
        cfg.trainer.eval_before_training = cfg.trainer.eval_before_training and self.parent(k) == self.cfg.model.name
        cfg.sft = dataclasses.replace(type(self.sft)(), data=os.path.abspath(data["file"]), batch_size=batch,
                                      common_prefix=self.sft.common_prefix)
        return cfg

    def train(self, k: int, cfg) -> Optional[int]:
        """Round k's SFT (`cfg`: `round_config`'s) into its folder: resumed from its checkpoint,
        skipped when done."""
        sft = cfg.sft
        d = cfg.trainer.output_dir
        resume = os.path.isdir(d) and search_checkpoints(d).folder is not None
        if resume:
            try:
                plan = plan_resume(d, trust=self.trust)
            except FileNotFoundError as e:
                raise ConfigError(str(e)) from None
            if plan.nothing_to_do(cfg.trainer.iterations):
                self.console.print(f"round {k}: trained ({d}, {plan.iteration} steps)", markup=False)
                return None
            sft.data_sha256 = load_run_config(d).sft.data_sha256  # a resume refuses changed data
        what = "SFT on the expert's trajectories" if k == 0 else f"SFT on the labelled states of round {k}"
        self.console.print(f"[bold]round {k}/{self.dag.rounds}[/]: {what}, {cfg.trainer.iterations} steps of "
                           f"{sft.batch_size}, lr {cfg.optim.actor_lr:g}, from {cfg.model.name} -> {d}"
                           + (" (resumed)" if resume else ""))
        trainer = DaggerRoundTrainer(cfg, self.out, resume=resume, console=self.console,
                                     trust_checkpoint=self.trust)
        trainer.run()
        return trainer.stop_state.signum if trainer.stop_state.interrupted else None

    # -- a round's data
    def collect(self, k: int) -> dict:
        """Round k's training data (rolled out and labelled unless already there): the summary
        of data/round-k.json with "file", the JSONL file round k trains on."""
        summary = self.summary_path(k)
        if not os.path.isfile(summary):
            self.roll_out(k)
        with open(summary, encoding="utf-8") as f:
            s = json.load(f)
        if not self.dag.aggregate or k == 1:
            return {**s, "file": os.path.join(self.data_dir, f"round-{k}.jsonl")}
        path = os.path.join(self.data_dir, f"rounds-1-{k}.jsonl")
        if not os.path.isfile(path):  # DAgger's aggregate: the union of rounds 1..k
            parts = []
            for j in range(1, k + 1):
                with open(os.path.join(self.data_dir, f"round-{j}.jsonl"), encoding="utf-8") as f:
                    parts.append(f.read())
            atomic_write_text(path, "".join(parts))
        n = 0
        for j in range(1, k + 1):
            with open(self.summary_path(j), encoding="utf-8") as f:
                n += json.load(f)["conversations"]
        return {**s, "conversations": n, "file": path}

    def summary_path(self, k: int) -> str:
        return os.path.join(self.data_dir, f"round-{k}.json")

    def roll_out(self, k: int) -> None:
        """Round k's rollout of its parent on its levels, labelled, chunk by chunk (a chunk
        already on disk is kept), then data/round-k.jsonl and its summary (written last)."""
        cfg, dag = self.cfg, self.dag
        levels = dag.round_levels(k)
        chunks = [levels[i:i + dag.chunk] for i in range(0, len(levels), dag.chunk)]
        part_dir = os.path.join(self.data_dir, f"round-{k}.chunks")
        os.makedirs(part_dir, exist_ok=True)
        done = [os.path.isfile(os.path.join(part_dir, f"{i:04d}.json")) for i in range(len(chunks))]
        t0 = time.perf_counter()
        self.console.print(f"[bold]round {k}/{dag.rounds}[/]: {self.parent(k)} plays levels {levels[0]}..{levels[-1]} "
                           f"at temperature {dag.temperature:g}; the expert labels the states it reaches"
                           + (f" ({sum(done)} of {len(chunks)} chunks already done)" if any(done) else ""))
        main_thread = threading.current_thread() is threading.main_thread()  # (signals reach that one alone)
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}

        def stop(signum, frame):  # the chunk under way is dropped; finished chunks are on disk
            raise DaggerStopped(signum)

        for s in old:
            signal.signal(s, stop)
        try:
            if not all(done):
                device = resolve_device(cfg.trainer.device)
                model, tok, info = load_model_checked(self.parent(k), device=str(device),
                                                      dtype=None if cfg.model.dtype == "auto" else cfg.model.dtype)
                rollout = ro.MultiTurnRollout.from_config(cfg, ro.NativeEngine(model, tok), tok)
                base = round_sampling_seed(cfg.trainer.seed, k)
                for i, seeds in enumerate(chunks):
                    if done[i]:
                        continue
                    with torch.no_grad():
                        batch = rollout.generate(seeds, 1, temperature=dag.temperature, seed=base + i * dag.chunk)
                    labels = label_trajectories(batch, rollout, self.sft.actions_per_turn)
                    rows, agree, n = labelled_conversations(batch, labels, rollout.chat.system_prompt, dag.history,
                                                            dag.turns_per_trajectory,
                                                            chunk_turns_rng(cfg.trainer.seed, k, i))
                    stats = {"trajectories": len(batch), "successes": int(batch.success.sum()),
                             "turns": int(batch.num_turns.sum()), "labelled": n, "agreed": agree,
                             "conversations": len(rows)}
                    atomic_write_text(os.path.join(part_dir, f"{i:04d}.jsonl"), jsonl(rows))
                    atomic_write_text(os.path.join(part_dir, f"{i:04d}.json"), json.dumps(stats) + "\n")
                    won = stats["successes"] / len(batch)
                    self.console.print(f"  levels {seeds[0]}..{seeds[-1]}: success {won:.3f}, "
                                       f"{n} states labelled, the model's answer was the expert's in "
                                       f"{agree / max(n, 1):.3f} ({time.perf_counter() - t0:.0f} s)", markup=False)
                    del batch
                del rollout, model  # the model's memory back before the round's training loads its own
                gc.collect()
                release_free_memory()
            self.write_round(k, chunks, part_dir, time.perf_counter() - t0)
        except DaggerStopped:
            kept = sum(os.path.isfile(os.path.join(part_dir, f"{i:04d}.json")) for i in range(len(chunks)))
            self.console.print(f"stopped in round {k}'s rollout ({kept} of {len(chunks)} chunks of {dag.chunk} levels "
                               f"saved); continue with `fastpo dagger --resume {self.out}` (or the same command)",
                               markup=False, soft_wrap=True)
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def write_round(self, k: int, chunks: list, part_dir: str, seconds: float) -> None:
        """data/round-k.jsonl from its chunks (and the expert's trajectories), then its summary."""
        dag, text, s = self.dag, [], {"trajectories": 0, "successes": 0, "turns": 0, "labelled": 0, "agreed": 0,
                                      "conversations": 0}
        for i in range(len(chunks)):
            with open(os.path.join(part_dir, f"{i:04d}.json"), encoding="utf-8") as f:
                for key, v in json.load(f).items():
                    s[key] += v
            with open(os.path.join(part_dir, f"{i:04d}.jsonl"), encoding="utf-8") as f:
                text.append(f.read())
        expert = 0
        if dag.expert_trajectories:
            tok = load_model_checked(self.cfg.model.name, tokenizer_only=True)  # (every round's tokenizer)
            rcfg = self.cfg.rollout.rollout_config()
            eb = expert_rollout(tok, self.cfg.env.name, self.cfg.env.options, rcfg,
                                dag.round_levels(k)[:dag.expert_trajectories], self.sft.actions_per_turn)
            system = ro.MultiTurnRollout(None, tok, self.cfg.env.name, dict(self.cfg.env.options), rcfg).chat.system_prompt
            rows = expert_conversations(eb, system)
            text.append(jsonl(rows))
            expert = len(rows)
        if s["conversations"] + expert == 0:
            raise ConfigError(f"round {k}: no state of the {s['trajectories']} trajectories got a label (every answer "
                              f"cut by rollout.max_context, or an expert without answers); nothing to train on")
        lv = dag.round_levels(k)
        summary = {"round": k, "model": self.parent(k), "levels": [lv[0], lv[-1]],
                   "temperature": dag.temperature, **s,
                   "success_rate": s["successes"] / max(s["trajectories"], 1),
                   "agreement": s["agreed"] / max(s["labelled"], 1),
                   "expert_conversations": expert, "conversations": s["conversations"] + expert,
                   "seconds": round(seconds, 1)}
        atomic_write_text(os.path.join(self.data_dir, f"round-{k}.jsonl"), "".join(text))
        atomic_write_text(self.summary_path(k), json.dumps(summary, indent=1) + "\n")
        shutil.rmtree(part_dir, ignore_errors=True)
        self.console.print(f"round {k}: {summary['conversations']} conversations -> "
                           f"{os.path.join(self.data_dir, f'round-{k}.jsonl')}; on its own states the model played "
                           f"the expert's answer in {summary['agreement']:.3f} of {s['labelled']} (success "
                           f"{summary['success_rate']:.3f})", markup=False, soft_wrap=True)

    # -- the end
    def rounds(self) -> list[dict]:
        """One record per round: its data's summary (k >= 1) and its last evaluation."""
        out = []
        for k in range(self.first_round(), self.dag.rounds + 1):
            rec: dict = {"round": k, "model": self.round_dir(k)}
            if k >= 1 and os.path.isfile(self.summary_path(k)):
                with open(self.summary_path(k), encoding="utf-8") as f:
                    s = json.load(f)
                rec.update({f"data/{key}": s[key] for key in ("levels", "success_rate", "agreement", "labelled",
                                                               "conversations")})
            ev = {}
            try:
                with open(os.path.join(self.round_dir(k), "metrics.jsonl"), encoding="utf-8") as f:
                    for line in f:
                        r = json.loads(line)
                        if "eval/success_rate" in r:
                            ev = r
            except (OSError, ValueError):
                pass
            for key in ("iteration", "eval/success_rate", "eval/success_rate_se", "eval/random_success",
                        "eval/optimal_success", "eval/expert_success"):
                if key in ev:
                    rec[key] = ev[key]
            out.append(rec)
        return out

    def report(self) -> None:
        """The rounds as a table (also OUT/rounds.json), the final model and the StarPO command."""
        recs = self.rounds()
        atomic_write_text(os.path.join(self.out, "rounds.json"), json.dumps(recs, indent=1) + "\n")
        t = Table(title=f"fastpo dagger: {self.cfg.env.name}")
        for col in ("round", "data: levels", "own states: agreement", "rollout success", "conversations",
                    "eval success", "z vs random"):
            t.add_column(col)
        for r in recs:
            succ, se, rnd = r.get("eval/success_rate"), r.get("eval/success_rate_se"), r.get("eval/random_success")
            z = (succ - rnd) / se if None not in (succ, se, rnd) and se > 0 else None
            t.add_row(str(r["round"]),
                      "expert" if r["round"] == 0 else "{}..{}".format(*r.get("data/levels", ["?", "?"])),
                      "-" if r["round"] == 0 else f"{r.get('data/agreement', float('nan')):.3f}",
                      "-" if r["round"] == 0 else f"{r.get('data/success_rate', float('nan')):.3f}",
                      "-" if r["round"] == 0 else str(r.get("data/conversations", "?")),
                      "-" if succ is None else f"{succ:.3f}" + ("" if se is None else f" +- {se:.3f}"),
                      "-" if z is None else f"{z:+.1f}")
        self.console.print(t)
        last = recs[-1]
        if "eval/random_success" in last:
            self.console.print(f"random policy {last['eval/random_success']:.3f}"
                               + (f", optimal {last['eval/optimal_success']:.3f}" if "eval/optimal_success" in last
                                  else "") + " on the same eval seeds", markup=False)
        final = self.round_dir(self.dag.rounds)
        cfg = copy.deepcopy(self.cfg)
        cfg.trainer.output_dir = final
        self.console.print(f"the model: {final} (--model {final})", markup=False, soft_wrap=True)
        self.console.print("StarPO from this model: " + handoff_command(cfg), markup=False, soft_wrap=True)


def dagger_run_finished(out: str, rounds: int) -> bool:
    """Whether the DAgger run in `out` has finished `rounds` rounds (the rounds.json its end
    writes lists round `rounds` or a later one)."""
    try:
        with open(os.path.join(out, "rounds.json"), encoding="utf-8") as f:
            recs = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(recs, list) and any(isinstance(r, dict) and isinstance(r.get("round"), int)
                                          and r["round"] >= rounds for r in recs)
