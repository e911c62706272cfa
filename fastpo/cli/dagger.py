"""`fastpo dagger`: SFT, then DAgger rounds (fastpo.sft.dagger) into a run folder of its own."""
from __future__ import annotations

import os
import sys

from fastpo.cli.common import build_config, check_out_dir, check_trust_flag, exit_status, resumed_run_config
from fastpo.config.fields import ConfigError
from fastpo.config.files import dump_yaml, flatten, parse_config_yaml
from fastpo.config.loading import legacy_sections
from fastpo.config.presets import default_preset
from fastpo.config.loading import default_run_folder
from fastpo.run.folder import RunFolderBusy, RunLock, clear_run_folder, run_folder_in_use


def _difference(out: str, cfg) -> str | None:
    """None when the DAgger run in `out` has the settings of `cfg` (the number of rounds and the
    folder's spelling apart), else the first one that differs, as "key: new (the run's: old)"."""
    import yaml

    path = os.path.join(out, "config.yaml")
    with open(path, encoding="utf-8") as f:
        old = parse_config_yaml(f, path)
    for name, values in legacy_sections(out).items():  # a run made before config.yaml held them
        old.setdefault(name, values)
    old, new = flatten(old), flatten(parse_config_yaml(dump_yaml(cfg), "config"))
    for key in sorted(set(old) | set(new)):
        if key in ("trainer.output_dir", "dagger.rounds"):
            continue
        if old.get(key) != new.get(key):
            said = yaml.safe_dump(new.get(key), default_flow_style=True).removesuffix("\n...\n").strip()
            return f"{key}={said} (the run's: {old.get(key)!r})"
    return None


def _choose_folder(args, cfg) -> tuple[str, bool]:
    """(the run folder, whether it continues a stopped run there). --out OUT: OUT; a DAgger run
    there with the same settings is continued (the same command again), one with others is
    refused unless --overwrite (which deletes it). Without --out: runs/dagger-<env>, or the
    first `-2`, `-3`, ... that is free or holds an unfinished DAgger run with these settings."""
    # torch: imported when the command runs, so `fastpo --help` loads none
    from fastpo.sft.dagger import dagger_run_finished, is_dagger_run

    if args.out:
        if args.overwrite or not (is_dagger_run(args.out) or run_folder_in_use(args.out)):
            return args.out, False
        if not is_dagger_run(args.out):
            raise ConfigError(f"--out {args.out} already holds a run that is not a `fastpo dagger` run; pick another "
                              f"--out, or pass --overwrite to delete it")
        diff = _difference(args.out, cfg)
        if diff is not None:
            raise ConfigError(f"--out {args.out} holds a DAgger run with other settings ({diff}); continue it with "
                              f"--resume {args.out}, pick another --out, or pass --overwrite to delete it")
        return args.out, True
    base = default_run_folder(cfg.env.name, "dagger-")
    i = 1
    while True:
        cand = base if i == 1 else f"{base}-{i}"
        if is_dagger_run(cand):
            if _difference(cand, cfg) is None and not dagger_run_finished(cand, cfg.dagger.rounds):
                return cand, True
        elif not run_folder_in_use(cand):
            return cand, False
        i += 1


def cmd_dagger(args) -> int:
    """`fastpo dagger`: the exit status (`fastpo.cli.common.exit_status`: 0 done, 2 bad input in
    one line, 1 a checkpoint not saved, the game failing or a full disk, 130 / 143 after Ctrl-C /
    SIGTERM once what was done is saved)."""
    from rich.console import Console

    # torch: imported when the command runs, so `fastpo --help` loads none
    from fastpo.model_loading import check_kernel_impl, check_model_name, resolve_device
    from fastpo.sft.config import imitation_preset, sft_default_overrides
    from fastpo.sft.dagger import (DaggerRun, DaggerStopped, clear_dagger_run, dagger_folder_of, dagger_run_finished,
                                   is_dagger_run)
    from fastpo.sft.experts import check_expert

    console = Console()
    key = lambda o: o.split("=", 1)[0].strip()  # noqa: E731
    args.iterations = None  # (round 0's steps: trainer.iterations)
    if args.rounds is not None:
        args.overrides.append(f"dagger.rounds={args.rounds}")
    continuing = False
    try:
        check_trust_flag(args)
        if args.resume is not None:
            if not args.resume.strip():
                raise ConfigError("--resume needs the DAgger run folder, e.g. --resume runs/dagger-frozenlake")
            args.resume = dagger_folder_of(args.resume)
            if not is_dagger_run(args.resume):
                raise ConfigError(f"--resume {args.resume}: not a `fastpo dagger` run folder (its config.yaml has no "
                                  f"dagger section)")
            # the data and the rounds' settings are the run's; more rounds may be asked for
            cfg = resumed_run_config(args, fixed=[o for o in args.overrides if key(o).startswith(("sft.", "dagger."))
                                                  and key(o) != "dagger.rounds"])
            RunLock(args.resume).check()
            out, continuing = args.resume, True
        else:
            preset = imitation_preset("dagger", args.env, args.preset, args.config)
            extra = sft_default_overrides([p.strip() for p in (preset or default_preset()).split(",")], "dagger")
            cfg = build_config(args, extra, {"trainer.output_dir": args.out} if args.out else None, preset=preset,
                               sections=("sft", "dagger"))
            if cfg.env.mixture:
                raise ConfigError(f"env.mixture {cfg.env.mixture!r:.100}: fastpo dagger trains on one game "
                                  f"(--env NAME)")
            out, continuing = _choose_folder(args, cfg)
            cfg.trainer.output_dir = out
            RunLock(out).check()
        check_expert(cfg.env.name)
        check_model_name(cfg.model.name)
        check_kernel_impl(cfg.trainer.kernel_impl, resolve_device(cfg.trainer.device))
        check_out_dir(out, "--resume" if args.resume is not None else "--out")
    except (ConfigError, FileNotFoundError, RunFolderBusy) as e:
        print(f"fastpo dagger: error: {e}", file=sys.stderr)
        return 2
    dag = cfg.dagger
    if continuing and dagger_run_finished(out, dag.rounds):
        console.print(f"{out} already ran its {dag.rounds} rounds: nothing to do; pass --rounds N with "
                      f"N > {dag.rounds} to run more", style="yellow", markup=False)
        return 0
    if args.overwrite and os.path.isdir(out):
        with RunLock(out):
            clear_dagger_run(out)
            clear_run_folder(out)
    first = "SFT on the expert's trajectories (round 0), then " if dag.sft_round else ""
    console.print(f"[bold]fastpo dagger[/] env={cfg.env.name} preset={cfg.preset}: {first}{dag.rounds} rounds of "
                  f"{dag.levels} levels labelled by the expert, from {cfg.model.name} -> {out}"
                  + (" (continuing the run there)" if continuing else ""), soft_wrap=True)

    def run() -> None:
        signum = DaggerRun(cfg, console, trust_checkpoint=args.trust_checkpoint).run()
        if signum is not None:  # a round's training stopped, its checkpoint saved
            raise DaggerStopped(signum)

    return exit_status(run, lambda text: print(f"fastpo dagger: error: {text}", file=sys.stderr), "fastpo dagger", out)
