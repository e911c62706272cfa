"""`fastpo eval`: success rate and pass@k of a model (or a run's checkpoint) on fixed seeds."""
from __future__ import annotations

import os
import sys

from fastpo.cli.common import check_out_dir
from fastpo.cli.processes import quiet_progress_bars
from fastpo.config.fields import ConfigError
from fastpo.config.members import env_members
from fastpo.run.folder import write_json


def cmd_eval(args) -> int:
    """`fastpo eval`. A fastpo checkpoint (`runs/x`, `runs/x/checkpoints/iter_N` or its `model/`)
    is evaluated with the env, rollout and eval settings its run used, except what the
    command line sets (fastpo.evaluation.settings.eval_config); one line says whose settings are used.
    `--json PATH` writes the metrics, model label and settings as JSON. Exit status 0, 2 bad
    input (one line), 1 the user's game failing during the evaluation (one line naming the
    call and the seed)."""
    from rich.console import Console
    from rich.table import Table

    # torch, numpy: imported when the command runs, so `fastpo --help` loads none
    from fastpo.distributed.context import DistributedError, SINGLE, init_from_env, shutdown, torchrun_env
    from fastpo.envs import EnvError
    from fastpo.evaluation.settings import eval_config, eval_report

    where = torchrun_env()  # under torchrun each process evaluates its share of the seeds
    main_rank = where is None or where[0] == 0
    console = Console(quiet=not main_rank)  # rank 0 speaks for the job
    if not main_rank:
        quiet_progress_bars()
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
        # a fastpo checkpoint brings the env and rollout settings it was trained with
        cfg, run = eval_config(env=args.env, preset=args.preset, file=args.config, overrides=ov,
                               values={"model.name": args.model} if args.model is not None else None,
                               warn=lambda text: console.print(f"warning: {text}", style="yellow", markup=False,
                                                              soft_wrap=True))
        # torch: imported when the command runs, so `fastpo --help` loads none
        from fastpo.model_loading import check_model_name, resolve_device

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
        # torch, transformers: loaded once the settings are checked (bad input is refused before)
        from fastpo.evaluation.policy import run_eval

        ctx = init_from_env(cfg.trainer.device) if where is not None else SINGLE
        try:
            res = run_eval(cfg, console=console, samples_dir=args.samples, dist=ctx)
        finally:
            shutdown(ctx)
    except (ConfigError, FileNotFoundError, DistributedError) as e:
        if main_rank:
            print(f"fastpo eval: error: {e}", file=sys.stderr)
        return 2
    except EnvError as e:  # the user's game failing on an eval seed the set-up check did not play: one line
        if main_rank:
            print(f"fastpo eval: error: {e}", file=sys.stderr)
        return 1
    if not main_rank:
        return 0
    console.print(f"model: {res['model']}", markup=False)
    games = f" ({', '.join(m.label for m in env_members(cfg))})" if cfg.env.mixture else ""
    table = Table(title=f"fastpo eval: {cfg.env.name}{games}")
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
