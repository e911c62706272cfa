"""The `fastpo` command line: `fastpo train`, `fastpo sft` (on fastpo.sft), `fastpo dagger` (on
fastpo.sft.dagger) and `fastpo eval`.

    fastpo train --env frozenlake [--preset cpu|paper|...] [--config FILE] [--model NAME]
                 [--out DIR [--overwrite]] [--resume DIR [--iterations N] [--trust-checkpoint]] [--nproc N]
                 [section.key=value ...]
    fastpo eval  --env frozenlake --model PATH_OR_NAME [--seeds N] [--k K] [--temperature T] [--nproc N]
    fastpo dagger --env frozenlake [--model NAME] [--out DIR [--overwrite]] [--rounds N]
                 [--resume DIR [--rounds N]] [section.key=value sft.key=value dagger.key=value ...]

The configuration (defaults, presets, file, dotted overrides) is validated before any model
loads; a bad key or value exits with status 2 and a message naming it. Other bad input (an
unreadable config file, an unknown model, a bad device or output folder) also exits 2 with one
line; a traceback means a bug.

A new run never destroys an old one: without --out, a folder that already holds a run is
replaced by the first free `runs/<env>-2`, `-3`, ...; a named --out holding a run is refused
unless --overwrite, and so is a folder another fastpo process is writing (naming its pid).
On --resume only --iterations, --device and non-env/model overrides apply; its checkpoint
files load as plain data, and one that needs full unpickling (an older fastpo's) is refused
unless --trust-checkpoint (fastpo.run.checkpoint, "Trust").

`python -m fastpo` is the same command. `--nproc N` runs it in N processes under torchrun
(`python -m torch.distributed.run --standalone --nproc_per_node N -m fastpo train ...`), data
parallel (fastpo.distributed; docs/distributed.md); --nproc 1 (the default) is the
one-process path. `fastpo eval --nproc N` (or under torchrun) shares the eval seeds out over
the processes; rank 0 prints and writes the results. Under torchrun (even with one process, a smoke test of that path) each
process builds the configuration, joins the process group (gloo on the CPU, NCCL on CUDA) and trains its share; rank 0 chooses the run folder and
is the only one that writes it. A setting the data-parallel trainer does not support yet is
refused with exit status 2 before any model loads (fastpo.distributed.launch.check_trainer_support).

Exit status (docs/training.md, "What survives a crash"): 0 done; 2 bad input, refused before
the run began (one line; the user's game, expert or reward function failing the set-up checks
included); 1 the run failed after it began (one line: the user's code failing mid-run, naming
the function, game and seed; a checkpoint that could not be saved or a full disk; every update
skipped); 130 after Ctrl-C and 143 after SIGTERM (both once the checkpoint is saved).
Under `--nproc N` the job exits as one process would (rank 0's status, 130 / 143 after a
signal once rank 0 has saved the checkpoint), without torchrun's exception report; torchrun
run directly keeps its own statuses (1 when a process failed or after a signal).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from fastpo.cli.dagger import cmd_dagger
from fastpo.cli.eval import cmd_eval
from fastpo.cli.processes import catch_ctrl_c, check_processes, degrade_console, left_a_job
from fastpo.cli.sft import cmd_sft
from fastpo.cli.train import cmd_train
from fastpo.config.imitation import SFTConfig
from fastpo.config.presets import preset_help


#: The `sft.*` keys `fastpo sft --help` lists: the sft section's (data_sha256 is set by the run).
SFT_KEYS = tuple(f"sft.{f.name}" for f in dataclasses.fields(SFTConfig) if f.name != "data_sha256")

_OVERRIDES_HELP = {
    "train": "dotted overrides, e.g. algorithm.adv_estimator=grpo rollout.group_size=8",
    "eval": "dotted overrides, e.g. rollout.max_new_tokens=32 env.options.observation=coords",
    "sft": f"dotted overrides: the SFT data ({', '.join(SFT_KEYS)}: docs/sft.md) and the settings SFT reads, "
           "e.g. sft.trajectories=256 sft.data=chats.jsonl optim.actor_lr=1e-4 rollout.max_new_tokens=32 (the "
           "algorithm.* keys are StarPO's, not read by SFT)",
    "dagger": "dotted overrides: the rounds (dagger.rounds, dagger.levels, dagger.lr, dagger.history, "
              "dagger.aggregate, dagger.*: docs/sft.md), the SFT round's data (sft.*) and the settings SFT reads, e.g. "
              "dagger.rounds=2 sft.trajectories=256 optim.actor_lr=2e-4",
}


def _add_common(p: argparse.ArgumentParser, command: str) -> None:
    mixture = ("" if command in ("sft", "dagger")
               else "; several games in one run: a,b (e.g. bandit,frozenlake) or env.mixture")
    p.add_argument("--env", default=None, metavar="NAME",
                   help="environment: bandit, sokoban, frozenlake, probe:NAME (a probe game), module.path:Class, "
                        "textarena:ID, gym:ID or an installed fastpo.envs entry point (default: frozenlake, or the "
                        "config file's)" + mixture
                        + (" (a run's mixture entry by its label, with --model RUN)" if command == "eval" else ""))
    p.add_argument("--preset", default=None, help=preset_help(command))
    p.add_argument("--config", default=None, help="YAML config file")
    p.add_argument("--model", default=None, help="smollm2-135m-instruct (embedded), an HF id or folder, random:<shape>")
    p.add_argument("--device", default=None, help="auto, cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help=_OVERRIDES_HELP[command])


def _add_trust(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="with --resume: load checkpoint files that need full unpickling (an older fastpo's "
                        "state.pt), which can run any code they hold; only for run folders you trust")


def main(argv: list[str] | None = None) -> int:
    """Run the `fastpo` command line `argv` (default: sys.argv[1:]); the exit status (2: bad
    input). `entry` is the command itself (exit, and the end of a torchrun rank)."""
    degrade_console()
    ap = argparse.ArgumentParser(prog="fastpo", description="Multi-turn RL for LLM agents (StarPO / StarPO-S)")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train with StarPO / StarPO-S")
    _add_common(tr, "train")
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
    _add_common(sf, "sft")
    sf.add_argument("--out", default=None, help="output folder (default runs/sft-<env>)")
    sf.add_argument("--overwrite", action="store_true", help="delete the run already in --out")
    sf.add_argument("--iterations", type=int, default=None,
                    help="SFT steps (optimizer steps; default 32 at lr 1e-4, the tiny preset's 2)")
    sf.add_argument("--resume", default=None, metavar="OUT", help="continue the SFT run in folder OUT")
    _add_trust(sf)
    dg = sub.add_parser("dagger", help="DAgger: SFT, then rounds in which the game's expert labels the states the "
                                       "model reaches (fastpo.sft.dagger)")
    _add_common(dg, "dagger")
    dg.add_argument("--out", default=None, help="output folder (default runs/dagger-<env>)")
    dg.add_argument("--overwrite", action="store_true", help="delete the run already in --out")
    dg.add_argument("--rounds", type=int, default=None, metavar="N",
                    help="DAgger rounds after the SFT round (dagger.rounds; on --resume: run more)")
    dg.add_argument("--resume", default=None, metavar="OUT", help="continue the DAgger run in folder OUT")
    _add_trust(dg)
    ev = sub.add_parser("eval", help="evaluate a model: success rate and pass@k on fixed seeds")
    _add_common(ev, "eval")
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
    restore = catch_ctrl_c()  # a Ctrl-C raises CtrlC, told from a user's code raising KeyboardInterrupt
    try:
        status = check_processes(args, argv)
        if status is not None:
            return status
        if args.command == "train":
            return cmd_train(args)
        if args.command == "sft":
            return cmd_sft(args)
        if args.command == "dagger":
            return cmd_dagger(args)
        return cmd_eval(args)
    except KeyboardInterrupt as e:  # a Ctrl-C before the run began (or during `fastpo eval`): one line
        print(f"fastpo {args.command}: interrupted by Ctrl-C" + ("" if args.command == "eval" else
              " before the run began; nothing was written or trained"), file=sys.stderr)
        return 128 + getattr(e, "signum", 2)
    finally:
        restore()


def entry(argv: list[str] | None = None) -> None:
    """The `fastpo` command (console script, `python -m fastpo`, what torchrun runs in each
    process): `main(argv)`, then exit with its status. Under torchrun `main` is wrapped in
    torch.distributed.elastic's `record` (a failing rank's exception reaches torchrun's error
    summary), and a rank that has left its job's process group ends with
    `fastpo.distributed.context.end_process` instead of the interpreter's teardown: with `main`'s
    status, or 1 (130 for Ctrl-C) after an exception, whose traceback is printed first."""
    run = main
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        from torch.distributed.elastic.multiprocessing.errors import record

        run = record(main)
    try:
        status = run(argv)
    except BaseException as e:
        if isinstance(e, SystemExit) or not left_a_job():
            raise
        import traceback

        traceback.print_exc()
        status = 130 if isinstance(e, KeyboardInterrupt) else 1
    if left_a_job():
        # torch: imported when the command runs, so `fastpo --help` loads none
        from fastpo.distributed.context import end_process

        end_process(status)
    sys.exit(status)
