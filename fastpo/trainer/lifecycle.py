"""The run's lifecycle: signals (Ctrl-C, SIGTERM), stopping at a point all processes share,
checkpoints (one-process format, gathered from FSDP2 shards) and the evaluation a SIGTERM postponed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from typing import Optional

from fastpo import distributed as fdist
from fastpo import fsdp as ffsdp
from fastpo.checkpoint import save_checkpoint
from fastpo.config import dump_yaml
from fastpo.memory import mapped_allocations, release_free_memory


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal after saving (or, on a second signal, without): `signum`
    is SIGINT (Ctrl-C) or SIGTERM; the CLI exits with 128 + signum (130, 143)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__()
        self.signum = int(signum)


class _Drop(BaseException):
    """Raised by the SIGTERM handler inside a phase that changes no weight (a rollout, an
    evaluation): that work is dropped. A BaseException, so no `except Exception` swallows it."""


@dataclasses.dataclass
class StopState:
    """The run's stop state: the one object the signal handler writes and the run loop reads
    (one process: the handler itself; data parallel: `_sync_stop` at the points the ranks share).

    requested: stop at the next point that allows it (a signal, or `Trainer.stop_after`).
    signum: the signal that asked (SIGINT or SIGTERM; SIGTERM wins), None for `stop_after`.
    interrupted: the run stopped on a signal (after saving), not by reaching its end; `train`
    then raises Stopped. droppable: inside a phase a SIGTERM may drop at once (a rollout and
    what follows it up to the update, an evaluation). weights_touched: the current
    iteration's update has begun (an error then leaves no consistent state to save).
    """

    requested: bool = False
    signum: Optional[int] = None
    interrupted: bool = False
    droppable: bool = False
    weights_touched: bool = False

    @property
    def term(self) -> bool:
        """A SIGTERM asked to stop (drop what may be dropped, postpone evaluations)."""
        return self.requested and self.signum == signal.SIGTERM


class Lifecycle:
    """`Trainer`'s lifecycle: the signal handler (`_request_stop`), stopping where every
    process agrees (`_sync_stop`), droppable phases, checkpoints (`_save`), the run lock."""

    def _sync_stop(self) -> bool:
        """Share a stop request among the ranks (each may have got its signal at another moment),
        so that all of them stop at the same point; SIGTERM wins over SIGINT (one process: its
        own request). Returns whether a stop is requested."""
        st = self.stop_state
        stop, term = fdist.all_reduce(self.dist, [float(st.requested), float(st.term)], "max")
        if stop and not st.requested:
            st.requested = st.interrupted = True
        if stop:
            st.signum = signal.SIGTERM if term else (st.signum or signal.SIGINT)
        return bool(stop)

    def _request_stop(self, signum, frame) -> None:
        """The SIGINT / SIGTERM handler (see the module docstring); a second signal aborts at once
        without saving (Stopped)."""
        signum = signum or signal.SIGINT
        if self.dist.initialized:
            # Data parallel: only note the request; the ranks agree on it at the next shared point
            # (`_sync_stop`: before an update, after an iteration), so a rollout or evaluation under
            # way finishes. No second-signal abort: torchrun forwards one signal as several and
            # kills the workers itself after its grace period.
            first = not self.stop_state.requested
            self.stop_state.requested = self.stop_state.interrupted = True
            if self.stop_state.signum != signal.SIGTERM:
                self.stop_state.signum = signum
            if first and self.dist.is_main:
                self.console.print(f"[yellow]{signal.Signals(signum).name}[/]: stopping all processes at the next "
                                   "shared point (before this iteration's update or after it), saving the last "
                                   "complete iteration, then exit")
            return
        if self.stop_state.requested:
            raise Stopped(signum)
        self.stop_state.requested = self.stop_state.interrupted = True
        self.stop_state.signum = signum
        if signum == signal.SIGTERM:
            self.console.print("[yellow]SIGTERM[/]: stopping: the current rollout or evaluation is dropped (an update "
                               "under way finishes), the last complete iteration is saved, then exit (signal again "
                               "to abort without saving)")
            if self.stop_state.droppable:
                self.stop_state.droppable = False
                raise _Drop
        else:
            self.console.print("[yellow]Ctrl-C[/]: finishing this iteration, saving a checkpoint, then exiting "
                               "(press again to abort without saving)")

    @contextlib.contextmanager
    def _droppable(self):
        """Around work that changes no weight (a rollout and what follows it up to the update, an
        evaluation): a SIGTERM inside raises _Drop out of it at once."""
        self.stop_state.droppable = True
        try:
            yield
        finally:
            self.stop_state.droppable = False

    def _save(self, it: int, rng: Optional[dict] = None, eval_pending: bool = False) -> str:
        """Checkpoint iteration `it`; `rng` (default: the current RNG states) is what a resume
        restores; `eval_pending` marks an evaluation of `it` still to run on resume. Data
        parallel: rank 0 writes it in the one-process format (whole model and optimizer state,
        so any world size resumes from it); the others return "". Replicated: the replicas
        are equal, rank 0 writes its own. FSDP2: every
        rank first joins the gathering of the full model, critic and optimizer states
        (`torch.distributed.checkpoint.state_dict`), which rank 0 writes in the one-process
        format."""
        t0 = time.perf_counter()
        model, opts, critic, head = self.model, self._optimizers(), self.critic_body, self.value_head
        if self._fsdp_root is not None:
            model, opts, critic, head = self._full_state_views()
        if not self.dist.is_main:
            return ""
        path = save_checkpoint(self.out, it, model=model, tokenizer=self.tokenizer, optimizers=opts,
                               state={"last_eval": self.last_eval, "eval_pending": eval_pending,
                                      **({} if self.schedule is None else
                                         {"rollout_schedule": self.schedule.state_dict()})},
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

        def view(module):
            if module is None:
                return None
            state = get_model_state_dict(module, options=full)
            # a tied weight (the LM head) is written once, under its first name, as one process does
            names = {n for n, _ in module.named_parameters()}
            tied = {n for n, _ in module.named_parameters(remove_duplicate=False)} - names
            return ffsdp.FullStateView({k: v for k, v in state.items() if k not in tied}, module)

        opts = {k: ffsdp.FullStateView(ffsdp.full_optimizer_state(self.dist, self._fsdp_root, o))
                for k, o in self._optimizers().items()}
        return view(self.model), opts, view(self.critic_body), view(self.value_head)

    def _evaluate_all(self, it: int) -> dict:
        """`evaluate` (each rank its share of the eval seeds); FSDP2: with the parameters
        gathered whole on every rank meanwhile."""
        # tensors mapped on their own: the evaluation's wide batches fragment the heaps most,
        # and its peak is the main job's (fastpo.memory)
        try:
            with mapped_allocations(), ffsdp.gathered(self._fsdp_root):
                return self.evaluate(it)
        finally:
            release_free_memory()  # what it freed in the heaps, back to the system

    def _run_pending_eval(self) -> bool:
        """The evaluation of the resumed checkpoint's iteration that a SIGTERM stopped: run it and
        add it to that iteration's record. False when stopped again (it stays pending)."""
        it = self.start_iteration - 1
        self.console.print(f"evaluating iteration {it} (postponed by the SIGTERM that stopped the run)")
        try:
            with self._droppable():
                ev = self._evaluate_all(it)
        except _Drop:
            return False
        self.last_eval = ev
        if self.logger.records and self.logger.records[-1].get("iteration") == it:
            self.logger.extend_last(ev)
        else:
            self.logger.log(it, ev)
        self._eval_pending = False
        return True

    def _untrained_hint(self) -> str:
        """What to do with the run folder when nothing was trained there yet ("" when a
        checkpoint or a trained iteration is there): the same command reuses it, and so does a
        resume (from iteration 1 with its config.yaml)."""
        from fastpo.checkpoint import untrained_start

        if not self.dist.is_main or not untrained_start(self.out):
            return ""
        return (f"nothing was trained yet and {self.out} holds no checkpoint: run the same command again (it "
                f"reuses the folder), or `{self.resume_command} {self.out}` to start again from iteration 1 "
                f"with its config.yaml")

    def _release_lock(self, remove: bool = False) -> None:
        if self._lock is not None:
            self._lock.release(remove=remove)
            self._lock = None
