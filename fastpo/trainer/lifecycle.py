"""The run's lifecycle: signals (Ctrl-C, SIGTERM) and stopping at a point all processes share
(`StopControl`), checkpoints in the one-process format, gathered from FSDP2 shards (`Checkpointer`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from typing import Optional

from fastpo.distributed.collectives import all_reduce

from fastpo.distributed.context import DistContext
import fastpo.trainer.fsdp as ffsdp
from fastpo.run.checkpoint import save_checkpoint
from fastpo.config.schema import TrainConfig
from fastpo.config.files import dump_yaml
from fastpo.trainer.models import Models


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal after saving (or, on a second signal, without): `signum`
    is SIGINT (Ctrl-C) or SIGTERM; the CLI exits with 128 + signum (130, 143)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__()
        self.signum = int(signum)


class Dropped(BaseException):
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
    iteration's update has begun (an error then leaves no consistent state to save); written
    by `StopControl.iteration_begins` / `update_begins` alone.
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


class StopControl:
    """The run's stop requests: the SIGINT / SIGTERM handler (`request_stop`), the ranks'
    agreement on them (`sync`), phases a SIGTERM may drop (`droppable`), and whether the
    current iteration's update has begun (`iteration_begins`, `update_begins`)."""

    def __init__(self, dist: DistContext, console):
        self.dist, self.console = dist, console
        self.state = StopState()  # what the signal handler writes and the loop reads

    def iteration_begins(self) -> None:
        """An iteration (or the work before its update) starts: no weight changed yet."""
        self.state.weights_touched = False

    def update_begins(self) -> None:
        """The weights are about to change: an error from here on leaves no state to save."""
        self.state.weights_touched = True

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

    def request_stop(self, signum, frame) -> None:
        """The SIGINT / SIGTERM handler (see fastpo.trainer); a second signal aborts at once
        without saving (Stopped)."""
        signum = signum or signal.SIGINT
        st = self.state
        if self.dist.initialized:
            # Data parallel: only note the request; the ranks agree on it at the next shared point
            # (`sync`: before an update, after an iteration), so a rollout or evaluation under
            # way finishes. No second-signal abort: torchrun forwards one signal as several and
            # kills the workers itself after its grace period.
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
            if st.droppable:
                st.droppable = False
                raise Dropped
        else:
            self.console.print("[yellow]Ctrl-C[/]: finishing this iteration, saving a checkpoint, then exiting "
                               "(press again to abort without saving)")

    @contextlib.contextmanager
    def droppable(self):
        """Around work that changes no weight (a rollout and what follows it up to the update, an
        evaluation): a SIGTERM inside raises Dropped out of it at once."""
        self.state.droppable = True
        try:
            yield
        finally:
            self.state.droppable = False


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
