"""What the `fastpo` commands share: the configuration from the command line (`build_config`),
the configuration of a resumed run (`resumed_run_config`), the output-folder check, the
--trust-checkpoint rule."""
from __future__ import annotations

import copy
import errno
import os
from typing import Callable, Optional

from fastpo.config.fields import ConfigError, apply_dict, parse_override
from fastpo.config.loading import inline_rubric_file, load_config, load_run_config
from fastpo.config.validation import validate
from fastpo.run.folder import RunFolderBusy
from fastpo.run.manifest import checkpoint_names


def check_trust_flag(args) -> None:
    """--trust-checkpoint without --resume: ConfigError (it would silently do nothing; a new
    run, `--model RUN` included, reads no pickled file)."""
    if getattr(args, "trust_checkpoint", False) and args.resume is None:
        raise ConfigError("--trust-checkpoint applies to --resume DIR only (a new run reads no pickled file)")


def build_config(args, extra: list[str], values: dict | None = None, preset: Optional[str] = None,
                 sections: tuple = ()):
    """The configuration of a new run from the command line `args` (`load_config`): `extra`
    overrides before the command line's, `values` taken literally (--out), `preset` in place of
    --preset when given, the optional `sections` the command reads (fastpo.config.imitation)."""
    ov = list(extra)
    values = dict(values or {})
    if args.model is not None:
        values["model.name"] = args.model  # a path or name, taken literally (not YAML)
    if args.device:
        ov.append(f"trainer.device={args.device}")
    if args.seed is not None:
        ov.append(f"trainer.seed={args.seed}")
    ov += args.overrides
    return load_config(env=args.env, preset=preset if preset is not None else args.preset, file=args.config,
                       overrides=ov, values=values, sections=sections)


def check_out_dir(path: str, flag: str = "--out") -> None:
    """Refuse an output folder that cannot be created or written, before any model loads
    (ConfigError naming `flag` and the folder). On `--resume` the run folder itself and the
    files a resume rewrites (metrics.jsonl, config.yaml) must be writable."""
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


def used_out_message(out: str, used: list[str]) -> str:
    """Why a new run refuses `--out out` that holds a run (markers `used`), and what to do:
    resume it (only where a checkpoint is there to resume), another --out, or --overwrite."""
    if checkpoint_names(os.path.join(out, "checkpoints")):
        return (f"--out {out} already holds a run ({', '.join(used)}); resume it with --resume {out}, pick another "
                f"--out, or pass --overwrite to delete it")
    return (f"--out {out} already holds a run ({', '.join(used)}) with no checkpoint to resume, beside files a run "
            f"does not write before its first checkpoint; pick another --out, or pass --overwrite to delete it")


def resume_fixed(cfg) -> dict:
    """The settings a resumed run keeps from its config.yaml, by dotted name."""
    return {"env": copy.deepcopy(cfg.env), "model": copy.deepcopy(cfg.model), "preset": cfg.preset,
            "trainer.seed": cfg.trainer.seed, "trainer.output_dir": cfg.trainer.output_dir}


def resumed_run_config(args, fixed: list[str] = ()):
    """The run config of `--resume OUT` (for `fastpo train` and `fastpo sft`): OUT's
    config.yaml with the overrides, --iterations and --device a resume may change, validated.
    Raises ConfigError naming what cannot change mid-run (an option, or a dotted override in
    any spelling that moves the env, model, preset, seed or output folder); `fixed` lists
    further options the caller refuses."""
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
    kept = resume_fixed(cfg)
    for o in args.overrides:
        apply_dict(cfg, parse_override(o))
    # whatever the spelling (e.g. a mapping `trainer={seed: 3}`), the values must not move
    moved = [k for k, v in resume_fixed(cfg).items() if v != kept[k]]
    if moved:
        raise ConfigError(f"{', '.join(moved)} cannot change on --resume (the run keeps the configuration "
                          f"in {os.path.join(args.resume, 'config.yaml')}); start a new run instead")
    if args.iterations is not None:
        cfg.trainer.iterations = args.iterations
    if args.device is not None:
        cfg.trainer.device = args.device
    cfg.trainer.output_dir = args.resume
    return validate(inline_rubric_file(cfg))


def exit_status(run: Callable[[], Optional[list]], error: Callable[[str], None], command: str, out: str) -> int:
    """Run a command's job `run()` (it returns the run's metric records) and map how it ended to
    the exit status every `fastpo` command shares: 0 done; 1 when it ended but trained nothing
    (every update skipped: `fastpo.report.summary.nothing_trained`); 128 + signal (130 Ctrl-C,
    143 SIGTERM) after a stop, once the checkpoint is saved; 2 bad input found at set-up
    (ConfigError, the user's game failing its set-up checks included; a busy or used run
    folder); 1 a checkpoint not saved, the user's game or reward function failing during the
    run (EnvError) or a full disk. `error(text)`
    says the one line; `command` (e.g. "fastpo train") and `out` (the run folder) name the
    resume. Other exceptions propagate (a bug: its traceback)."""
    # torch, numpy: imported when the command runs, so `fastpo --help` loads none
    from fastpo.envs import EnvError
    from fastpo.report.summary import nothing_trained
    from fastpo.run.checkpoint import CheckpointSaveError

    try:
        records = run()
    except KeyboardInterrupt as e:  # stopped by a signal; the checkpoint is saved
        return 128 + getattr(e, "signum", 2)
    except (ConfigError, RunFolderBusy, FileExistsError) as e:  # bad input found late; not a bug
        error(str(e))
        return 2
    except CheckpointSaveError as e:
        error(str(e))
        return 1
    except EnvError as e:  # the user's game raised (names the env and the instance's seed) or broke its contract
        kept = os.path.isdir(out) and any(os.path.exists(os.path.join(out, n)) for n in ("metrics.jsonl", "checkpoints"))
        error(f"{e} (the run stopped; " + ("its last checkpoint and metrics are kept)" if kept else
                                           "nothing had been trained or written yet)"))
        return 1
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        error(f"{e.strerror} writing {e.filename or 'the run folder'}; free some space, then "
              f"`{command} --resume {out}`")
        return 1
    why = nothing_trained(records or [])
    if why:  # it ran to the end, but did not train: not a success
        error(why)
        return 1
    return 0
