"""Results rows from recorded runs: the figures of a run in the README and docs/results.md come
from its run folder, with the code version, and a test fails once the preset or the evaluation
code moved on.

    python tools/results_row.py record NAME RUN_DIR --argv "--env frozenlake" [--title TEXT] [--short TEXT] [--wall S]
    python tools/results_row.py row NAME           # the README row and the docs/results.md row the record gives
    python tools/results_row.py check              # every record against the code; exit 1 if stale

`record` reads RUN_DIR (its config.yaml, metrics.jsonl and eval/ outcomes, as the run's own
before/after table does: fastpo.report.summary.before_after) and writes
bench/results/recorded/NAME.json: the figures, the git commit, and two fingerprints: the SHA-256
of the configuration that `fastpo train ARGV` resolves to today (its config.yaml without the
output folder; the run's own config.yaml must match it) and of the evaluation's code
(`EVAL_SOURCES` plus the game's module and the games' shared rendering, envs_native/_core.py;
docstrings and comments left out). `check` recomputes both fingerprints for every record
and compares the rows (the line holding `<!-- results-row:NAME -->`) with the ones the record
gives: the README's short one (`render`: the record's `short` title, the headline figures) and
docs/results.md's full one (`render_full`: every figure, the wall time and the commit); it names
what moved and the commands that renew the rows.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "bench", "results", "recorded")
README = os.path.join(ROOT, "README.md")
PAGE = os.path.join(ROOT, "docs", "results.md")  # the full rows
# what decides an evaluation's figures besides the configuration: the episodes' seeds and
# sampling streams, the evaluation loop (the game's own module is added per record)
EVAL_SOURCES = ("fastpo/evaluation/policy.py", "fastpo/evaluation/settings.py", "fastpo/seeds.py",
                "fastpo/rollout/sampling.py")
GAME_SOURCES = {"frozenlake": "envs_native/frozenlake.py", "sokoban": "envs_native/sokoban.py",
                "bandit": "envs_native/bandit.py"}


def _config_text(argv: list) -> str:
    """config.yaml of `fastpo train ARGV` as resolved now, without the output folder. ARGV:
    --env, --preset, --seed and dotted overrides (what a recorded run may use)."""
    from fastpo.config import load_config
    from fastpo.config.files import dump_yaml

    p = argparse.ArgumentParser(prog="fastpo train (recorded)")
    p.add_argument("--env")
    p.add_argument("--preset")
    p.add_argument("--seed", type=int)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    extra = [f"trainer.seed={a.seed}"] if a.seed is not None else []
    cfg = load_config(env=a.env, preset=a.preset, overrides=extra + a.overrides, check_env=False)
    return _without_output_dir(dump_yaml(cfg))


def _without_output_dir(text: str) -> str:
    import yaml

    d = yaml.safe_load(text)
    d.get("trainer", {}).pop("output_dir", None)
    return yaml.safe_dump(d, sort_keys=True)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _code_lines(text: str) -> list:
    """The lines of a Python source that decide what it does: without docstrings (module,
    class and function), comment-only lines, blank lines and trailing blanks. A comment after
    code on the same line still counts, and so does a line inside a string. Line-based (ast
    gives the docstrings' line spans, tokenize the comments') so the result does not depend on
    the Python version's ast dump or its tokens for f-strings."""
    import ast
    import io
    import tokenize

    drop = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            drop.update(range(body[0].lineno, body[0].end_lineno + 1))
    comment, code = set(), set()
    layout = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comment.add(tok.start[0])
        elif tok.type not in layout:
            code.update(range(tok.start[0], tok.end[0] + 1))
    drop |= comment - code
    return [line.rstrip() for i, line in enumerate(text.splitlines(), 1) if i not in drop and line.strip()]


def _eval_fingerprint(env: str) -> str:
    """SHA-256 of the evaluation's code (`EVAL_SOURCES`, the game's module and envs_native/_core.py),
    docstrings and comments left out (`_code_lines`): a reworded docstring keeps a record current."""
    h = hashlib.sha256()
    for rel in EVAL_SOURCES + ((GAME_SOURCES[env], "envs_native/_core.py") if env in GAME_SOURCES else ()):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            h.update(rel.encode() + b"\0" + "\n".join(_code_lines(f.read())).encode("utf-8") + b"\0")
    return h.hexdigest()


def _fmt(v: float) -> str:
    return f"{v:.3f}"


def render(rec: dict) -> str:
    """The README's short row of a record (ends with its marker): format-valid and success, the
    random and optimal lines; the full row is `render_full`'s, in docs/results.md."""
    f = rec["figures"]
    s, fv = f["eval/success_rate"], f.get("eval/format_valid")
    parts = [f"format-valid {_fmt(fv['before'])} -> {_fmt(fv['after'])}"] if fv else []
    line = (f"success {_fmt(s['before'])} -> {_fmt(s['after'])} +- {_fmt(s['after_se'])}"
            + (f" (paired z {s['z_paired']:+.1f})" if s.get("z_paired") is not None else ""))
    ref = [f"{'random' if k == 'eval/random_success' else 'optimal'} {_fmt(f[k]['after'])}"
           for k in ("eval/random_success", "eval/optimal_success") if k in f]
    parts.append(", ".join([line] + ref))
    return (f"| {rec.get('short') or rec['title']} | {'; '.join(parts)} | [results](docs/results.md) "
            f"<!-- results-row:{rec['name']} --> |")


def render_full(rec: dict) -> str:
    """docs/results.md's row of a record (ends with its marker): every figure, the wall time, the commit."""
    f = rec["figures"]
    s, fv, sc = f["eval/success_rate"], f.get("eval/format_valid"), f.get("eval/score_mean")
    parts = []
    if fv:
        parts.append(f"format-valid {_fmt(fv['before'])} -> {_fmt(fv['after'])}")
    if sc:
        parts.append(f"score mean {sc['change']:+.3f} (paired z {sc['z_paired']:+.1f})" if sc.get("z_paired")
                     is not None else f"score mean {sc['change']:+.3f}")
    line = (f"success {_fmt(s['before'])} -> {_fmt(s['after'])} +- {_fmt(s['after_se'])}"
            + (f" (paired z {s['z_paired']:+.1f})" if s.get("z_paired") is not None else ""))
    ref = [f"the random policy's {_fmt(f[k]['after'])}" if k == "eval/random_success" else
           f"optimal {_fmt(f[k]['after'])}" for k in ("eval/random_success", "eval/optimal_success") if k in f]
    if ref:
        line += " against " + ", ".join(ref)
    parts.append(line)
    wall = f"; {rec['wall_s'] / 60:.1f} min wall" if rec.get("wall_s") else ""
    study = f"[study]({rec['study']}) " if rec.get("study") else ""  # relative to docs/
    return (f"| {rec['title']} | {'; '.join(parts)}{wall}; recorded at {rec['commit'][:7]} "
            f"(`tools/results_row.py`) | {study}<!-- results-row:{rec['name']} --> |")


def record(name: str, run_dir: str, argv: list, title: str, wall: float | None, short: str | None = None) -> dict:
    from fastpo.report.summary import before_after

    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
        ran = _without_output_dir(f.read())
    now = _config_text(argv)
    if ran != now:
        raise SystemExit(f"{run_dir}/config.yaml is not what `fastpo train {' '.join(argv)}` resolves to now")
    ba = before_after(records, run_dir)
    if ba is None:
        raise SystemExit(f"{run_dir} has no evaluation before and after training")
    import yaml

    env = yaml.safe_load(now)["env"]["name"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, encoding="utf-8").stdout.strip()
    rec = {"name": name, "title": title, "short": short, "argv": argv, "commit": commit,
           "recorded": datetime.date.today().isoformat(), "wall_s": wall,
           "config_sha256": _sha(now), "eval_code_sha256": _eval_fingerprint(env),
           "figures": {row["key"]: {k: row[k] for k in ("before", "after", "before_se", "after_se", "change", "z",
                                                          "z_paired")} for row in ba["rows"]}}
    os.makedirs(RECORDS, exist_ok=True)
    with open(os.path.join(RECORDS, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    return rec


def load(name: str) -> dict:
    with open(os.path.join(RECORDS, f"{name}.json"), encoding="utf-8") as f:
        return json.load(f)


def problems() -> list[str]:
    """What is stale: one line per record whose configuration or evaluation code moved since it
    was recorded, or whose README or docs/results.md row differs from the record's."""
    import yaml

    out = []
    with open(README, encoding="utf-8") as f:
        readme = f.read().splitlines()
    with open(PAGE, encoding="utf-8") as f:
        page = f.read().splitlines()
    for fn in sorted(os.listdir(RECORDS)) if os.path.isdir(RECORDS) else []:
        if not fn.endswith(".json"):
            continue
        rec = load(fn[:-5])
        renew = (f"rerun `fastpo train {' '.join(rec['argv'])}` (a fresh folder) and `python tools/results_row.py "
                 f"record {rec['name']} RUN --argv {shlex.quote(' '.join(rec['argv']))}`, then put the two rows of "
                 f"`python tools/results_row.py row {rec['name']}` in the README and docs/results.md")
        now = _config_text(rec["argv"])
        if _sha(now) != rec["config_sha256"]:
            out.append(f"{rec['name']}: the configuration of `fastpo train {' '.join(rec['argv'])}` changed since "
                       f"{rec['commit'][:7]}: {renew}")
        env = yaml.safe_load(now)["env"]["name"]
        if _eval_fingerprint(env) != rec["eval_code_sha256"]:
            out.append(f"{rec['name']}: the evaluation code ({', '.join(EVAL_SOURCES)}, the game) changed since "
                       f"{rec['commit'][:7]}: {renew}")
        marker = f"<!-- results-row:{rec['name']} -->"
        rows = [line for line in readme if marker in line]
        if rows != [render(rec)]:
            out.append(f"{rec['name']}: README.md's row is not the record's: put the first line of `python "
                       f"tools/results_row.py row {rec['name']}` there")
        rows = [line for line in page if marker in line]
        if rows != [render_full(rec)]:
            out.append(f"{rec['name']}: docs/results.md's row is not the record's: put the second line of `python "
                       f"tools/results_row.py row {rec['name']}` there")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("name")
    r.add_argument("run_dir")
    r.add_argument("--argv", required=True, help="the `fastpo train` arguments of the run, e.g. '--env frozenlake'")
    r.add_argument("--title", default=None, help="the full row's title (docs/results.md)")
    r.add_argument("--short", default=None, help="the README row's title (default: --title)")
    r.add_argument("--wall", type=float, default=None, help="the run's wall time, seconds")
    w = sub.add_parser("row")
    w.add_argument("name")
    sub.add_parser("check")
    a = p.parse_args(argv)
    if a.cmd == "record":
        rec = record(a.name, a.run_dir, shlex.split(a.argv), a.title or f"`fastpo train {a.argv}`", a.wall, a.short)
        print(render(rec))
        print(render_full(rec))
    elif a.cmd == "row":
        rec = load(a.name)
        print(render(rec))
        print(render_full(rec))
    else:
        bad = problems()
        for line in bad:
            print(line)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
