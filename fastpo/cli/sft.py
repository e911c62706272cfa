"""`fastpo sft`: supervised fine-tuning (fastpo.sft) into a run folder of its own."""
from __future__ import annotations

import os
import sys

from fastpo.cli.common import (build_config, check_out_dir, check_trust_flag, exit_status, resumed_run_config,
                               used_out_message)


def cmd_sft(args) -> int:
    """`fastpo sft`: the exit status (`exit_status`: 0 done, 2 bad input in one line, 1 a checkpoint
    not saved, the game failing or a full disk, 130 / 143 after Ctrl-C / SIGTERM once the
    checkpoint is saved)."""
    from fastpo.run.checkpoint import plan_resume
    from fastpo.run.folder import (RunFolderBusy, RunLock, fresh_run_folder, run_folder_in_use, unsaved_note,
                                   untrained_start)
    from fastpo.config.schema import default_run_folder
    from fastpo.config.fields import ConfigError
    from fastpo.run.folder import SFT_FILE
    from fastpo.envs import EnvError
    from fastpo.report.metrics import warn_user
    from fastpo.sft import (SFT_CPU_GAME_DEFAULTS, SFTTrainer, check_chat_path, check_disjoint,
                            check_expert, load_sft_data, read_sft_config, sft_config, sft_default_overrides)
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
                console.print(f"{unsaved_note(args.resume)} (the run stopped before its first checkpoint): "
                              f"starting it again from step 1 with its config.yaml", markup=False, soft_wrap=True)
                args.resume, args.out = None, args.resume
            else:
                plan_resume(args.resume, trust=args.trust_checkpoint).check_run_config(args.resume)
        else:
            from fastpo.config.presets import default_preset

            presets = [p.strip() for p in (args.preset or default_preset()).split(",")]
            extra = sft_default_overrides(presets)
            game, game_sft = SFT_CPU_GAME_DEFAULTS.get(args.env, ([], [])) if \
                presets == ["cpu"] and args.config is None else ([], [])
            extra += game
            if args.iterations is not None:
                extra.append(f"trainer.iterations={args.iterations}")
            cfg = build_config(args, extra, {"trainer.output_dir": args.out} if args.out else None)
            if cfg.env.mixture:
                raise ConfigError(f"env.mixture {cfg.env.mixture!r:.100}: fastpo sft trains on one game (--env NAME); "
                                  "several games in one run are for fastpo train")
            sft = sft_config(game_sft + sft_ov)
            if not args.out:
                cfg.trainer.output_dir = default_run_folder(cfg.env.name, "sft-")
                if run_folder_in_use(cfg.trainer.output_dir) and not args.overwrite:
                    cfg.trainer.output_dir = fresh_run_folder(cfg.trainer.output_dir)
            elif run_folder_in_use(args.out) and not args.overwrite:
                raise ConfigError(used_out_message(args.out, run_folder_in_use(args.out)))
        if sft.data:
            sft.data = os.path.abspath(os.path.expanduser(sft.data))  # the run's, wherever it is resumed from
            check_chat_path(sft.data)
        else:
            check_disjoint(sft, cfg)
            check_expert(cfg.env.name)
        from fastpo.models import check_kernel_impl, check_model_name, resolve_device

        check_kernel_impl(cfg.trainer.kernel_impl, resolve_device(cfg.trainer.device))
        check_model_name(cfg.model.name)
        check_out_dir(cfg.trainer.output_dir, "--resume" if args.resume is not None else "--out")
    except (ConfigError, FileNotFoundError, RunFolderBusy) as e:
        print(f"fastpo sft: error: {e}", file=sys.stderr)
        return 2
    source = f"the conversations of {sft.data}" if sft.data else f"{sft.trajectories} expert trajectories"
    console.print(f"[bold]fastpo sft[/] env={cfg.env.name} preset={cfg.preset} {source}, {sft.batch_size} per step, {cfg.trainer.iterations} steps, lr {cfg.optim.actor_lr:g} "
                  f"-> {cfg.trainer.output_dir}")
    try:  # the data from the file, the tokenizer and the game alone: its problems found before the model loads
        data = load_sft_data(cfg, sft)
    except (ConfigError, EnvError) as e:
        print(f"fastpo sft: error: {e}", file=sys.stderr)
        return 2
    for line in data.describe():
        console.print(line, soft_wrap=True)
    if data.warning():
        warn_user(data.warning(), console)

    def run() -> list:
        trainer = SFTTrainer(cfg, sft, data=data, resume=args.resume is not None, console=console,
                             overwrite=args.overwrite, trust_checkpoint=args.trust_checkpoint)
        records = trainer.run()
        if trainer.stop_state.interrupted:
            raise Stopped(trainer.stop_state.signum)
        return records

    return exit_status(run, lambda text: print(f"fastpo sft: error: {text}", file=sys.stderr), "fastpo sft",
                       cfg.trainer.output_dir)
