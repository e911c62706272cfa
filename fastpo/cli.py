"""The `fastpo` command line: `fastpo train`, `fastpo sft` (on fastpo.sft) and `fastpo eval`.

    fastpo train --env frozenlake [--preset cpu|paper|...] [--config FILE] [--model NAME]
                 [--out DIR [--overwrite]] [--resume DIR [--iterations N] [--trust-checkpoint]] [--nproc N]
                 [section.key=value ...]
    fastpo eval  --env frozenlake --model PATH_OR_NAME [--seeds N] [--k K] [--temperature T] [--nproc N]

The configuration (defaults, presets, file, dotted overrides) is validated before any model
loads; a bad key or value exits with status 2 and a message naming it. Other bad input (an
unreadable config file, an unknown model, a bad device or output folder) also exits 2 with one
line; a traceback means a bug.

A new run never destroys an old one: without --out, a folder that already holds a run is
replaced by the first free `runs/<env>-2`, `-3`, ...; a named --out holding a run is refused
unless --overwrite, and so is a folder another fastpo process is writing (naming its pid).
On --resume only --iterations, --device and non-env/model overrides apply; its checkpoint
files load as plain data, and one that needs full unpickling (an older fastpo's) is refused
unless --trust-checkpoint (fastpo.checkpoint, "Trust").

`python -m fastpo` is the same command. `--nproc N` runs it in N processes under torchrun
(`python -m torch.distributed.run --standalone --nproc_per_node N -m fastpo train ...`), data
parallel (fastpo.distributed; docs/distributed.md); --nproc 1 (the default) is the
one-process path. `fastpo eval --nproc N` (or under torchrun) shares the eval seeds out over
the processes; rank 0 prints and writes the results. Under torchrun (even with one process, a smoke test of that path) each
process builds the configuration, joins the process group (gloo on the CPU, NCCL on CUDA) and trains its share; rank 0 chooses the run folder and
is the only one that writes it. A setting the data-parallel trainer does not support yet is
refused with exit status 2 before any model loads (fastpo.distributed.check_trainer_support).

Exit status: 0 done, 2 bad input (one line), 1 a checkpoint that could not be saved or a
full disk (one line), 130 after Ctrl-C and 143 after SIGTERM (both once the checkpoint is saved).
Under `--nproc N` the job exits as one process would (rank 0's status, 130 / 143 after a
signal once rank 0 has saved the checkpoint), without torchrun's exception report; torchrun
run directly keeps its own statuses (1 when a process failed or after a signal).
"""
from __future__ import annotations

import argparse
import copy
import errno
import os
import sys


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default=None, metavar="NAME",
                   help="environment: bandit, sokoban, frozenlake, module.path:Class, textarena:ID, gym:ID or an "
                        "installed fastpo.envs entry point (default: frozenlake, or the config file's)")
    p.add_argument("--preset", default=None,
                   help="named preset(s), comma-separated: paper, cpu, starpo, grpo, tiny "
                        "(default: paper with a GPU, cpu without)")
    p.add_argument("--config", default=None, help="YAML config file")
    p.add_argument("--model", default=None, help="smollm2-135m-instruct (embedded), an HF id or folder, random:<shape>")
    p.add_argument("--device", default=None, help="auto, cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="dotted overrides, e.g. algorithm.adv_estimator=grpo rollout.group_size=8")


def check_trust_flag(args) -> None:
    """--trust-checkpoint without --resume: ConfigError (it would silently do nothing; a new
    run, `--model RUN` included, reads no pickled file)."""
    from fastpo.config import ConfigError

    if getattr(args, "trust_checkpoint", False) and args.resume is None:
        raise ConfigError("--trust-checkpoint applies to --resume DIR only (a new run reads no pickled file)")


def _add_trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="with --resume: load checkpoint files that need full unpickling (an older fastpo's "
                        "state.pt), which can run any code they hold; only for run folders you trust")


def build_config(args, extra: list[str], values: dict | None = None):
    from fastpo.config import load_config

    ov = list(extra)
    values = dict(values or {})
    if args.model is not None:
        values["model.name"] = args.model  # a path or name, taken literally (not YAML)
    if args.device:
        ov.append(f"trainer.device={args.device}")
    if args.seed is not None:
        ov.append(f"trainer.seed={args.seed}")
    ov += args.overrides
    return load_config(env=args.env, preset=args.preset, file=args.config, overrides=ov, values=values)


def check_out_dir(path: str, flag: str = "--out") -> None:
    """Refuse an output folder that cannot be created or written, before any model loads
    (ConfigError naming `flag` and the folder). On `--resume` the run folder itself and the
    files a resume rewrites (metrics.jsonl, config.yaml) must be writable."""
    from fastpo.config import ConfigError

    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ConfigError(f"{flag} {path}: exists and is not a folder")
    parent = p
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: {parent} is not a folder")
    if flag == "--resume":
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"--resume {path}: the run folder is not writable (a resumed run writes its "
                              f"checkpoints and metrics there); make it writable, or copy the run elsewhere "
                              f"and resume the copy")
        stuck = [n for n in ("metrics.jsonl", "config.yaml")
                 if os.path.exists(os.path.join(p, n)) and not os.access(os.path.join(p, n), os.W_OK)]
        if stuck:
            raise ConfigError(f"--resume {path}: {', '.join(stuck)} {'is' if len(stuck) == 1 else 'are'} not "
                              f"writable (a resumed run rewrites {'it' if len(stuck) == 1 else 'them'})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {parent} is not writable")


def _resume_fixed(cfg) -> dict:
    """The settings a resumed run keeps from its config.yaml, by dotted name."""
    return {"env": copy.deepcopy(cfg.env), "model": copy.deepcopy(cfg.model), "preset": cfg.preset,
            "trainer.seed": cfg.trainer.seed, "trainer.output_dir": cfg.trainer.output_dir}


def resumed_run_config(args, fixed: list[str] = ()):
    """The run config of `--resume OUT` (for `fastpo train` and `fastpo sft`): OUT's
    config.yaml with the overrides, --iterations and --device a resume may change, validated.
    Raises ConfigError naming what cannot change mid-run (an option, or a dotted override in
    any spelling that moves the env, model, preset, seed or output folder); `fixed` lists
    further options the caller refuses."""
    from fastpo.config import ConfigError, apply_dict, load_run_config, parse_override, validate

    if not args.resume.strip():
        raise ConfigError("--resume needs the run folder, e.g. --resume runs/frozenlake")
    fixed = [flag for flag, v in (("--config", args.config), ("--preset", args.preset), ("--env", args.env),
                                  ("--model", args.model), ("--out", args.out), ("--seed", args.seed),
                                  ("--overwrite", args.overwrite or None)) if v is not None] + list(fixed)
    # and their dotted spellings (trainer.seed, trainer.output_dir, preset)
    fixed += [o for o in args.overrides if o.split("=", 1)[0].strip().startswith(("env.", "model."))
              or o.split("=", 1)[0].strip() in ("env", "model", "preset", "trainer.seed", "trainer.output_dir")]
    if fixed:
        raise ConfigError(f"{', '.join(fixed)} cannot change on --resume (the run keeps the "
                          f"configuration in {os.path.join(args.resume, 'config.yaml')}); start a new "
                          f"run instead")
    cfg = load_run_config(args.resume)
    kept = _resume_fixed(cfg)
    for o in args.overrides:
        apply_dict(cfg, parse_override(o))
    # whatever the spelling (e.g. a mapping `trainer={seed: 3}`), the values must not move
    moved = [k for k, v in _resume_fixed(cfg).items() if v != kept[k]]
    if moved:
        raise ConfigError(f"{', '.join(moved)} cannot change on --resume (the run keeps the configuration "
                          f"in {os.path.join(args.resume, 'config.yaml')}); start a new run instead")
    if args.iterations is not None:
        cfg.trainer.iterations = args.iterations
    if args.device is not None:
        cfg.trainer.device = args.device
    cfg.trainer.output_dir = args.resume
    return validate(cfg)


def _resume_config(args, world: int, torchrun: bool, console, main_rank: bool):
    """The configuration of `--resume OUT` (`resumed_run_config`); None when there is nothing
    left to train (said on `console`). OUT without a checkpoint, where nothing was trained
    (`untrained_start`: a run stopped or failed before its first checkpoint), starts again from
    iteration 1 with OUT's config.yaml: `args.resume` becomes None and `args.out` OUT. Raises
    ConfigError for an option that cannot change mid-run or the data-parallel trainer does not
    support, RunFolderBusy when another process holds OUT."""
    from fastpo import distributed as fdist
    from fastpo.checkpoint import RunLock, nothing_to_train_note, plan_resume, tidy_run_folder, untrained_start
    from fastpo.config import ConfigError
    from fastpo.metrics import warn_user
    from fastpo.run_folder import SFT_FILE

    cfg = resumed_run_config(args)
    if os.path.isfile(os.path.join(args.resume, SFT_FILE)):
        raise ConfigError(f"--resume {args.resume} is a `fastpo sft` run: continue it with `fastpo sft --resume "
                          f"{args.resume}`, or start StarPO from its model with `fastpo train --env {cfg.env.name} "
                          f"--model {args.resume}`")
    fdist.check_trainer_support(cfg, world, torchrun=torchrun)
    RunLock(args.resume).check()
    if untrained_start(args.resume):  # stopped or failed before its first checkpoint
        console.print(f"{args.resume} holds no checkpoint (the run stopped before its first one; nothing was "
                      f"trained): starting it again from iteration 1 with its config.yaml", markup=False,
                      soft_wrap=True)
        args.resume, args.out = None, args.resume  # a new run into the same folder (it is reused)
        return cfg
    plan = plan_resume(args.resume, trust=args.trust_checkpoint)
    plan.check_run_config(args.resume)
    if plan.nothing_to_do(cfg.trainer.iterations):  # say so without loading the model
        for note in (plan.note, plan.trust_note):
            if note:
                warn_user(note, console)
        if main_rank:
            with RunLock(args.resume):
                tidy_run_folder(args.resume)
        console.print(nothing_to_train_note(args.resume, plan.iteration, cfg.trainer.iterations),
                      style="yellow")
        return None
    return cfg


def _new_run_config(args, world: int, torchrun: bool, console):
    """The configuration of a new run, with its run folder chosen: `--out` as given (refused
    when it holds a run, unless --overwrite), else the default folder or the first free
    `<default>-N` after it. Raises ConfigError, RunFolderBusy."""
    from fastpo import distributed as fdist
    from fastpo.checkpoint import RunLock, fresh_run_folder, run_folder_in_use
    from fastpo.config import ConfigError

    if args.out is not None and not args.out.strip():
        raise ConfigError("--out needs a folder name")
    extra = []
    if args.iterations is not None:
        extra.append(f"trainer.iterations={args.iterations}")
    cfg = build_config(args, extra, {"trainer.output_dir": args.out} if args.out is not None else None)
    fdist.check_trainer_support(cfg, world, torchrun=torchrun)
    if args.out is not None:
        RunLock(args.out).check()
    used = run_folder_in_use(cfg.trainer.output_dir)
    if used and args.out and not args.overwrite:
        raise ConfigError(f"--out {args.out} already holds a run ({', '.join(used)}); resume it with "
                          f"--resume {args.out}, pick another --out, or pass --overwrite to delete it")
    if used and not args.out and not args.overwrite:
        fresh = fresh_run_folder(cfg.trainer.output_dir)
        console.print(f"[yellow]{cfg.trainer.output_dir} already holds a run; writing this one to {fresh}[/]")
        cfg.trainer.output_dir = fresh
    return cfg


def cmd_train(args) -> int:
    from rich.console import Console

    from fastpo.checkpoint import RunFolderBusy
    from fastpo import distributed as fdist
    from fastpo.config import ConfigError

    where = fdist.torchrun_env()
    world = where[1] if where is not None else 1
    main_rank = where is None or where[0] == 0
    console = Console(quiet=not main_rank)  # rank 0 speaks for a data-parallel job
    if not main_rank:
        _quiet_progress_bars()
    try:
        check_trust_flag(args)
        if args.resume is not None:
            cfg = _resume_config(args, world, where is not None, console, main_rank)
            if cfg is None:
                return 0
        else:
            cfg = _new_run_config(args, world, where is not None, console)
        from fastpo.models import check_kernel_impl, check_model_name, resolve_device

        check_kernel_impl(cfg.trainer.kernel_impl, resolve_device(cfg.trainer.device))
        check_model_name(cfg.model.name)  # a name that names no model: said before the run's banner
        check_out_dir(cfg.trainer.output_dir, "--resume" if args.resume is not None else "--out")
        ctx = fdist.SINGLE
        if where is not None:  # join the job (even of one process: the data-parallel path); rank 0's
            # choice of run folder is everyone's
            ctx = fdist.init_from_env(cfg.trainer.device)
            cfg.trainer.output_dir = fdist.on_main(ctx, lambda: cfg.trainer.output_dir)
    except (ConfigError, FileNotFoundError, RunFolderBusy, fdist.DistributedError) as e:
        if main_rank:
            print(f"fastpo train: error: {e}", file=sys.stderr)
        return 2
    try:
        return _train_in_process(args, cfg, ctx, console)
    finally:
        fdist.shutdown(ctx)


def _train_in_process(args, cfg, ctx, console) -> int:
    """Run the trainer in this process (one of `ctx.world_size`); the exit status."""
    from fastpo.checkpoint import CheckpointSaveError, RunFolderBusy
    from fastpo.config import ConfigError
    from fastpo.envs import EnvError
    from fastpo.trainer import train

    def error(text: str) -> None:  # every rank meets the same error; rank 0 says it
        if ctx.is_main:
            print(f"fastpo train: error: {text}", file=sys.stderr)

    console.print(f"[bold]fastpo train[/] env={cfg.env.name} preset={cfg.preset} "
                  f"algorithm={'PPO (GAE, critic ' + cfg.algorithm.critic + ')' if cfg.algorithm.adv_estimator == 'gae' else cfg.algorithm.adv_estimator.upper()} "
                  f"filter={cfg.algorithm.filter_mode}:{cfg.algorithm.filter_ratio}"
                  f"{'' if cfg.algorithm.filter_strategy == 'top_k' else ':' + cfg.algorithm.filter_strategy} "
                  f"{cfg.rollout.env_groups}x{cfg.rollout.group_size} trajectories, {cfg.rollout.max_turns} turn{'s' if cfg.rollout.max_turns != 1 else ''}, "
                  f"{cfg.trainer.iterations} iteration{'s' if cfg.trainer.iterations != 1 else ''} -> {cfg.trainer.output_dir}")
    try:
        train(cfg, resume=args.resume is not None, console=console, overwrite=args.overwrite, dist=ctx,
              trust_checkpoint=args.trust_checkpoint)
    except KeyboardInterrupt as e:  # stopped by a signal; the checkpoint is saved
        return 128 + getattr(e, "signum", 2)
    except (ConfigError, RunFolderBusy, FileExistsError) as e:  # bad input found late; not a bug
        error(str(e))
        return 2
    except CheckpointSaveError as e:
        error(str(e))
        return 1
    except EnvError as e:  # the user's game raised (names the env and the instance's seed) or broke its contract
        kept = os.path.isdir(cfg.trainer.output_dir) and any(
            os.path.exists(os.path.join(cfg.trainer.output_dir, n)) for n in ("metrics.jsonl", "checkpoints"))
        error(f"{e} (the run stopped; " + ("its last checkpoint and metrics are kept)" if kept else
                                           "nothing had been trained or written yet)"))
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        error(f"{e.strerror} writing {e.filename or 'the run folder'}; free some space, then "
              f"`fastpo train --resume {cfg.trainer.output_dir}`")
        return 1
    return 0


def cmd_eval(args) -> int:
    """`fastpo eval`. A fastpo checkpoint (`runs/x`, `runs/x/checkpoints/iter_N` or its `model/`)
    is evaluated with the env and rollout settings its run trained with, except what the
    command line sets (fastpo.evaluate.eval_config); one line says whose settings are used.
    `--json PATH` writes the metrics, model label and settings as JSON."""
    from rich.console import Console
    from rich.table import Table

    from fastpo import distributed as fdist
    from fastpo.config import ConfigError

    where = fdist.torchrun_env()  # under torchrun each process evaluates its share of the seeds
    main_rank = where is None or where[0] == 0
    console = Console(quiet=not main_rank)  # rank 0 speaks for the job
    if not main_rank:
        _quiet_progress_bars()
    ov = []
    if args.seeds is not None:
        ov.append(f"trainer.eval_seeds={args.seeds}")
    if args.k is not None:
        ov.append(f"trainer.eval_group_size={args.k}")
    if args.temperature is not None:
        ov.append(f"trainer.eval_temperature={args.temperature}")
    if args.device:
        ov.append(f"trainer.device={args.device}")
    if args.seed is not None:
        ov.append(f"trainer.seed={args.seed}")
    ov += args.overrides
    try:
        from fastpo.evaluate import eval_config, eval_report, run_eval, write_json

        # a fastpo checkpoint brings the env and rollout settings it was trained with
        cfg, run = eval_config(env=args.env, preset=args.preset, file=args.config, overrides=ov,
                               values={"model.name": args.model} if args.model is not None else None,
                               warn=lambda text: console.print(f"warning: {text}", style="yellow", markup=False,
                                                              soft_wrap=True))
        from fastpo.models import check_model_name, resolve_device

        resolve_device(cfg.trainer.device)
        check_model_name(cfg.model.name)
        if args.samples is not None:
            check_out_dir(args.samples, "--samples")
        if args.json is not None:
            if not args.json.strip() or os.path.isdir(args.json):
                raise ConfigError(f"--json {args.json!r}: needs a file path, e.g. --json eval.json")
            check_out_dir(os.path.dirname(os.path.abspath(args.json)), "--json")
        if run is not None:
            console.print(run.describe(), markup=False)
            if run.mismatch_note():
                console.print(run.mismatch_note(), style="yellow", markup=False)
        ctx = fdist.init_from_env(cfg.trainer.device) if where is not None else fdist.SINGLE
        try:
            res = run_eval(cfg, console=console, samples_dir=args.samples, dist=ctx)
        finally:
            fdist.shutdown(ctx)
    except (ConfigError, FileNotFoundError, fdist.DistributedError) as e:
        if main_rank:
            print(f"fastpo eval: error: {e}", file=sys.stderr)
        return 2
    if not main_rank:
        return 0
    console.print(f"model: {res['model']}", markup=False)
    table = Table(title=f"fastpo eval: {cfg.env.name}")
    table.add_column("metric")
    table.add_column("value")
    for k in sorted(res):
        if k.startswith("eval/"):
            table.add_row(k[5:], f"{res[k]:.4g}")
    for k in ("eval/optimal_success", "eval/random_success"):
        if k not in res:  # the env gives no such reference line
            table.add_row(k[5:], "not known")
    console.print(table)
    if args.json is not None:
        console.print(f"results: {write_json(args.json, eval_report(cfg, res, run))}", markup=False)
    return 0


def _check_processes(args, argv: list[str]) -> int | None:
    """`--nproc` and torchrun: None to go on in this process, else the exit status (2 for bad
    input). --nproc N > 1 runs torchrun's launcher in this process (`_launch_processes`) and
    gives the job's exit status."""
    from fastpo import distributed as fdist
    from fastpo.config import ConfigError

    nproc = getattr(args, "nproc", None)
    try:
        if nproc is not None:
            fdist.check_nproc(nproc, args.device)
        fdist.torchrun_env()  # bad torchrun variables: one line
        if (nproc or 1) > 1:  # what the N processes would each refuse, said once before torchrun starts them
            name = args.model
            if args.command == "train":
                if args.resume is None:
                    cfg = build_config(args, [])
                    fdist.check_trainer_support(cfg, args.nproc)
                else:
                    cfg = resumed_run_config(args)  # a folder that is no run, a setting a resume cannot change
                name = cfg.model.name
            if name is not None:  # (fastpo.models imported only once the settings are valid)
                from fastpo.models import check_model_name

                check_model_name(name)
    except (fdist.DistributedError, ConfigError, FileNotFoundError) as e:
        print(f"fastpo {args.command}: error: {e}", file=sys.stderr)
        return 2
    if (nproc or 1) > 1:  # torchrun runs N of this command
        return _launch_processes(nproc, fdist.strip_nproc(argv))
    return None


def _launch_processes(nproc: int, argv: list[str]) -> int:
    """Run `fastpo <argv>` in `nproc` processes with torchrun's own launcher (the arguments of
    `fastpo.distributed.torchrun_command`, run in this process) and return the job's exit status
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

    from fastpo import distributed as fdist

    cmd = fdist.torchrun_command(nproc, argv)
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


def _quiet_progress_bars() -> None:
    """No transformers / huggingface_hub progress bars (weights loading, shards written) in
    this process: a torchrun rank other than 0, whose bars would repeat rank 0's."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


def _degrade_console() -> None:
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


def main(argv: list[str] | None = None) -> int:
    """Run the `fastpo` command line `argv` (default: sys.argv[1:]); the exit status (2: bad
    input). `entry` is the command itself (exit, and the end of a torchrun rank)."""
    _degrade_console()
    ap = argparse.ArgumentParser(prog="fastpo", description="Multi-turn RL for LLM agents (StarPO / StarPO-S)")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train with StarPO / StarPO-S")
    _add_common(tr)
    tr.add_argument("--out", default=None, help="output folder (default runs/<env>)")
    tr.add_argument("--overwrite", action="store_true",
                    help="delete the run already in --out (without it such a folder is refused)")
    tr.add_argument("--iterations", type=int, default=None)
    tr.add_argument("--resume", default=None, metavar="OUT", help="continue the run in folder OUT from its latest checkpoint")
    _add_trust(tr)
    tr.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="data-parallel processes, one per GPU (CPU processes with gloo under --device cpu), "
                         "run by torchrun; 1 (default): one process")
    sf = sub.add_parser("sft", help="supervised fine-tuning on the env's expert trajectories (fastpo.sft)")
    _add_common(sf)
    sf.add_argument("--out", default=None, help="output folder (default runs/sft-<env>)")
    sf.add_argument("--overwrite", action="store_true", help="delete the run already in --out")
    sf.add_argument("--iterations", type=int, default=None, help="SFT steps (optimizer steps)")
    sf.add_argument("--resume", default=None, metavar="OUT", help="continue the SFT run in folder OUT")
    _add_trust(sf)
    ev = sub.add_parser("eval", help="evaluate a model: success rate and pass@k on fixed seeds")
    _add_common(ev)
    ev.add_argument("--seeds", type=int, default=None, help="number of fixed eval seeds")
    ev.add_argument("--k", type=int, default=None, help="samples per seed (pass@k)")
    ev.add_argument("--temperature", type=float, default=None)
    ev.add_argument("--samples", default=None, help="folder to write sample trajectories to")
    ev.add_argument("--json", default=None, metavar="PATH",
                    help="write the metrics, the model's label and the settings used to PATH as JSON")
    ev.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="processes sharing out the seeds, one per GPU (CPU processes with gloo under --device cpu), "
                         "run by torchrun; 1 (default): one process")
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = ap.parse_known_args(argv)
    # Hydra-style overrides may stand anywhere (`--env bandit a.b=1 --out X c.d=2`): the
    # positional list takes only those before the first option, argparse leaves the rest
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides += extra
    status = _check_processes(args, argv)
    if status is not None:
        return status
    if args.command == "train":
        return cmd_train(args)
    if args.command == "sft":
        return cmd_sft(args)
    return cmd_eval(args)


def entry(argv: list[str] | None = None) -> None:
    """The `fastpo` command (console script, `python -m fastpo`, what torchrun runs in each
    process): `main(argv)`, then exit with its status. Under torchrun `main` is wrapped in
    torch.distributed.elastic's `record` (a failing rank's exception reaches torchrun's error
    summary), and a rank that has left its job's process group ends with
    `fastpo.distributed.end_process` instead of the interpreter's teardown: with `main`'s
    status, or 1 (130 for Ctrl-C) after an exception, whose traceback is printed first."""
    run = main
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        from torch.distributed.elastic.multiprocessing.errors import record

        run = record(main)
    try:
        status = run(argv)
    except BaseException as e:
        if isinstance(e, SystemExit) or not _left_a_job():
            raise
        import traceback

        traceback.print_exc()
        status = 130 if isinstance(e, KeyboardInterrupt) else 1
    if _left_a_job():
        from fastpo.distributed import end_process

        end_process(status)
    sys.exit(status)


def _left_a_job() -> bool:
    """Whether this process joined a torchrun job's process group and has left it
    (fastpo.distributed not imported: it never joined one; the check imports no torch)."""
    fdist = sys.modules.get("fastpo.distributed")
    return fdist is not None and fdist.left_job()


if __name__ == "__main__":
    entry()


def cmd_sft(args) -> int:
    """`fastpo sft`: exit status 0 done, 2 bad input (one line), 1 a checkpoint not saved or a
    full disk, 130 / 143 after Ctrl-C / SIGTERM (once the checkpoint is saved)."""
    from fastpo.checkpoint import (CheckpointSaveError, RunFolderBusy, RunLock, fresh_run_folder, plan_resume,
                                   run_folder_in_use, untrained_start)
    from fastpo.config import ConfigError, default_run_folder
    from fastpo.run_folder import SFT_FILE
    from fastpo.sft import (SFT_CPU_GAME_DEFAULTS, SFT_DEFAULT_OVERRIDES, SFTTrainer, check_disjoint, check_expert,
                            read_sft_config, sft_config)
    from fastpo.envs import EnvError
    from fastpo.trainer import Stopped

    from rich.console import Console

    console = Console()
    sft_ov = [o for o in args.overrides if o.split("=", 1)[0].strip().startswith("sft.")]
    args.overrides = [o for o in args.overrides if o not in sft_ov]
    try:
        check_trust_flag(args)
        if args.resume is not None:
            cfg = resumed_run_config(args, fixed=sft_ov)
            RunLock(args.resume).check()
            untrained = untrained_start(args.resume)
            if untrained and not os.path.isfile(os.path.join(args.resume, SFT_FILE)):
                raise ConfigError(f"--resume {args.resume}: the run stopped before its first checkpoint and before "
                                  f"writing {SFT_FILE} (nothing was trained); run the same `fastpo sft` command "
                                  f"again: it reuses the folder")
            sft = read_sft_config(args.resume)
            if untrained:  # stopped before its first checkpoint: start it again
                console.print(f"{args.resume} holds no checkpoint (the run stopped before its first one; nothing "
                              f"was trained): starting it again from step 1 with its config.yaml", markup=False,
                              soft_wrap=True)
                args.resume, args.out = None, args.resume
            else:
                plan_resume(args.resume, trust=args.trust_checkpoint).check_run_config(args.resume)
        else:
            from fastpo.presets import default_preset

            extra = list(SFT_DEFAULT_OVERRIDES)
            game, game_sft = SFT_CPU_GAME_DEFAULTS.get(args.env, ([], [])) if \
                (args.preset or default_preset()) == "cpu" and args.config is None else ([], [])
            extra += game
            if args.iterations is not None:
                extra.append(f"trainer.iterations={args.iterations}")
            cfg = build_config(args, extra, {"trainer.output_dir": args.out} if args.out else None)
            sft = sft_config(game_sft + sft_ov)
            if not args.out:
                cfg.trainer.output_dir = default_run_folder(cfg.env.name, "sft-")
                if run_folder_in_use(cfg.trainer.output_dir) and not args.overwrite:
                    cfg.trainer.output_dir = fresh_run_folder(cfg.trainer.output_dir)
            elif run_folder_in_use(args.out) and not args.overwrite:
                raise ConfigError(f"--out {args.out} already holds a run; resume it with --resume {args.out}, "
                                  f"pick another --out, or pass --overwrite to delete it")
        if sft.data:
            sft.data = os.path.abspath(os.path.expanduser(sft.data))  # the run's, wherever it is resumed from
            if not os.path.isfile(sft.data):
                raise ConfigError(f"config key 'sft.data' = {sft.data!r}: no such file")
        else:
            check_disjoint(sft, cfg)
            check_expert(cfg.env.name)
        from fastpo.models import check_kernel_impl, resolve_device

        check_kernel_impl(cfg.trainer.kernel_impl, resolve_device(cfg.trainer.device))
        check_out_dir(cfg.trainer.output_dir, "--resume" if args.resume is not None else "--out")
    except (ConfigError, FileNotFoundError, RunFolderBusy) as e:
        print(f"fastpo sft: error: {e}", file=sys.stderr)
        return 2
    source = f"the conversations of {sft.data}" if sft.data else f"{sft.trajectories} expert trajectories"
    console.print(f"[bold]fastpo sft[/] env={cfg.env.name} preset={cfg.preset} {source}, {sft.batch_size} per step, {cfg.trainer.iterations} steps, lr {cfg.optim.actor_lr:g} "
                  f"-> {cfg.trainer.output_dir}")
    try:
        trainer = SFTTrainer(cfg, sft, resume=args.resume is not None, console=console, overwrite=args.overwrite,
                             trust_checkpoint=args.trust_checkpoint)
        trainer.run()
        if trainer.stop_state.interrupted:
            raise Stopped(trainer.stop_state.signum)
    except KeyboardInterrupt as e:
        return 128 + getattr(e, "signum", 2)
    except (ConfigError, RunFolderBusy, FileExistsError) as e:
        print(f"fastpo sft: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointSaveError, EnvError) as e:  # (EnvError: the user's game or its expert failed)
        print(f"fastpo sft: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"fastpo sft: error: {e.strerror} writing {e.filename or 'the run folder'}; free some space, then "
              f"`fastpo sft --resume {cfg.trainer.output_dir}`", file=sys.stderr)
        return 1
    return 0
