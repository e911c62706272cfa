"""Processes: `--nproc N` under torchrun, what a rank that left its job does, the console of
a process (no progress bars on other ranks; escapes for a console that is not UTF-8)."""
from __future__ import annotations

import os
import sys

from fastpo.cli.common import build_config, resumed_run_config
from fastpo.config.fields import ConfigError


def check_processes(args, argv: list[str]) -> int | None:
    """`--nproc` and torchrun: None to go on in this process, else the exit status (2 for bad
    input). --nproc N > 1 runs torchrun's launcher in this process (`launch_processes`) and
    gives the job's exit status."""
    # torch: imported when the command runs, so `fastpo --help` loads none
    from fastpo.distributed.context import DistributedError, torchrun_env
    from fastpo.distributed.launch import check_nproc, check_trainer_support, strip_nproc

    nproc = getattr(args, "nproc", None)
    try:
        if nproc is not None:
            check_nproc(nproc, args.device)
        torchrun_env()  # bad torchrun variables: one line
        if (nproc or 1) > 1:  # what the N processes would each refuse, said once before torchrun starts them
            name = args.model
            if args.command == "train":
                if args.resume is None:
                    cfg = build_config(args, [])
                    check_trainer_support(cfg, args.nproc)
                else:
                    cfg = resumed_run_config(args)  # a folder that is no run, a setting a resume cannot change
                name = cfg.model.name
            if name is not None:  # (fastpo.model_loading is imported once the settings are valid)
                # torch: imported when the command runs, so `fastpo --help` loads none
                from fastpo.model_loading import check_model_name

                check_model_name(name)
    except (DistributedError, ConfigError, FileNotFoundError) as e:
        print(f"fastpo {args.command}: error: {e}", file=sys.stderr)
        return 2
    if (nproc or 1) > 1:  # torchrun runs N of this command
        return launch_processes(nproc, strip_nproc(argv))
    return None


def launch_processes(nproc: int, argv: list[str]) -> int:
    """Run `fastpo <argv>` in `nproc` processes with torchrun's own launcher (the arguments of
    `fastpo.distributed.launch.torchrun_command`, run in this process) and return the job's exit status
    as one process gives it: rank 0's status when a process failed (2 bad input, 1, 130 after
    Ctrl-C, 143 after SIGTERM, 128 + N for a rank killed by signal N), 128 + the signal when this
    launcher got one. A Ctrl-C or SIGTERM reaches the workers (from the terminal, or forwarded by
    torchrun's agent, which waits for them to save and exit); the processes print their own
    lines, and torchrun's exception report (the SignalException or ChildFailedError traceback) is
    not printed over them."""
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torch: imported when the command runs, so `fastpo --help` loads none
    from fastpo.distributed.launch import torchrun_command

    cmd = torchrun_command(nproc, argv)
    targs = parse_args(cmd[3:])  # after `python -m torch.distributed.run`
    # the machine's cores shared out (torchrun would set 1 for each process, with a banner)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not os.environ.get("OMP_NUM_THREADS"):
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    # the agent's own warnings ("Received 2 death signal, shutting down workers") repeat what
    # rank 0 already said (its loggers set their own levels when imported)
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        run(targs)
    except ChildFailedError as e:
        ranks = sorted(e.failures)
        code = e.failures[0 if 0 in e.failures else ranks[0]].exitcode
        if 0 not in e.failures or code not in (2, 128 + signal.SIGINT, 128 + signal.SIGTERM):
            print(f"fastpo train: process{'es' if len(ranks) > 1 else ''} of rank {', '.join(map(str, ranks))} "
                  f"ended with status {', '.join(str(f.exitcode) for _, f in sorted(e.failures.items()))}",
                  file=sys.stderr)
        return 128 - code if code < 0 else code
    except SignalException as e:  # raised once the agent has forwarded the signal and the workers ended
        return 128 + int(e.sigval)
    except KeyboardInterrupt:  # a Ctrl-C before torchrun's agent took the signals over
        return 128 + signal.SIGINT
    return 0


def left_a_job() -> bool:
    """Whether this process joined a torchrun job's process group and has left it
    (fastpo.distributed.context not imported: it never joined one; the check imports no torch)."""
    context = sys.modules.get("fastpo.distributed.context")
    return context is not None and context.left_job()


def quiet_progress_bars() -> None:
    """No transformers / huggingface_hub progress bars (weights loading, shards written) in
    this process: a torchrun rank other than 0, whose bars would repeat rank 0's."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


def degrade_console() -> None:
    """Make stdout and stderr write what their encoding cannot hold as backslash escapes
    (`\\u221a` for a grid's `√`) instead of raising UnicodeEncodeError: a locale that is not
    UTF-8 (`LC_ALL=C` with PYTHONUTF8=0, a Windows code page) must not end a run at its first
    printed observation. Streams that cannot be reconfigured (a test's capture) are left as they are."""
    for stream in (sys.stdout, sys.stderr):
        enc = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        if enc != "utf8" and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass


class CtrlC(KeyboardInterrupt):
    """A Ctrl-C the `fastpo` command received (its SIGINT handler, `catch_ctrl_c`, raises it
    where no run loop handles the signal: set-up, evaluation). A subclass, so that a plain
    KeyboardInterrupt raised by a user's game or reward function is told from a real Ctrl-C
    (fastpo.envs.errors.user_code_failure)."""

    signum = 2  # signal.SIGINT


def catch_ctrl_c():
    """Install the command's SIGINT handler (raise CtrlC) in place of Python's default one;
    returns the function that puts the earlier handler back. Does nothing outside the main
    thread or under another program's own handler (an application embedding `main`)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return lambda: None

    def interrupt(signum, frame):
        raise CtrlC()

    signal.signal(signal.SIGINT, interrupt)
    return lambda: signal.signal(signal.SIGINT, signal.default_int_handler)
