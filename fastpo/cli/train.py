"""`fastpo train`: a new run or a resume, in this process or as one rank of a torchrun job."""
from __future__ import annotations

import os
import sys

from fastpo.cli.common import (build_config, check_out_dir, check_trust_flag, exit_status, resumed_run_config,
                               used_out_message)
from fastpo.cli.processes import quiet_progress_bars
from fastpo.config.fields import ConfigError
from fastpo.config.members import env_members, member_rollout_config
from fastpo.run.folder import RunFolderBusy, RunLock, fresh_run_folder, run_folder_in_use, unsaved_note, untrained_start


def _resume_config(args, world: int, torchrun: bool, console, main_rank: bool):
    """The configuration of `--resume OUT` (`resumed_run_config`); None when there is nothing
    left to train (said on `console`). OUT without a checkpoint, where nothing was trained
    (`untrained_start`: a run stopped or failed before its first checkpoint), starts again from
    iteration 1 with OUT's config.yaml: `args.resume` becomes None and `args.out` OUT. Raises
    ConfigError for an option that cannot change mid-run or the data-parallel trainer does not
    support, RunFolderBusy when another process holds OUT."""
    # torch: imported when the command runs, so `fastpo --help` loads none
    from fastpo.distributed.launch import check_trainer_support
    from fastpo.run.checkpoint import nothing_to_train_note, plan_resume, tidy_run_folder
    from fastpo.report.metrics import warn_user

    cfg = resumed_run_config(args)
    if cfg.dagger is not None:  # (a run made before config.yaml held the section: from its dagger.yaml)
        raise ConfigError(f"--resume {args.resume} is a `fastpo dagger` run: continue it with `fastpo dagger --resume "
                          f"{args.resume}`; StarPO from its last round's model is `fastpo train --env {cfg.env.name} "
                          f"--model {os.path.join(args.resume, 'round-N')}`")
    if cfg.sft is not None:
        raise ConfigError(f"--resume {args.resume} is a `fastpo sft` run: continue it with `fastpo sft --resume "
                          f"{args.resume}`, or start StarPO from its model with `fastpo train --env {cfg.env.name} "
                          f"--model {args.resume}`")
    check_trainer_support(cfg, world, torchrun=torchrun)
    RunLock(args.resume).check()
    if untrained_start(args.resume):  # stopped or failed before its first checkpoint
        console.print(f"{unsaved_note(args.resume)} (the run stopped before its first checkpoint): starting it "
                      f"again from iteration 1 with its config.yaml", markup=False, soft_wrap=True)
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
    # torch: imported when the command runs, so `fastpo --help` loads none
    from fastpo.distributed.launch import check_trainer_support

    if args.out is not None and not args.out.strip():
        raise ConfigError("--out needs a folder name")
    extra = []
    if args.iterations is not None:
        extra.append(f"trainer.iterations={args.iterations}")
    cfg = build_config(args, extra, {"trainer.output_dir": args.out} if args.out is not None else None)
    check_trainer_support(cfg, world, torchrun=torchrun)
    if args.out is not None:
        RunLock(args.out).check()
    used = run_folder_in_use(cfg.trainer.output_dir)
    if used and args.out and not args.overwrite:
        raise ConfigError(used_out_message(args.out, used))
    if used and not args.out and not args.overwrite:
        fresh = fresh_run_folder(cfg.trainer.output_dir)
        console.print(f"[yellow]{cfg.trainer.output_dir} already holds a run; writing this one to {fresh}[/]")
        cfg.trainer.output_dir = fresh
    return cfg


def cmd_train(args) -> int:
    from rich.console import Console

    # torch: imported when the command runs, so `fastpo --help` loads none
    from fastpo.distributed.collectives import on_main
    from fastpo.distributed.context import DistributedError, SINGLE, init_from_env, shutdown, torchrun_env

    where = torchrun_env()
    world = where[1] if where is not None else 1
    main_rank = where is None or where[0] == 0
    console = Console(quiet=not main_rank)  # rank 0 speaks for a data-parallel job
    if not main_rank:
        quiet_progress_bars()
    try:
        check_trust_flag(args)
        if args.resume is not None:
            cfg = _resume_config(args, world, where is not None, console, main_rank)
            if cfg is None:
                return 0
        else:
            cfg = _new_run_config(args, world, where is not None, console)
        # torch: imported when the command runs, so `fastpo --help` loads none
        from fastpo.model_loading import check_kernel_impl, check_model_name, resolve_device

        check_kernel_impl(cfg.trainer.kernel_impl, resolve_device(cfg.trainer.device))
        check_model_name(cfg.model.name)  # a name that names no model: said before the run's banner
        if cfg.reward.judge_model is not None:
            check_model_name(cfg.reward.judge_model, key="reward.judge_model")
        check_out_dir(cfg.trainer.output_dir, "--resume" if args.resume is not None else "--out")
        ctx = SINGLE
        if where is not None:  # join the job (even of one process: the data-parallel path); rank 0's
            # choice of run folder is everyone's
            ctx = init_from_env(cfg.trainer.device)
            cfg.trainer.output_dir = on_main(ctx, lambda: cfg.trainer.output_dir)
    except (ConfigError, FileNotFoundError, RunFolderBusy, DistributedError) as e:
        if main_rank:
            print(f"fastpo train: error: {e}", file=sys.stderr)
        return 2
    try:
        return _train_in_process(args, cfg, ctx, console)
    finally:
        shutdown(ctx)


def _train_in_process(args, cfg, ctx, console) -> int:
    """Run the trainer in this process (one of `ctx.world_size`); the exit status."""
    # torch, numpy: imported when the command runs, so `fastpo --help` loads none
    from fastpo.envs.mixture import shares
    from fastpo.trainer import train

    def error(text: str) -> None:  # every rank meets the same error; rank 0 says it
        if ctx.is_main:
            print(f"fastpo train: error: {text}", file=sys.stderr)

    turns = f"{cfg.rollout.max_turns} turn{'s' if cfg.rollout.max_turns != 1 else ''}"
    if cfg.env.mixture:  # each game its share and its own turns
        games = env_members(cfg)
        limits = [member_rollout_config(cfg, m).max_turns for m in games]
        turns = "games " + ", ".join(f"{m.label} ({w:.0%}, {t} turn{'s' if t != 1 else ''})"
                                     for m, w, t in zip(games, shares(games), limits))
    console.print(f"[bold]fastpo train[/] env={cfg.env.name} preset={cfg.preset} "
                  f"algorithm={'PPO (GAE, critic ' + cfg.algorithm.critic + ')' if cfg.algorithm.adv_estimator == 'gae' else cfg.algorithm.adv_estimator.upper()} "
                  f"filter={cfg.algorithm.filter_mode}:{cfg.algorithm.filter_ratio}"
                  f"{'' if cfg.algorithm.filter_strategy == 'top_k' else ':' + cfg.algorithm.filter_strategy} "
                  f"{cfg.rollout.env_groups}x{cfg.rollout.group_size} trajectories, {turns}, "
                  f"{cfg.trainer.iterations} iteration{'s' if cfg.trainer.iterations != 1 else ''} -> {cfg.trainer.output_dir}")
    return exit_status(lambda: train(cfg, resume=args.resume is not None, console=console, overwrite=args.overwrite,
                                     dist=ctx, trust_checkpoint=args.trust_checkpoint),
                       error, "fastpo train", cfg.trainer.output_dir)
