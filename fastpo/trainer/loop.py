"""The run loop shared by the StarPO trainer (fastpo.trainer.step) and SFT (fastpo.sft.SFTTrainer):
`RunLoop` sets up, evaluates before training, then per iteration iterates, evaluates when due,
logs and saves when due, and stops when asked; `RunTrainer` is what both trainers share. What
a stop, a dropped iteration, a postponed evaluation or an error saves and says is
`fastpo.trainer.lifecycle.StopPaths`.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Optional

from fastpo.config.schema import TrainConfig
from fastpo.distributed.context import DistContext, SINGLE
from fastpo.memory import fix_mmap_threshold, mapped_allocations, release_free_memory
from fastpo.model_loading import resolve_device
from fastpo.report.metrics import warn_user
from fastpo.report.plots import plot_curves
from fastpo.report.summary import (before_after_note, before_after_table, game_result_lines, print_table,
                                   result_line, summary_table)
from fastpo.run.checkpoint import nothing_to_train_note
from fastpo.run.folder import LOCK_FILE, RunLock
import fastpo.trainer.fsdp as ffsdp
from fastpo.trainer.lifecycle import StopControl, StopPaths
from fastpo.trainer.setup import Parts, check_prompts_fit


class RunTrainer:
    """What every trainer of a run folder shares (the StarPO `Trainer`, fastpo.sft.SFTTrainer):
    its settings, stop control, run-folder lock and parts, and the answers `RunLoop` asks of
    it except the ones a trainer defines: `setup()` (build `parts`), `iteration(it)` (its
    metrics, or None when a SIGTERM dropped it before its update), `evaluate(it)` (the
    evaluation's metrics; here `Sampler.evaluate`) and `progress_fields` (the progress line's
    figures).

    `resume=True` continues the run found in the output folder from its latest checkpoint
    (`trust_checkpoint`: whose files may need full unpickling). `console` is a rich Console
    (created when None). `stop_after` (an iteration) stops the run there exactly as a Ctrl-C
    during that iteration would: checkpoint, then return. `run()` returns the metric records.
    """

    #: The command that continues this kind of run, named in the stop and error messages.
    resume_command = "fastpo train --resume"
    #: The figures of the progress line before the iteration's seconds: (label, metric key,
    #: format), each shown when the iteration's metrics have it.
    progress_fields: tuple = ()
    #: The evaluation's figure, shown after the seconds when an evaluation ran.
    eval_field = ("eval", "eval/success_rate", ".2f")

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

    def iteration(self, it: int) -> Optional[dict]:
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


class RunLoop:
    """The loop of a `RunTrainer`: set up, evaluate before training, then per iteration:
    iterate, evaluate when due, log, save when due, stop when asked; the report at the end.

    Signals (`fastpo.trainer.lifecycle.StopControl`): Ctrl-C finishes the iteration, saves and
    exits; SIGTERM drops an iteration whose update has not begun (a resume redoes it
    identically), finishes an update under way, postpones an evaluation to the resume; a
    second signal aborts without saving. What each of those saves and says: `StopPaths`."""

    def __init__(self, trainer):
        self.tr = trainer
        self.cfg, self.dist, self.console, self.out = trainer.cfg, trainer.dist, trainer.console, trainer.out
        self.stop = trainer.stop
        self.echo_on = False  # the Echo-Trap warning is firing (printed when it starts)

    def run(self) -> list[dict]:
        """Set up, loop, report; returns the metric records."""
        fix_mmap_threshold()  # glibc's heaps reused within a phase, trimmed between phases (fastpo.memory)
        self.tr.setup()
        p, t = self.tr.parts, self.cfg.trainer
        stops = self.stops = StopPaths(self.tr, self.evaluate)
        with self.stop.signals():
            try:
                if not self.before_loop():
                    return p.logger.records
                with self.progress() as show:
                    for it in range(p.start_iteration, t.iterations + 1):
                        t0 = time.perf_counter()
                        if not stops.begin(it):  # a stop came before it (e.g. in the evaluation before training)
                            break
                        metrics = self.tr.iteration(it)  # None: a SIGTERM dropped it before its update
                        if metrics is None:
                            stops.dropped(it)
                            break
                        if not self.after_iteration(it, metrics, t0, show):
                            break
            except KeyboardInterrupt:  # a second signal: the iteration under way is incomplete
                stops.aborted()
                raise
            except Exception as e:
                stops.failed(e)
                raise
            finally:
                p.logger.close()
                p.sampler.shutdown()
                self.tr.release_lock()
        if self.dist.is_main:
            self.report()
            self.tr.finish(p.logger.records)
        return p.logger.records

    @contextlib.contextmanager
    def progress(self):
        """The progress bar of the run's iterations (shown with trainer.progress); yields its
        update `show(it, stats)`."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        t = self.cfg.trainer
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                      console=self.console, disable=not t.progress) as bar:
            task = bar.add_task("train", total=t.iterations, completed=self.tr.parts.start_iteration - 1, stats="")
            yield lambda it, stats: bar.update(task, completed=it, stats=stats)

    def before_loop(self) -> bool:
        """The evaluation a SIGTERM postponed, a finished run's note, the evaluation before
        training; False when there is nothing to train."""
        total, p = self.cfg.trainer.iterations, self.tr.parts
        if p.eval_pending and not self.stops.pending_evaluation():
            return False
        if p.start_iteration > total:
            self.console.print(nothing_to_train_note(self.out, p.start_iteration - 1, total), style="yellow")
            return False
        if self.cfg.trainer.eval_before_training and p.start_iteration == 1:
            ev = self.stops.evaluation(0)
            if ev is not None:
                p.last_eval = ev
                p.logger.log(0, ev)
        return True

    def after_iteration(self, it: int, metrics: dict, t0: float, show) -> bool:
        """Iteration `it` done (its update complete; it began at `t0`): its evaluation when due,
        its record, its checkpoint when due; False to stop the loop (a signal, `stop_after`)."""
        t, stops = self.cfg.trainer, self.stops
        stops.updated = it  # the weights now hold this iteration's update
        if self.tr.stop_after is not None and it >= self.tr.stop_after:
            self.stop.state.requested = True
        self.stop.sync()  # every rank takes the same evaluate/save/stop decisions
        evaluated = pending = False
        if t.eval_every and (it % t.eval_every == 0 or it == t.iterations):
            try:
                evaluated = stops.due_evaluation(it, metrics)
            except Exception:
                # the record before the emergency checkpoint of this update, or a resume (which starts
                # after it) would leave the iteration out of metrics.jsonl for good
                metrics["eval/failed"] = 1
                self.log(it, metrics, t0, show, evaluated)
                raise
            pending = not evaluated
        self.log(it, metrics, t0, show, evaluated)
        if (t.save_every and it % t.save_every == 0) or it == t.iterations or self.stop.state.requested:
            stops.save(it, eval_pending=pending)
        return stops.after(it, pending)

    def evaluate(self, it: int) -> dict:
        """The trainer's `evaluate` (each rank its share of the eval seeds); FSDP2: with the
        parameters gathered whole on every rank meanwhile."""
        # tensors mapped on their own: the evaluation's wide batches fragment the heaps most,
        # and its peak is the main job's (fastpo.memory)
        try:
            with mapped_allocations(), ffsdp.gathered(self.tr.parts.models.fsdp_root):
                return self.tr.evaluate(it)
        finally:
            release_free_memory()  # what it freed in the heaps, back to the system

    def log(self, it: int, metrics: dict, t0: float, show, evaluated: bool) -> None:
        """Iteration `it`'s record (metrics.jsonl) with its seconds since `t0`, the Echo-Trap
        warning, the progress line, plots (after an evaluation and at the end)."""
        t, p = self.cfg.trainer, self.tr.parts
        metrics["time/iteration_s"] = time.perf_counter() - t0
        metrics["echo_trap_warning"] = 0
        rec = p.logger.log(it, metrics)
        warn = p.echo.update(rec)
        if warn:
            p.logger.amend_last({"echo_trap_warning": 1})
            if not self.echo_on:  # printed when it starts firing; the flag is in every record
                self.tr.warn(f"iteration {it}: {warn} (flagged as echo_trap_warning in metrics.jsonl while it lasts)")
        self.echo_on = bool(warn)
        stats = " | ".join([f"{name} {metrics[k]:{fmt}}" for name, k, fmt in self.tr.progress_fields if k in metrics]
                           + [f"{metrics['time/iteration_s']:.0f} s/it"])
        name, key, fmt = self.tr.eval_field
        if key in metrics:
            stats += f" | {name} {metrics[key]:{fmt}}"
        show(it, stats)
        if not t.progress:
            self.console.print(f"iteration {it}/{t.iterations}: {stats}")
        if t.plots and self.dist.is_main and (evaluated or it == t.iterations):
            plot_curves(p.logger.records, os.path.join(self.out, "plots"), model_label=p.models.info.trained_label())

    def report(self) -> None:
        """The end of a run (rank 0): final plots, the summary and before/after tables, the outputs."""
        p = self.tr.parts
        records = p.logger.records
        if not any(r.get("iteration", 0) >= 1 for r in records):  # stopped before any iteration
            held = sorted(n for n in os.listdir(self.out) if n != LOCK_FILE) if os.path.isdir(self.out) else []
            self.console.print(f"no iteration was trained; {self.out}/ holds {', '.join(held) or 'nothing'}",
                               markup=False, soft_wrap=True)
            return
        label = p.models.info.trained_label()  # the run's model, not the one it started from
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

