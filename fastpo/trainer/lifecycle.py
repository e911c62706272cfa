"""The run's lifecycle: stopping as a flag the signal handler sets and the run checks at named
points (`StopControl`), every path off the loop's plain one in one place (`StopPaths`: a stop,
a dropped iteration, a postponed evaluation, an abort, an error) and checkpoints in the
one-process format, gathered from FSDP2 shards (`Checkpointer`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from typing import Callable, Optional

from fastpo.config.files import dump_yaml
from fastpo.config.schema import TrainConfig
from fastpo.distributed.collectives import all_reduce
from fastpo.distributed.context import DistContext
from fastpo.run.checkpoint import CheckpointSaveError, rng_state, save_checkpoint
from fastpo.run.folder import unsaved_note, untrained_start
import fastpo.trainer.fsdp as ffsdp
from fastpo.trainer.models import Models


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal after saving (or, on a second signal, without): `signum`
    is SIGINT (Ctrl-C) or SIGTERM; the CLI exits with 128 + signum (130, 143)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__()
        self.signum = int(signum)


@dataclasses.dataclass
class StopState:
    """The run's stop flag: what the signal handler writes and the run reads (one process: the
    handler's own; data parallel: agreed by `StopControl.sync` at the points the ranks share).

    requested: stop at the next point that allows it (a signal, or `RunTrainer.stop_after`).
    signum: the signal that asked (SIGINT or SIGTERM; SIGTERM wins), None for `stop_after`.
    interrupted: the run stopped on a signal (after saving), not by reaching its end; `train`
    then raises Stopped. weights_touched: the current iteration's update has begun (an error
    then leaves no consistent state to save); written by `StopControl.iteration_begins` /
    `update_begins` alone.
    """

    requested: bool = False
    signum: Optional[int] = None
    interrupted: bool = False
    weights_touched: bool = False

    @property
    def term(self) -> bool:
        """A SIGTERM asked to stop (drop what may be dropped, postpone evaluations)."""
        return self.requested and self.signum == signal.SIGTERM


class StopControl:
    """The run's stop request, a flag (`state`): the SIGINT / SIGTERM handler (`request_stop`)
    sets it and returns; the run reads it at these points, and throws nothing through the work
    under way:

    1. before each turn of a rollout, training's and the evaluation's (`dropping`, the
       rollout's `stop_check`): a SIGTERM ends the rollout there;
    2. after an iteration's rollout (`dropping`) and before its update (`drop_before_update`):
       a SIGTERM drops the iteration (nothing changed: a resume redoes it identically); an
       update under way is finished;
    3. after an evaluation (`dropping`): a SIGTERM postpones it to the resume;
    4. before and after each iteration (`sync`): the loop stops there, saving the last
       complete iteration (`StopPaths`).

    A Ctrl-C (SIGINT) drops nothing: the iteration under way finishes. A second signal aborts
    at once without saving: the handler raises Stopped there, as Python's own Ctrl-C raises
    KeyboardInterrupt. Data parallel: the ranks act only at the points they share (2's before
    the update, 4), so a rollout or an evaluation under way finishes first; there is no
    second-signal abort (torchrun forwards one signal as several and kills the workers itself
    after its grace period). `iteration_begins` / `update_begins` mark whether the current
    iteration's weights have begun to change."""

    def __init__(self, dist: DistContext, console):
        self.dist, self.console = dist, console
        self.state = StopState()  # what the signal handler writes and the loop reads

    @contextlib.contextmanager
    def signals(self):
        """Around the run loop: SIGINT and SIGTERM call `request_stop` (in the main thread; a
        run in another thread keeps the handlers it has), the earlier handlers back after."""
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, self.request_stop)
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def request_stop(self, signum, frame) -> None:
        """The SIGINT / SIGTERM handler: sets the flag and says what happens next; a second
        signal aborts at once without saving (raises Stopped; one process)."""
        signum = signum or signal.SIGINT
        st = self.state
        if self.dist.initialized:  # the ranks agree on it at the next shared point (`sync`)
            first = not st.requested
            st.requested = st.interrupted = True
            if st.signum != signal.SIGTERM:
                st.signum = signum
            if first and self.dist.is_main:
                self.console.print(f"[yellow]{signal.Signals(signum).name}[/]: stopping all processes at the next "
                                   "shared point (before this iteration's update or after it), saving the last "
                                   "complete iteration, then exit")
            return
        if st.requested:
            raise Stopped(signum)
        st.requested = st.interrupted = True
        st.signum = signum
        if signum == signal.SIGTERM:
            self.console.print("[yellow]SIGTERM[/]: stopping: the current rollout or evaluation is dropped (an update "
                               "under way finishes), the last complete iteration is saved, then exit (signal again "
                               "to abort without saving)")
        else:
            self.console.print("[yellow]Ctrl-C[/]: finishing this iteration, saving a checkpoint, then exiting "
                               "(press again to abort without saving)")

    def dropping(self) -> bool:
        """Whether the work under way, which changes no weight (a rollout, the steps before an
        update, an evaluation), is to end now and be dropped: a SIGTERM in one process. Data
        parallel: False (the ranks drop together at `drop_before_update`)."""
        return not self.dist.initialized and self.state.term

    def drop_before_update(self) -> bool:
        """The point before an update, shared by the ranks (`sync`): whether a SIGTERM drops the
        iteration."""
        return self.sync() and self.state.term

    def sync(self) -> bool:
        """Share a stop request among the ranks (each may have got its signal at another moment),
        so that all of them stop at the same point; SIGTERM wins over SIGINT (one process: its
        own request). Returns whether a stop is requested."""
        st = self.state
        stop, term = all_reduce(self.dist, [float(st.requested), float(st.term)], "max")
        if stop and not st.requested:
            st.requested = st.interrupted = True
        if stop:
            st.signum = signal.SIGTERM if term else (st.signum or signal.SIGINT)
        return bool(stop)

    def iteration_begins(self) -> None:
        """An iteration (or the work before its update) starts: no weight changed yet."""
        self.state.weights_touched = False

    def update_begins(self) -> None:
        """The weights are about to change: an error from here on leaves no state to save."""
        self.state.weights_touched = True


class StopPaths:
    """Every path off the run loop's plain one, in one place: what the loop saves and says when
    a stop comes before an iteration (`begin`), a SIGTERM drops one (`dropped`) or
    postpones an evaluation (`evaluation`, `due_evaluation`, `pending_evaluation`), a stop
    comes after one (`after`), a second signal aborts (`aborted`) or an error ends the run
    (`failed`).

    It holds where the loop is: the iteration under way (`it`), the last one whose update is
    complete (`updated`), the last one saved (`last_saved`), the RNG states at the current
    iteration's start (what a resume restores if it is dropped) and before its evaluation
    (what it restores to run a postponed one). `trainer`: the RunTrainer (its `save`,
    `resume_hint`, `stop`, `parts`); `evaluate(it)`: the loop's evaluation of iteration `it`."""

    def __init__(self, trainer, evaluate: Callable[[int], dict]):
        self.tr, self.evaluate = trainer, evaluate
        self.stop, self.console, self.parts = trainer.stop, trainer.console, trainer.parts
        self.updated = self.last_saved = self.it = self.parts.start_iteration - 1
        self.rng_at_start: Optional[dict] = None
        self.rng_before_eval: Optional[dict] = None

    def save(self, it: int, rng: Optional[dict] = None, eval_pending: bool = False) -> None:
        """Checkpoint iteration `it` (`RunTrainer.save`); with `eval_pending`, at the RNG states
        before its postponed evaluation."""
        self.tr.save(it, rng=self.rng_before_eval if eval_pending else rng, eval_pending=eval_pending)
        self.last_saved = it

    def begin(self, it: int) -> bool:
        """Whether iteration `it` begins: False when a stop came before it (the ranks agree:
        `sync`), after saving what is not saved yet and saying so; else its RNG states are kept
        (what a resume restores if it is dropped) and its weights count as touched until the
        trainer says its update has not begun."""
        self.it = it
        if not self.stop.sync():
            self.rng_at_start = rng_state()
            self.stop.update_begins()
            return True
        if self.updated > self.last_saved:
            self.save(self.updated)
        hint = self.untrained_hint()
        self.console.print(f"stopped before iteration {it}" + (f"; {hint}" if hint else
                           "" if self.updated > self.parts.start_iteration - 1 else "; nothing new to save"),
                           soft_wrap=True)
        return False

    def dropped(self, it: int) -> None:
        """Iteration `it` dropped by a SIGTERM before its update: save the last complete one."""
        if self.updated > self.last_saved:
            self.save(self.updated, rng=self.rng_at_start)
        hint = self.untrained_hint()
        self.console.print(f"stopped in iteration {it} before its update: " + (hint or
                           f"dropped (a resume redoes it); resume with `{self.tr.resume_hint()}`"), soft_wrap=True)

    def after(self, it: int, eval_pending: bool) -> bool:
        """After iteration `it` was logged and saved: False, saying so, when a stop ends the
        loop before the run's last iteration or its evaluation waits for the resume."""
        st = self.stop.state
        if st.requested and (it < self.tr.cfg.trainer.iterations or eval_pending):
            self.console.print(f"stopped after iteration {it}; resume with `{self.tr.resume_hint()}`")
            return False
        st.interrupted = False  # a Ctrl-C in the last iteration still finished the run
        return True

    def evaluation(self, it: int) -> Optional[dict]:
        """The evaluation of iteration `it`, or None when a SIGTERM ended it (one process: after
        the rollout turn under way)."""
        ev = self.evaluate(it)
        return None if self.stop.dropping() else ev

    def due_evaluation(self, it: int, metrics: dict) -> bool:
        """The evaluation due after iteration `it` into `metrics` (the ranks agreed on the stop
        state just before); False when a SIGTERM postponed it to the resume (the record gets it
        then; the checkpoint keeps the RNG states from before it)."""
        self.rng_before_eval = rng_state()
        ev = None if self.stop.state.term else self.evaluation(it)
        if ev is None:
            self.console.print(f"evaluation of iteration {it} postponed to the resume")
            return False
        self.parts.last_eval = ev
        metrics.update(ev)
        return True

    def pending_evaluation(self) -> bool:
        """On resume, the evaluation a SIGTERM postponed (of the checkpoint's iteration): run it
        and add it to that iteration's record; a finished run's checkpoint saved again without
        the pending mark. False when stopped again (it stays pending)."""
        p = self.parts
        it = p.start_iteration - 1
        self.console.print(f"evaluating iteration {it} (postponed by the SIGTERM that stopped the run)")
        ev = self.evaluation(it)
        if ev is None:
            self.console.print("stopped again; the evaluation stays pending in the checkpoint")
            return False
        p.last_eval = ev
        if p.logger.records and p.logger.records[-1].get("iteration") == it:
            p.logger.extend_last(ev)
        else:
            p.logger.log(it, ev)
        p.eval_pending = False
        if p.start_iteration > self.tr.cfg.trainer.iterations:
            self.tr.save(it)  # the finished run's checkpoint, without the pending mark
        return True

    def aborted(self) -> None:
        """A second signal aborted the run: the current iteration is incomplete; the last saved
        checkpoint stays."""
        hint = self.untrained_hint()
        self.console.print("[yellow]aborted[/]; " + (hint or f"the last checkpoint is iteration {self.last_saved}"),
                           soft_wrap=True)

    def failed(self, e: Exception) -> None:
        """An error after an update (eval, logging, plots, disk) or before one began: an
        emergency checkpoint keeps the trained iterations (not when the failure was that very
        save: it would fail again); before the first checkpoint, what to do with the folder."""
        consistent = self.updated == self.it or not self.stop.state.weights_touched
        if consistent and self.updated > self.last_saved and not isinstance(e, CheckpointSaveError):
            try:
                self.save(self.updated, rng=self.rng_at_start if self.updated < self.it else None)
                self.console.print(f"[red]error after iteration {self.updated}[/]: emergency checkpoint saved; "
                                   f"resume with `{self.tr.resume_hint()}`")
            except Exception as e2:  # the original error matters more than the failed save
                self.console.print(f"[red]emergency checkpoint failed[/]: {e2}", markup=False)
        hint = self.untrained_hint()
        if hint:
            self.console.print(f"[red]error before the first checkpoint[/] ({type(e).__name__}): {hint}",
                               soft_wrap=True)

    def untrained_hint(self) -> str:
        """What to do with the run folder when no checkpoint was saved there yet ("" when one
        is there): the same command reuses it, and so does a resume (from iteration 1 with its
        config.yaml); iterations trained but not saved are said."""
        if not self.tr.dist.is_main or not untrained_start(self.tr.out):
            return ""
        return (f"{unsaved_note(self.tr.out)}: run the same command again (it reuses the folder), or "
                f"`{self.tr.resume_hint()}` to start again from iteration 1 with its config.yaml")


class Checkpointer:
    """Writes the run's checkpoints (`fastpo.run.checkpoint.save_checkpoint`): model, tokenizer,
    optimizers, critic, RNG states and the loop's state. Data parallel: rank 0 writes them in
    the one-process format (whole model and optimizer state, so any world size resumes from
    it); replicated ranks are equal, rank 0 writes its own; FSDP2: every rank first joins the
    gathering of the full model, critic and optimizer states
    (`torch.distributed.checkpoint.state_dict`), which rank 0 writes."""

    def __init__(self, cfg: TrainConfig, dist: DistContext, models: Models, optimizers: dict, out: str,
                 console):
        self.cfg, self.dist, self.models, self.optimizers, self.out, self.console = \
            cfg, dist, models, optimizers, out, console

    def save(self, it: int, state: dict, rng: Optional[dict] = None) -> str:
        """Checkpoint iteration `it` with the loop's `state` (a dict saved in state.pt); `rng`
        (default: the current RNG states) is what a resume restores. Returns its path (""
        on ranks other than 0)."""
        t0 = time.perf_counter()
        m = self.models
        model, opts, critic, head = m.policy, self.optimizers, m.critic_body, m.value_head
        if m.fsdp_root is not None:
            model, opts, critic, head = self._full_state_views()
        if not self.dist.is_main:
            return ""
        path = save_checkpoint(self.out, it, model=model, tokenizer=m.tokenizer, optimizers=opts, state=state,
                               config_yaml=dump_yaml(self.cfg), critic_backbone=critic,
                               value_head=head, keep=self.cfg.trainer.keep_checkpoints, rng=rng)
        self.console.print(f"checkpoint: {path} ({time.perf_counter() - t0:.1f} s)")
        return path

    def _full_state_views(self) -> tuple:
        """(model, optimizers, critic body, value head) as `save_checkpoint` reads them, from the
        full states of the FSDP2-sharded modules (gathered on every rank, on the CPU, complete
        on rank 0): `get_model_state_dict` / `ffsdp.full_optimizer_state`."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        m = self.models

        def view(module):
            if module is None:
                return None
            state = get_model_state_dict(module, options=full)
            # a tied weight (the LM head) is written once, under its first name, as one process does
            names = {n for n, _ in module.named_parameters()}
            tied = {n for n, _ in module.named_parameters(remove_duplicate=False)} - names
            return ffsdp.FullStateView({k: v for k, v in state.items() if k not in tied}, module)

        opts = {k: ffsdp.FullStateView(ffsdp.full_optimizer_state(self.dist, m.fsdp_root, o))
                for k, o in self.optimizers.items()}
        return view(m.policy), opts, view(m.critic_body), view(m.value_head)
