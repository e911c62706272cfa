"""`fastpo sft`: supervised fine-tuning (fastpo.sft) into a run folder of its own."""
from __future__ import annotations

import os
import sys

from fastpo.cli.common import (build_config, check_out_dir, check_trust_flag, exit_status, resumed_run_config,
                               used_out_message)
from fastpo.config.fields import ConfigError
from fastpo.config.presets import default_preset
from fastpo.config.loading import default_run_folder
from fastpo.run.folder import RunFolderBusy, RunLock, fresh_run_folder, run_folder_in_use, unsaved_note, untrained_start


def cmd_sft(args) -> int:
    """`fastpo sft`: the exit status (`exit_status`: 0 done, 2 bad input in one line, 1 a checkpoint
    not saved, the game failing or a full disk, 130 / 143 after Ctrl-C / SIGTERM once the
    checkpoint is saved)."""
    from rich.console import Console

    # torch, numpy: imported when the command runs, so `fastpo --help` loads none
    from fastpo.envs import EnvError
    from fastpo.model_loading import check_kernel_impl, check_model_name, resolve_device
    from fastpo.report.metrics import warn_user
    from fastpo.run.checkpoint import plan_resume
    from fastpo.sft.config import imitation_preset, sft_default_overrides
    from fastpo.sft.data import check_chat_path, load_sft_data
    from fastpo.sft.experts import check_expert
    from fastpo.sft.trainer import SFTTrainer
    from fastpo.trainer import Stopped

    console = Console()
    sft_ov = [o for o in args.overrides if o.split("=", 1)[0].strip().startswith("sft.")]
    try:
        check_trust_flag(args)
        if args.resume is not None:
            cfg = resumed_run_config(args, fixed=sft_ov)  # the data settings are the run's
            RunLock(args.resume).check()
            if cfg.dagger is not None:
                raise ConfigError(f"--resume {args.resume} is a `fastpo dagger` run: continue it with `fastpo dagger "
                                  f"--resume {args.resume}`")
            if cfg.sft is None:
                raise ConfigError(f"--resume {args.resume}: not a `fastpo sft` run (its config.yaml has no sft "
                                  f"section); a StarPO run continues with `fastpo train --resume {args.resume}`")
            if untrained_start(args.resume):  # stopped before its first checkpoint: start it again
                console.print(f"{unsaved_note(args.resume)} (the run stopped before its first checkpoint): "
                              f"starting it again from step 1 with its config.yaml", markup=False, soft_wrap=True)
                args.resume, args.out = None, args.resume
            else:
                plan_resume(args.resume, trust=args.trust_checkpoint).check_run_config(args.resume)
        else:
            preset = imitation_preset("sft", args.env, args.preset, args.config)
            extra = sft_default_overrides([p.strip() for p in (preset or default_preset()).split(",")])
            if args.iterations is not None:
                extra.append(f"trainer.iterations={args.iterations}")
            cfg = build_config(args, extra, {"trainer.output_dir": args.out} if args.out else None, preset=preset,
                               sections=("sft",))
            if cfg.env.mixture:
                raise ConfigError(f"env.mixture {cfg.env.mixture!r:.100}: fastpo sft trains on one game (--env NAME); "
                                  "several games in one run are for fastpo train")
            if not args.out:
                cfg.trainer.output_dir = default_run_folder(cfg.env.name, "sft-")
                if run_folder_in_use(cfg.trainer.output_dir) and not args.overwrite:
                    cfg.trainer.output_dir = fresh_run_folder(cfg.trainer.output_dir)
            elif run_folder_in_use(args.out) and not args.overwrite:
                raise ConfigError(used_out_message(args.out, run_folder_in_use(args.out)))
        sft = cfg.sft
        if sft.data:
            sft.data = os.path.abspath(os.path.expanduser(sft.data))  # the run's, wherever it is resumed from
            check_chat_path(sft.data)
        else:
            check_expert(cfg.env.name)
        check_kernel_impl(cfg.trainer.kernel_impl, resolve_device(cfg.trainer.device))
        check_model_name(cfg.model.name)
        check_out_dir(cfg.trainer.output_dir, "--resume" if args.resume is not None else "--out")
    except (ConfigError, FileNotFoundError, RunFolderBusy) as e:
        print(f"fastpo sft: error: {e}", file=sys.stderr)
        return 2
    source = f"the conversations of {sft.data}" if sft.data else f"{sft.trajectories} expert trajectories"
    console.print(f"[bold]fastpo sft[/] env={cfg.env.name} preset={cfg.preset} {source}, {sft.batch_size} per step, "
                  f"{cfg.trainer.iterations} steps, lr {cfg.optim.actor_lr:g} -> {cfg.trainer.output_dir}")
    try:  # the data from the file, the tokenizer and the game alone: its problems found before the model loads
        data = load_sft_data(cfg)
    except (ConfigError, EnvError) as e:
        print(f"fastpo sft: error: {e}", file=sys.stderr)
        return 2
    for line in data.describe():
        console.print(line, soft_wrap=True)
    if data.warning():
        warn_user(data.warning(), console)

    def run() -> list:
        trainer = SFTTrainer(cfg, data=data, resume=args.resume is not None, console=console,
                             overwrite=args.overwrite, trust_checkpoint=args.trust_checkpoint)
        records = trainer.run()
        if trainer.stop_state.interrupted:
            raise Stopped(trainer.stop_state.signum)
        return records

    return exit_status(run, lambda text: print(f"fastpo sft: error: {text}", file=sys.stderr), "fastpo sft",
                       cfg.trainer.output_dir)
