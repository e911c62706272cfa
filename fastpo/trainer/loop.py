"""The run loop (`RunLoop`: iterate, evaluate when due, log, save when due, stop when asked),
shared by the StarPO trainer (`Trainer`, `train`) and SFT (fastpo.sft.SFTTrainer).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any, Optional

from fastpo.distributed.context import DistContext, SINGLE

from fastpo.distributed.launch import check_trainer_support
import fastpo.trainer.fsdp as ffsdp
from fastpo.run.checkpoint import CheckpointSaveError, nothing_to_train_note, rng_state
from fastpo.run.folder import LOCK_FILE, RunLock, unsaved_note, untrained_start
from fastpo.config.schema import TrainConfig
from fastpo.config.presets import cpu_preset_note
from fastpo.memory import fix_mmap_threshold, mapped_allocations, release_free_memory
from fastpo.report.metrics import warn_user
from fastpo.report.plots import plot_curves
from fastpo.report.summary import (before_after_note, before_after_table, game_result_lines, print_table,
                                   result_line, summary_table)
from fastpo.models import resolve_device
from fastpo.trainer.iteration import StarPOIteration
from fastpo.trainer.lifecycle import Dropped, StopControl, Stopped
from fastpo.trainer.plan import rl_plan
from fastpo.trainer.setup import Parts, check_prompts_fit, open_run


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class RunTrainer:
    """What every trainer of a run folder shares (the StarPO `Trainer`, fastpo.sft.SFTTrainer):
    its settings, stop control, run-folder lock and parts, and the answers `RunLoop` asks of
    it except the three a trainer defines: `setup()` (build `parts`), `iteration(it)` (its
    metrics) and `evaluate(it)`.

    `resume=True` continues the run found in the output folder from its latest checkpoint
    (`trust_checkpoint`: whose files may need full unpickling). `console` is a rich Console
    (created when None). `stop_after` (an iteration) stops the run there exactly as a Ctrl-C
    during that iteration would: checkpoint, then return. `run()` returns the metric records.
    """

    #: The command that continues this kind of run, named in the stop and error messages.
    resume_command = "fastpo train --resume"

    def __init__(self, cfg: TrainConfig, resume: bool = False, console: Any = None,
                 stop_after: Optional[int] = None, overwrite: bool = False, dist: DistContext = SINGLE,
                 trust_checkpoint: bool = False):
        from rich.console import Console

        self.cfg = cfg
        self.dist = dist
        self.console = console or Console(quiet=not dist.is_main)
        self.out = cfg.trainer.output_dir
        self.resume = resume
        self.trust_checkpoint = trust_checkpoint  # --trust-checkpoint: a resume may unpickle its files
        self.overwrite = overwrite
        self.device = dist.device if dist.initialized and dist.device.type == "cuda" else resolve_device(cfg.trainer.device)
        self.stop = StopControl(dist, self.console)
        self.stop_after = stop_after
        self.lock: Optional[RunLock] = None
        self.parts: Optional[Parts] = None

    def setup(self) -> None:
        raise NotImplementedError

    def iteration(self, it: int) -> dict:
        raise NotImplementedError

    def evaluate(self, it: int) -> dict:
        """The evaluation on the fixed eval seeds (`Sampler.evaluate`); its metrics."""
        return self.parts.sampler.evaluate(it)

    def warn(self, text: str) -> None:
        """A warning for the user (`fastpo.report.metrics.warn_user`: the "fastpo" logger, shown on
        this run's console unless that logger has handlers of its own); rank 0's only."""
        if self.dist.is_main:
            warn_user(text, self.console)

    def check_prompts_fit(self) -> Any:
        """`fastpo.trainer.setup.check_prompts_fit` of this run's config: the tokenizer."""
        return check_prompts_fit(self.cfg)

    def save(self, it: int, rng: Optional[dict] = None, eval_pending: bool = False) -> str:
        """Checkpoint iteration `it` with the loop's state; `rng` (default: the current RNG
        states) is what a resume restores; `eval_pending` marks an evaluation of `it` still to
        run on resume."""
        p = self.parts
        state = {"last_eval": p.last_eval, "eval_pending": eval_pending,
                 **({} if p.schedule is None else {"rollout_schedule": p.schedule.state_dict()})}
        return p.checkpointer.save(it, state, rng=rng)

    def resume_hint(self) -> str:
        """The command that continues this run, named in the stop and error messages."""
        return f"{self.resume_command} {self.out}"

    def finish(self, records: list[dict]) -> None:
        """After the loop and its report (rank 0): what this kind of run adds (nothing here)."""

    def release_lock(self, remove: bool = False) -> None:
        if self.lock is not None:
            self.lock.release(remove=remove)
            self.lock = None

    def run(self) -> list[dict]:
        """Train; returns the metric records (also in OUT/metrics.jsonl). See `RunLoop`."""
        return RunLoop(self).run()

    @property
    def model(self):
        """The policy module being trained (after `setup`)."""
        return self.parts.models.policy

    @property
    def tokenizer(self):
        return self.parts.models.tokenizer

    @property
    def stop_state(self):
        """The run's stop state (`StopControl.state`): whether it stopped on a signal, which."""
        return self.stop.state

    @property
    def logger(self):
        """The metrics logger (after `setup`): `.records` holds the run's records."""
        return self.parts.logger


class Trainer(RunTrainer):
    """Runs StarPO / StarPO-S for `cfg.trainer.iterations` iterations into `cfg.trainer.output_dir`
    (arguments: `RunTrainer`). After `setup()` its parts are `parts` (fastpo.trainer.setup.Parts:
    models, scorer, updater, sampler, checkpointer, ...) and `iteration(it)` runs one StarPO
    iteration (`StarPOIteration`, `step`)."""

    def setup(self) -> None:
        """Load the model(s), build the critic, optimizers, engine, rollout and logger; restore a
        checkpoint (`fastpo.trainer.setup.open_run`). A start that fails leaves no empty output
        folder behind."""
        cfg = self.cfg
        if cfg.rollout.group_size == 1 and cfg.algorithm.filter_mode != "none":
            self.warn(f"algorithm.filter_mode={cfg.algorithm.filter_mode} with rollout.group_size=1: "
                      "the in-group reward std is undefined with one trajectory per env group, so StarPO-S "
                      "filtering is skipped (every group is trained on)")
        parts = open_run(self, rl_plan(cfg, self.dist.initialized))
        self.step = StarPOIteration(cfg, self.dist, parts, self.stop, self.warn)

    def iteration(self, it: int) -> dict:
        """One StarPO iteration (`StarPOIteration.run`); its metrics."""
        return self.step.run(it)


class RunLoop:
    """The loop of a `RunTrainer` (the StarPO `Trainer`, fastpo.sft.SFTTrainer): set up, evaluate before
    training, then per iteration: iterate, evaluate when due, log, save when due, stop when
    asked; the report at the end. The trainer answers `setup()`, `iteration(it)`,
    `evaluate(it)`, `save(it, rng, eval_pending)`, `finish(records)`, `warn(text)` and
    `release_lock()`, and holds `cfg`, `dist`, `console`, `out`, `stop` (StopControl),
    `stop_after`, `resume_hint()` and, after set-up, `parts`.

    Signals: Ctrl-C finishes the iteration, saves and exits; SIGTERM drops an iteration whose
    update has not begun (a resume redoes it identically), finishes an update under way,
    postpones an evaluation to the resume; a second signal aborts without saving."""

    def __init__(self, trainer):
        self.tr = trainer
        self.cfg, self.dist, self.console, self.out = trainer.cfg, trainer.dist, trainer.console, trainer.out
        self.stop = trainer.stop

    def run(self) -> list[dict]:
        """Set up, loop, report; returns the metric records."""
        fix_mmap_threshold()  # glibc's heaps reused within a phase, trimmed between phases (fastpo.memory)
        self.tr.setup()
        self.parts = self.tr.parts
        old_handlers = {}
        if _in_main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self.stop.request_stop)
        run = _RunProgress(self.parts.start_iteration - 1)
        try:
            if not self.before_loop():
                return self.parts.logger.records
            self._iterate(run)
        except KeyboardInterrupt:
            # A second signal: the current iteration is incomplete; keep the last saved checkpoint.
            hint = self.untrained_hint()
            self.console.print("[yellow]aborted[/]; " + (hint or f"the last checkpoint is iteration {run.last_saved}"),
                               soft_wrap=True)
            raise
        except Exception as e:
            self.emergency_save(run, e)
            hint = self.untrained_hint()
            if hint:
                self.console.print(f"[red]error before the first checkpoint[/] ({type(e).__name__}): {hint}",
                                   soft_wrap=True)
            raise
        finally:
            self.stop.state.droppable = False
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.parts.logger.close()
            if getattr(self.parts, "sampler", None) is not None:
                self.parts.sampler.shutdown()
            self.tr.release_lock()
        if self.dist.is_main:
            self.report()
            self.tr.finish(self.parts.logger.records)
        return self.parts.logger.records

    def _iterate(self, run: "_RunProgress") -> None:
        """The iterations from the start one on, with the progress bar."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        t = self.cfg.trainer
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                      console=self.console, disable=not t.progress) as progress:
            task = progress.add_task("train", total=t.iterations, completed=self.parts.start_iteration - 1, stats="")
            for it in range(self.parts.start_iteration, t.iterations + 1):
                run.it = it
                if not self.loop_step(it, run, lambda stats: progress.update(task, completed=it, stats=stats)):
                    break

    def before_loop(self) -> bool:
        """The evaluation a SIGTERM postponed, a finished run's note, the evaluation before
        training; False when there is nothing to train."""
        total, p = self.cfg.trainer.iterations, self.parts
        if p.eval_pending:
            if not self.run_pending_eval():
                self.console.print("stopped again; the evaluation stays pending in the checkpoint")
                return False
            if p.start_iteration > total:
                self.tr.save(p.start_iteration - 1)  # the finished run's checkpoint, without the pending mark
        if p.start_iteration > total:
            self.console.print(nothing_to_train_note(self.out, p.start_iteration - 1, total), style="yellow")
            return False
        if self.cfg.trainer.eval_before_training and p.start_iteration == 1:
            try:
                with self.stop.droppable():
                    ev = self.evaluate_all(0)
                p.last_eval = ev
                p.logger.log(0, ev)
            except Dropped:
                pass
        return True

    def loop_step(self, it: int, run: "_RunProgress", show) -> bool:
        """Iteration `it`, its evaluation when due, its record, its checkpoint when due; False
        to stop the loop (a signal, `stop_after`). `show(stats)`: the progress line."""
        t, st = self.cfg.trainer, self.stop.state
        self.stop.sync()  # (data parallel: the ranks agree on a stop request)
        if st.requested:  # a signal before this iteration began (e.g. the initial eval)
            return self._stop_before(it, run)
        t_it = time.perf_counter()
        run.rng_at_start = rng_state()  # what a resume restores if this iteration is dropped
        self.stop.update_begins()  # until the iteration says its update has not begun
        try:
            metrics = self.tr.iteration(it)
        except Dropped:
            return self._dropped(it, run)
        run.updated = it  # the weights now hold this iteration's update
        if self.tr.stop_after is not None and it >= self.tr.stop_after:
            st.requested = True
        self.stop.sync()  # every rank takes the same evaluate/save/stop decisions
        eval_pending, rng_before_eval = False, None
        if t.eval_every and (it % t.eval_every == 0 or it == t.iterations):
            rng_before_eval = rng_state()
            try:
                eval_pending = not self.evaluate_due(it, metrics)
            except Exception:
                # the record before the emergency checkpoint of this update, or a resume (which starts
                # after it) would leave the iteration out of metrics.jsonl for good
                metrics["eval/failed"] = 1
                metrics["time/iteration_s"] = time.perf_counter() - t_it
                self.log(it, metrics, run, show)
                raise
        metrics["time/iteration_s"] = time.perf_counter() - t_it
        self.log(it, metrics, run, show)
        if (t.save_every and it % t.save_every == 0) or it == t.iterations or st.requested:
            self.tr.save(it, rng=rng_before_eval if eval_pending else None, eval_pending=eval_pending)
            run.last_saved = it
        if st.requested and (it < t.iterations or eval_pending):
            self.console.print(f"stopped after iteration {it}; resume with `{self.tr.resume_hint()}`")
            return False
        st.interrupted = False  # a Ctrl-C in the last iteration still finished the run
        return True

    def _stop_before(self, it: int, run: "_RunProgress") -> bool:
        """A stop requested before iteration `it` began: save what is not saved yet; False."""
        if run.updated > run.last_saved:
            self.tr.save(run.updated)
            run.last_saved = run.updated
        hint = self.untrained_hint()
        self.console.print(f"stopped before iteration {it}" + (f"; {hint}" if hint else
                           "" if run.updated > self.parts.start_iteration - 1 else "; nothing new to save"),
                           soft_wrap=True)
        return False

    def _dropped(self, it: int, run: "_RunProgress") -> bool:
        """Iteration `it` dropped by a SIGTERM before its update: save the last complete one; False."""
        if run.updated > run.last_saved:
            self.tr.save(run.updated, rng=run.rng_at_start)
            run.last_saved = run.updated
        hint = self.untrained_hint()
        self.console.print(f"stopped in iteration {it} before its update: " + (hint or
                           f"dropped (a resume redoes it); resume with `{self.tr.resume_hint()}`"),
                           soft_wrap=True)
        return False

    def evaluate_all(self, it: int) -> dict:
        """The trainer's `evaluate` (each rank its share of the eval seeds); FSDP2: with the
        parameters gathered whole on every rank meanwhile."""
        # tensors mapped on their own: the evaluation's wide batches fragment the heaps most,
        # and its peak is the main job's (fastpo.memory)
        root = self.parts.models.fsdp_root if getattr(self.parts, "models", None) is not None else None
        try:
            with mapped_allocations(), ffsdp.gathered(root):
                return self.tr.evaluate(it)
        finally:
            release_free_memory()  # what it freed in the heaps, back to the system

    def evaluate_due(self, it: int, metrics: dict) -> bool:
        """The evaluation of iteration `it` into `metrics`; False when a SIGTERM postponed it to
        the resume (the record gets it then)."""
        ev = None
        if not self.stop.state.term:
            try:
                with self.stop.droppable():
                    ev = self.evaluate_all(it)
            except Dropped:
                pass
        if ev is None:
            self.console.print(f"evaluation of iteration {it} postponed to the resume")
            return False
        self.parts.last_eval = ev
        metrics.update(ev)
        return True

    def run_pending_eval(self) -> bool:
        """The evaluation of the resumed checkpoint's iteration that a SIGTERM stopped: run it and
        add it to that iteration's record. False when stopped again (it stays pending)."""
        p = self.parts
        it = p.start_iteration - 1
        self.console.print(f"evaluating iteration {it} (postponed by the SIGTERM that stopped the run)")
        try:
            with self.stop.droppable():
                ev = self.evaluate_all(it)
        except Dropped:
            return False
        p.last_eval = ev
        if p.logger.records and p.logger.records[-1].get("iteration") == it:
            p.logger.extend_last(ev)
        else:
            p.logger.log(it, ev)
        p.eval_pending = False
        return True

    def log(self, it: int, metrics: dict, run: "_RunProgress", show) -> None:
        """Iteration `it`'s record (metrics.jsonl), the Echo-Trap warning, the progress line, plots."""
        t, p = self.cfg.trainer, self.parts
        metrics["echo_trap_warning"] = 0
        rec = p.logger.log(it, metrics)
        warn = p.echo.update(rec)
        if warn:
            p.logger.amend_last({"echo_trap_warning": 1})
            if not run.echo_on:  # printed when it starts firing; the flag is in every record
                self.tr.warn(f"iteration {it}: {warn} (flagged as echo_trap_warning in metrics.jsonl while it lasts)")
        run.echo_on = bool(warn)
        # what the trainer reports (SFT has no rollout entropy; from a data file, no success or score)
        shown = (("success", "train/success_rate", ".2f"), ("score", "train/score_mean", ".3f"),
                 ("entropy", "train/rollout_entropy", ".2f"), ("loss", "sft/loss", ".3f"))
        stats = " | ".join([f"{name} {metrics[k]:{fmt}}" for name, k, fmt in shown if k in metrics]
                           + [f"{metrics['time/iteration_s']:.0f} s/it"])
        if "eval/success_rate" in metrics:
            stats += f" | eval {metrics['eval/success_rate']:.2f}"
        show(stats)
        if not t.progress:
            self.console.print(f"iteration {it}/{t.iterations}: {stats}")
        if t.plots and self.dist.is_main and (("eval/success_rate" in metrics) or it == t.iterations):
            plot_curves(p.logger.records, os.path.join(self.out, "plots"), model_label=p.models.info.trained_label())

    def emergency_save(self, run: "_RunProgress", e: Exception) -> None:
        """After an error following an update (eval, logging, plots, disk) or before one began:
        keep the trained iterations. (Not when the failure was that very save: it would fail again.)"""
        consistent = run.updated == run.it or not self.stop.state.weights_touched
        if consistent and run.updated > run.last_saved and not isinstance(e, CheckpointSaveError):
            try:
                self.tr.save(run.updated, rng=run.rng_at_start if run.updated < run.it else None)
                self.console.print(f"[red]error after iteration {run.updated}[/]: emergency checkpoint saved; "
                                   f"resume with `{self.tr.resume_hint()}`")
            except Exception as e2:  # the original error matters more than the failed save
                self.console.print(f"[red]emergency checkpoint failed[/]: {e2}", markup=False)

    def untrained_hint(self) -> str:
        """What to do with the run folder when no checkpoint was saved there yet ("" when one
        is there): the same command reuses it, and so does a resume (from iteration 1 with its
        config.yaml); iterations trained but not saved are said."""
        if not self.dist.is_main or not untrained_start(self.out):
            return ""
        return (f"{unsaved_note(self.out)}: run the same command again (it reuses the folder), or "
                f"`{self.tr.resume_hint()}` to start again from iteration 1 with its config.yaml")

    def report(self) -> None:
        """The end of a run (rank 0): final plots, the summary and before/after tables, the outputs."""
        records = self.parts.logger.records
        if not any(r.get("iteration", 0) >= 1 for r in records):  # stopped before any iteration
            held = sorted(n for n in os.listdir(self.out) if n != LOCK_FILE) if os.path.isdir(self.out) else []
            self.console.print(f"no iteration was trained; {self.out}/ holds {', '.join(held) or 'nothing'}",
                               markup=False, soft_wrap=True)
            return
        label = self.parts.models.info.trained_label()  # the run's model, not the one it started from
        if self.cfg.trainer.plots and records:
            plot_curves(records, os.path.join(self.out, "plots"), model_label=label)
        print_table(self.console, summary_table(records, title=f"fastpo: {self.cfg.env.name}, {label}"))
        ba = before_after_table(records, run_dir=self.out)
        note = before_after_note(records) if ba is None else None
        if ba is not None:
            print_table(self.console, ba)
        elif note:
            self.console.print(note, markup=False, soft_wrap=True)
        line = result_line(records, run_dir=self.out)
        if line:
            self.console.print(line, markup=False, soft_wrap=True)
        if ba is None:  # a mixture's games: in the before/after table where there is one, else here
            for line in game_result_lines(records):
                self.console.print(line, markup=False, soft_wrap=True)
        held = [name for name in ("metrics.jsonl", "plots/", "eval/", "samples/", "checkpoints/")
                if os.path.exists(os.path.join(self.out, name))]  # plots off or no eval: not there
        self.console.print(f"outputs in {self.out}/: {', '.join(held)}")


@dataclasses.dataclass
class _RunProgress:
    """Where the run loop is: the iteration under way (`it`), the last one whose update is
    complete (`updated`), the last one saved (`last_saved`), the RNG states at the current
    iteration's start (what a resume restores if it is dropped), whether the Echo-Trap
    warning is firing."""

    updated: int
    last_saved: int = -1
    it: int = -1
    rng_at_start: Optional[dict] = None
    echo_on: bool = False

    def __post_init__(self):
        self.last_saved = self.it = self.updated


def train(cfg: TrainConfig, resume: bool = False, console: Any = None, overwrite: bool = False,
          dist: DistContext = SINGLE, trust_checkpoint: bool = False) -> list[dict]:
    """Build a Trainer and run it; prints what the CPU preset scaled down.

    A new run (resume=False) refuses an output folder that already holds a run
    (FileExistsError) unless `overwrite` is true, which clears that run first. Raises
    Stopped (a KeyboardInterrupt) after a Ctrl-C or SIGTERM stop, once the checkpoint is saved.
    `dist`: this process's place in a data-parallel job (`fastpo.distributed.context.init_from_env`);
    the default is one process. Raises fastpo.distributed.context.DistributedError for a setting the
    data-parallel trainer does not support (`check_trainer_support`). `trust_checkpoint`
    (`--trust-checkpoint`): a resume may load checkpoint files that need full unpickling
    (an older fastpo's), with a warning; without it they raise
    fastpo.run.checkpoint.UntrustedCheckpoint (a ConfigError naming the file).
    """
    from rich.console import Console

    check_trainer_support(cfg, dist.world_size, torchrun=dist.initialized)
    console = console or Console(quiet=not dist.is_main)
    if "cpu" in cfg.preset.split(",") and dist.is_main:
        console.print(f"[cyan]{cpu_preset_note(cfg)}[/]")
    trainer = Trainer(cfg, resume=resume, console=console, overwrite=overwrite, dist=dist,
                      trust_checkpoint=trust_checkpoint)
    records = trainer.run()
    if trainer.stop_state.interrupted:
        raise Stopped(trainer.stop_state.signum)  # after the checkpoint: the CLI exits 130 (SIGINT) or 143 (SIGTERM)
    return records
