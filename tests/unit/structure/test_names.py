"""Names that explain themselves (issue 57, item 6), read from the source files (nothing of
fastpo imported): one meaning per module name across fastpo/ and envs_native/, no public name
of `fastpo` that is also one of its modules, one definition per public top-level name, imports
of fastpo modules at the top of their module unless a heavy or optional dependency (or a
cycle) needs them inside a function, said where they are, and no module of fastpo/ over 600
lines."""
import ast
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3]
MAX_LINES = 600

#: Module names (files, and the packages' folders) that several modules share, and why that is right.
SHARED_NAMES = {
    "__init__": "a package's own module",
    "dagger": "fastpo/cli/<command>.py is named after its command (`fastpo dagger`); fastpo/sft/dagger.py is the "
              "DAgger run that command starts",
    "sft": "fastpo/cli/sft.py is named after its command (`fastpo sft`); fastpo/sft/ is the package it runs",
    "config": "fastpo/sft/config.py is what `fastpo sft` and `fastpo dagger` add to the one configuration, "
              "fastpo/config/",
    "trainer": "fastpo/sft/trainer.py is the SFT package's trainer (SFTTrainer), on the parts of the StarPO "
               "trainer's package fastpo/trainer/",
}

#: Public top-level functions and classes defined in two modules, and why.
SHARED_DEFINITIONS = {
    "mix64": "envs_native/python_reference.py's plain copy of the compiled hash in envs_native/_core.py, held "
             "equal by the envs tests",
    "status": "the two C routines' modules (fastpo/kernels/cpu_attention.py, cpu_rows.py) share one interface",
    "usable": "the two C routines' modules (fastpo/kernels/cpu_attention.py, cpu_rows.py) share one interface",
    "masked_whiten": "fastpo/distributed/collectives.py's is fastpo/algorithms/advantages.py's over every "
                     "rank's tokens (it calls it)",
    "env_preset": "fastpo/config/schema.py's is fastpo/envs/names.py's with its error as a ConfigError",
    "save_hf_model": "fastpo/distributed/sharding.py's writes the folder of fastpo/run/checkpoint.py's from "
                     "rank 0, the state dict gathered from every rank",
}

#: Modules of fastpo/ over MAX_LINES lines, and why.
LONG_MODULES = {
    "fastpo/config/schema.py": "split by another change of issue 57 (item 5)",
    "fastpo/kernels/api.py": "605 lines",
}


#: Imports of fastpo modules inside functions, per module (a folder: its modules together), each
#: with a comment naming what it keeps from loading (`_LAZY_REASON`). A new one is deliberate:
#: count it here.
LAZY_IMPORTS = {
    # the commands import what loads torch (or numpy) when they run: `fastpo --help` loads neither
    "fastpo/cli/__init__.py": 1, "fastpo/cli/common.py": 3, "fastpo/cli/dagger.py": 5, "fastpo/cli/eval.py": 5,
    "fastpo/cli/processes.py": 4, "fastpo/cli/sft.py": 9, "fastpo/cli/train.py": 9,
    # `import fastpo.envs` loads neither Numba nor torch
    "fastpo/envs/batched.py": 4, "fastpo/envs/names.py": 2,
    # fastpo.rollout (torch) only when the rollout figures are summed: the commands import report.metrics first
    "fastpo/report/metrics.py": 1,
    # triton is optional
    "fastpo/kernels/api.py": 1,
    # the configuration loads no torch and no game (`import fastpo.config`): fastpo.envs, fastpo.rewards and
    # fastpo.rubric load when a configuration names a game, a reward function or a rubric
    "fastpo/config/": 13,
}
#: What a comment on a lazy import (its line, or the line above its group of imports) names.
_LAZY_REASON = re.compile(r"#.*\b(torch|transformers|numpy|numba|triton|sglang|textarena|gymnasium|peft|cycle)\b")


def _files():
    return sorted(p for folder in ("fastpo", "envs_native") for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _rel(p: pathlib.Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_one_meaning_per_module_name():
    """Two modules (or a module and a package) of the same name hold different things under one
    name: fastpo had three reference.py and two each of advantages.py, batch.py, gym_env.py,
    launch.py, losses.py, models.py and registry.py. A name shared on purpose is in SHARED_NAMES
    with its reason."""
    seen = collections.defaultdict(list)
    for p in _files():
        seen[p.stem].append(_rel(p))
        if p.name == "__init__.py" and p.parent not in (ROOT / "fastpo", ROOT / "envs_native"):
            seen[p.parent.name].append(_rel(p.parent) + "/")
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert {n: ps for n, ps in repeated.items() if n not in SHARED_NAMES} == {}
    assert set(SHARED_NAMES) <= set(repeated), "an entry of SHARED_NAMES no longer repeats: remove it"


def test_a_public_name_of_fastpo_is_not_also_a_module():
    """`fastpo.evaluate` was the module fastpo/evaluate.py, its class swapped to make it callable as
    the public API's `evaluate(cfg)`; each name of the public API (fastpo/__init__.py's
    `_EXPORTS`) is one thing, and no module or package of fastpo has its name."""
    init = ast.parse((ROOT / "fastpo" / "__init__.py").read_text())
    table = next(n.value for n in init.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "_EXPORTS")
    exports = ast.literal_eval(table)
    assert "evaluate" in exports
    clashes = [name for name in exports
               if (ROOT / "fastpo" / f"{name}.py").exists() or (ROOT / "fastpo" / name / "__init__.py").exists()]
    assert clashes == []
    assert all(attr is not None for _, attr in exports.values()), "an export is a module"
    swapped = [_rel(p) for p in _files() if "__class__ =" in p.read_text() and "sys.modules" in p.read_text()]
    assert swapped == []


def test_one_definition_per_public_top_level_name():
    """Two `make_env` with different signatures (fastpo.envs and fastpo.envs_native) were two
    meanings of one name; a public function or class is defined in one module, unless
    SHARED_DEFINITIONS says why not."""
    where = collections.defaultdict(list)
    for p in _files():
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                where[node.name].append(_rel(p))
    repeated = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert {n: ps for n, ps in repeated.items() if n not in SHARED_DEFINITIONS} == {}
    assert set(SHARED_DEFINITIONS) <= set(repeated), "an entry of SHARED_DEFINITIONS no longer repeats: remove it"


def _module_of(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = ["fastpo", *parts] if parts[0] == "envs_native" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazy_imports(path: pathlib.Path) -> list:
    """The import statements of fastpo modules (relative ones resolved) inside a function of
    `path`: [(line, first line of its group of consecutive import statements, module)]."""
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path).rpartition(".")[0]
    found, ends = [], {}

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                ends[child.end_lineno] = child.lineno
                if isinstance(child, ast.Import):
                    modules = [a.name for a in child.names]
                else:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1] if child.level else []
                    modules = [".".join(base + ([child.module] if child.module else []))]
                if in_function and any(m.split(".")[0] == "fastpo" for m in modules):
                    found.append((child.lineno, modules[0]))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    out = []
    for line, module in found:
        first = line
        while first - 1 in ends:
            first = ends[first - 1]
        out.append((line, first, module))
    return out


def _allowance(rel: str) -> int:
    keys = [k for k in LAZY_IMPORTS if rel == k or (k.endswith("/") and rel.startswith(k))]
    return LAZY_IMPORTS[max(keys, key=len)] if keys else 0


def test_imports_of_fastpo_modules_are_at_the_top():
    """144 imports of fastpo modules sat inside functions, hiding what a module depends on. One
    stays there only where a heavy or optional dependency must not load with its importer (the
    command line before torch, `fastpo.envs` before Numba, the kernels before Triton) or a cycle
    needs it, and says which in a comment; the count per module is LAZY_IMPORTS's at most."""
    counts = collections.Counter()
    unsaid = []
    for p in _files():
        rel = _rel(p)
        key = next((k for k in LAZY_IMPORTS if k.endswith("/") and rel.startswith(k)), rel)
        lines = p.read_text().splitlines()
        for line, first, module in _lazy_imports(p):
            counts[key] += 1
            if key.endswith("/"):
                continue  # fastpo/config/: another change's
            if not (_LAZY_REASON.search(lines[line - 1]) or _LAZY_REASON.search(lines[first - 2])):
                unsaid.append(f"{rel}:{line} {module}")
    over = {k: n for k, n in counts.items() if n > _allowance(k)}
    assert over == {}, f"in-function imports of fastpo modules above LAZY_IMPORTS: {over}"
    assert unsaid == [], "a lazy import without a comment naming its reason"


def test_no_module_of_fastpo_is_over_600_lines():
    """A module over 600 lines holds several concerns (fastpo/rollout/multiturn.py held the turn's
    scoring beside the loop; fastpo/evaluate.py the evaluation beside `fastpo eval`'s settings)."""
    long = {_rel(p): n for p in sorted((ROOT / "fastpo").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert {k: n for k, n in long.items() if k not in LONG_MODULES} == {}
