"""The run loop: iterate, evaluate when due, save when due, stop when asked.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any, Optional

import torch

from fastpo import distributed as fdist
from fastpo.checkpoint import LOCK_FILE, CheckpointSaveError, RunLock, nothing_to_train_note, rng_state
from fastpo.config import TrainConfig, cpu_preset_note
from fastpo.memory import fix_mmap_threshold
from fastpo.models import resolve_device
from fastpo.metrics import before_after_note, before_after_table, plot_curves, summary_table
from fastpo.trainer.iteration import Iteration
from fastpo.trainer.lifecycle import Lifecycle, StopState, Stopped, _Drop
from fastpo.trainer.scoring import Scoring
from fastpo.trainer.setup import Setup
from fastpo.trainer.update import Update


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class Trainer(Setup, Scoring, Iteration, Update, Lifecycle):
    """Runs StarPO / StarPO-S for `cfg.trainer.iterations` iterations into `cfg.trainer.output_dir`.

    `resume=True` continues the run found in the output folder from its latest checkpoint
    (`trust_checkpoint`: whose files may need full unpickling, see `train`).
    `console` is a rich Console (created when None). `stop_after` (an iteration) stops the
    run there exactly as a Ctrl-C during that iteration would: checkpoint, then return.
    Public entry point: `run()`, returning the list of metric records.
    """

    #: The command that continues this kind of run, named in the stop and error messages.
    resume_command = "fastpo train --resume"

    def __init__(self, cfg: TrainConfig, resume: bool = False, console: Any = None,
                 stop_after: Optional[int] = None, overwrite: bool = False, dist: fdist.DistContext = fdist.SINGLE,
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
        self.stop_state = StopState()  # what the signal handler writes and the loop reads
        self._eval_pending = False
        self._lock: Optional[RunLock] = None
        self.stop_after = stop_after
        self.start_iteration = 1
        self.weight_sync_seconds = 0.0
        self.last_eval: dict = {}
        self._success_bounds: Optional[dict] = None  # eval/optimal_success, eval/random_success (fixed seeds)
        self._fsdp_root: Optional[torch.nn.Module] = None  # trainer.data_parallel=fsdp: the FSDP2 root

    def run(self) -> list[dict]:
        """Train; returns the metric records (also in OUT/metrics.jsonl). The loop: iterate,
        evaluate when due, log, save when due, stop when asked (see fastpo.trainer)."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        t = self.cfg.trainer
        fix_mmap_threshold()  # glibc's heaps reused within a phase, trimmed between phases (fastpo.memory)
        self.setup()
        old_handlers = {}
        if _in_main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old_handlers[sig] = signal.signal(sig, self._request_stop)
        run = _RunProgress(self.start_iteration - 1)
        try:
            if not self._before_loop():
                return self.logger.records
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                          console=self.console, disable=not t.progress) as progress:
                task = progress.add_task("train", total=t.iterations, completed=self.start_iteration - 1, stats="")
                for it in range(self.start_iteration, t.iterations + 1):
                    run.it = it
                    if not self._loop_step(it, run, lambda stats: progress.update(task, completed=it, stats=stats)):
                        break
        except KeyboardInterrupt:
            # A second signal: the current iteration is incomplete; keep the last saved checkpoint.
            hint = self._untrained_hint()
            self.console.print("[yellow]aborted[/]; " + (hint or f"the last checkpoint is iteration {run.last_saved}"),
                               soft_wrap=True)
            raise
        except Exception as e:
            self._emergency_save(run, e)
            hint = self._untrained_hint()
            if hint:
                self.console.print(f"[red]error before the first checkpoint[/] ({type(e).__name__}): {hint}",
                                   soft_wrap=True)
            raise
        finally:
            self.stop_state.droppable = False
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)
            self.logger.close()
            self._shutdown_engine()
            self._release_lock()
        if self.dist.is_main:
            self._report()
        return self.logger.records

    def _before_loop(self) -> bool:
        """The evaluation a SIGTERM postponed, a finished run's note, the evaluation before
        training; False when there is nothing to train."""
        total = self.cfg.trainer.iterations
        if self._eval_pending:
            if not self._run_pending_eval():
                self.console.print("stopped again; the evaluation stays pending in the checkpoint")
                return False
            if self.start_iteration > total:
                self._save(self.start_iteration - 1)  # the finished run's checkpoint, without the pending mark
        if self.start_iteration > total:
            self.console.print(nothing_to_train_note(self.out, self.start_iteration - 1, total), style="yellow")
            return False
        if self.cfg.trainer.eval_before_training and self.start_iteration == 1:
            try:
                with self._droppable():
                    ev = self._evaluate_all(0)
                self.last_eval = ev
                self.logger.log(0, ev)
            except _Drop:
                pass
        return True

    def _loop_step(self, it: int, run: "_RunProgress", show) -> bool:
        """Iteration `it`, its evaluation when due, its record, its checkpoint when due; False
        to stop the loop (a signal, `stop_after`). `show(stats)`: the progress line."""
        t = self.cfg.trainer
        self._sync_stop()  # (data parallel: the ranks agree on a stop request)
        if self.stop_state.requested:  # a signal before this iteration began (e.g. the initial eval)
            if run.updated > run.last_saved:
                self._save(run.updated)
                run.last_saved = run.updated
            hint = self._untrained_hint()
            self.console.print(f"stopped before iteration {it}" + (f"; {hint}" if hint else
                               "" if run.updated > self.start_iteration - 1 else "; nothing new to save"), soft_wrap=True)
            return False
        t_it = time.perf_counter()
        run.rng_at_start = rng_state()  # what a resume restores if this iteration is dropped
        self.stop_state.weights_touched = True  # until iteration() says its update has not begun
        try:
            metrics = self.iteration(it)
        except _Drop:
            if run.updated > run.last_saved:
                self._save(run.updated, rng=run.rng_at_start)
                run.last_saved = run.updated
            hint = self._untrained_hint()
            self.console.print(f"stopped in iteration {it} before its update: " + (hint or
                               f"dropped (a resume redoes it); resume with `{self.resume_command} {self.out}`"),
                               soft_wrap=True)
            return False
        run.updated = it  # the weights now hold this iteration's update
        if self.stop_after is not None and it >= self.stop_after:
            self.stop_state.requested = True
        self._sync_stop()  # every rank takes the same evaluate/save/stop decisions
        eval_pending, rng_before_eval = False, None
        if t.eval_every and (it % t.eval_every == 0 or it == t.iterations):
            rng_before_eval = rng_state()
            try:
                eval_pending = not self._evaluate_due(it, metrics)
            except Exception:
                # the record before the emergency checkpoint of this update, or a resume (which starts
                # after it) would leave the iteration out of metrics.jsonl for good
                metrics["eval/failed"] = 1
                metrics["time/iteration_s"] = time.perf_counter() - t_it
                self._log(it, metrics, run, show)
                raise
        metrics["time/iteration_s"] = time.perf_counter() - t_it
        self._log(it, metrics, run, show)
        if (t.save_every and it % t.save_every == 0) or it == t.iterations or self.stop_state.requested:
            self._save(it, rng=rng_before_eval if eval_pending else None, eval_pending=eval_pending)
            run.last_saved = it
        if self.stop_state.requested and (it < t.iterations or eval_pending):
            self.console.print(f"stopped after iteration {it}; resume with `{self.resume_command} {self.out}`")
            return False
        self.stop_state.interrupted = False  # a Ctrl-C in the last iteration still finished the run
        return True

    def _evaluate_due(self, it: int, metrics: dict) -> bool:
        """The evaluation of iteration `it` into `metrics`; False when a SIGTERM postponed it to
        the resume (the record gets it then)."""
        ev = None
        if not self.stop_state.term:
            try:
                with self._droppable():
                    ev = self._evaluate_all(it)
            except _Drop:
                pass
        if ev is None:
            self.console.print(f"evaluation of iteration {it} postponed to the resume")
            return False
        self.last_eval = ev
        metrics.update(ev)
        return True

    def _log(self, it: int, metrics: dict, run: "_RunProgress", show) -> None:
        """Iteration `it`'s record (metrics.jsonl), the Echo-Trap warning, the progress line, plots."""
        t = self.cfg.trainer
        metrics["echo_trap_warning"] = 0
        rec = self.logger.log(it, metrics)
        warn = self.echo.update(rec)
        if warn:
            self.logger.amend_last({"echo_trap_warning": 1})
            if not run.echo_on:  # printed when it starts firing; the flag is in every record
                self._warn(f"iteration {it}: {warn} (flagged as echo_trap_warning in metrics.jsonl while it lasts)")
        run.echo_on = bool(warn)
        # what this trainer reports (SFT from a data file has no success or score)
        shown = (("success", "train/success_rate", ".2f"), ("score", "train/score_mean", ".3f"),
                 ("entropy", "train/rollout_entropy", ".2f"))
        stats = " | ".join([f"{name} {metrics[k]:{fmt}}" for name, k, fmt in shown if k in metrics]
                           + [f"{metrics['time/iteration_s']:.0f} s/it"])
        if "eval/success_rate" in metrics:
            stats += f" | eval {metrics['eval/success_rate']:.2f}"
        show(stats)
        if not t.progress:
            self.console.print(f"iteration {it}/{t.iterations}: {stats}")
        if t.plots and self.dist.is_main and (("eval/success_rate" in metrics) or it == t.iterations):
            plot_curves(self.logger.records, os.path.join(self.out, "plots"), model_label=self.info.label)

    def _emergency_save(self, run: "_RunProgress", e: Exception) -> None:
        """After an error following an update (eval, logging, plots, disk) or before one began:
        keep the trained iterations. (Not when the failure was that very save: it would fail again.)"""
        consistent = run.updated == run.it or not self.stop_state.weights_touched
        if consistent and run.updated > run.last_saved and not isinstance(e, CheckpointSaveError):
            try:
                self._save(run.updated, rng=run.rng_at_start if run.updated < run.it else None)
                self.console.print(f"[red]error after iteration {run.updated}[/]: emergency checkpoint saved; "
                                   f"resume with `{self.resume_command} {self.out}`")
            except Exception as e2:  # the original error matters more than the failed save
                self.console.print(f"[red]emergency checkpoint failed[/]: {e2}", markup=False)

    def _report(self) -> None:
        """The end of a run (rank 0): final plots, the summary and before/after tables, the outputs."""
        records = self.logger.records
        if not any(r.get("iteration", 0) >= 1 for r in records):  # stopped before any iteration
            held = sorted(n for n in os.listdir(self.out) if n != LOCK_FILE) if os.path.isdir(self.out) else []
            self.console.print(f"no iteration was trained; {self.out}/ holds {', '.join(held) or 'nothing'}",
                               markup=False, soft_wrap=True)
            return
        if self.cfg.trainer.plots and records:
            plot_curves(records, os.path.join(self.out, "plots"), model_label=self.info.label)
        self.console.print(summary_table(records, title=f"fastpo: {self.cfg.env.name}, {self.info.label}"))
        ba = before_after_table(records, run_dir=self.out)
        note = before_after_note(records) if ba is None else None
        if ba is not None:
            self.console.print(ba)
        elif note:
            self.console.print(note, markup=False, soft_wrap=True)
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
          dist: fdist.DistContext = fdist.SINGLE, trust_checkpoint: bool = False) -> list[dict]:
    """Build a Trainer and run it; prints what the CPU preset scaled down.

    A new run (resume=False) refuses an output folder that already holds a run
    (FileExistsError) unless `overwrite` is true, which clears that run first. Raises
    Stopped (a KeyboardInterrupt) after a Ctrl-C or SIGTERM stop, once the checkpoint is saved.
    `dist`: this process's place in a data-parallel job (`fastpo.distributed.init_from_env`);
    the default is one process. Raises fastpo.distributed.DistributedError for a setting the
    data-parallel trainer does not support (`check_trainer_support`). `trust_checkpoint`
    (`--trust-checkpoint`): a resume may load checkpoint files that need full unpickling
    (an older fastpo's), with a warning; without it they raise
    fastpo.checkpoint.UntrustedCheckpoint (a ConfigError naming the file).
    """
    from rich.console import Console

    fdist.check_trainer_support(cfg, dist.world_size, torchrun=dist.initialized)
    console = console or Console(quiet=not dist.is_main)
    if "cpu" in cfg.preset.split(",") and dist.is_main:
        console.print(f"[cyan]{cpu_preset_note(cfg)}[/]")
    trainer = Trainer(cfg, resume=resume, console=console, overwrite=overwrite, dist=dist,
                      trust_checkpoint=trust_checkpoint)
    records = trainer.run()
    if trainer.stop_state.interrupted:
        raise Stopped(trainer.stop_state.signum)  # after the checkpoint: the CLI exits 130 (SIGINT) or 143 (SIGTERM)
    return records
