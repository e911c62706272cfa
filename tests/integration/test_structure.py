"""Module boundaries (issue 17): who may import whom, and where one rule lives. Read with ast,
nothing imported."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports (top level or inside functions), as dotted names."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _sources():
    return sorted((ROOT / "fastpo").rglob("*.py"))


def test_only_the_cli_and_the_public_api_import_the_trainer():
    """The CLI and `fastpo sft` (the SFT trainer runs on the trainer's parts and loop; its data
    is a TrainBatch) import the trainer; the public API (fastpo/__init__.py) reaches it only on
    first use of `fastpo.train`, through its table of lazy exports; nothing else does."""
    users = [p.relative_to(ROOT).as_posix() for p in _sources()
             if p.parent.name != "trainer" and any(m == "fastpo.trainer" or m.startswith("fastpo.trainer.")
                                                   for m in _imports(p))]
    assert users == ["fastpo/cli/sft.py", "fastpo/cli/train.py", "fastpo/sft/data.py", "fastpo/sft/trainer.py"]
    init = ast.parse((ROOT / "fastpo" / "__init__.py").read_text())
    table = next(n.value for n in init.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "_EXPORTS")
    exports = ast.literal_eval(table)
    assert {name for name, (module, _) in exports.items() if module.startswith("fastpo.trainer")} == {"train"}


def test_the_trainer_package_imports_nothing_from_the_cli():
    files = sorted((ROOT / "fastpo" / "trainer").glob("*.py"))
    assert len(files) >= 6
    for p in files:
        assert not any(m == "fastpo.cli" or m.startswith("fastpo.cli.") for m in _imports(p)), p.name


def test_algorithms_take_plain_arguments():
    for p in (ROOT / "fastpo" / "algorithms").glob("*.py"):
        assert not any(m.startswith("fastpo.config") for m in _imports(p)), p.name


def test_config_yaml_is_read_in_config_only():
    """Config files are read in one place (fastpo.config.files); the other YAML reader is the
    value of one dotted override (fastpo.config.fields.parse_override)."""
    readers = [p.relative_to(ROOT).as_posix() for p in _sources() if "yaml.safe_load" in p.read_text()]
    assert readers == ["fastpo/config/fields.py", "fastpo/config/files.py"]
    assert "yaml.safe_load(raw)" in (ROOT / "fastpo" / "config" / "fields.py").read_text()
    assert "open(" not in (ROOT / "fastpo" / "config" / "fields.py").read_text()


def test_one_lm_head_lookup():
    for p in [*_sources(), *(ROOT / "bench").glob("*.py")]:
        text = p.read_text()
        assert "get_output_embeddings().weight" not in text, p.name


def test_registry_names_are_the_configs_allowed_values():
    """The config's allowed estimators and loss aggregations are the registry's names, its
    policy losses the kernels' registered ones, each estimator has one implementation, and
    the registry module imports no torch."""
    import typing

    from fastpo import config, registry
    from fastpo.algorithms import estimators

    hints = typing.get_type_hints(config.AlgorithmConfig)
    assert typing.get_args(hints["adv_estimator"]) == tuple(registry.ESTIMATORS)
    loss_agg, none = typing.get_args(hints["loss_agg"])  # Optional: null = the estimator's own
    assert typing.get_args(loss_agg) == tuple(registry.LOSS_AGGREGATIONS) and none is type(None)
    assert all(e.loss_agg in registry.LOSS_AGGREGATIONS for e in registry.ESTIMATORS.values())
    assert typing.get_args(hints["value_loss_agg"]) == tuple(registry.LOSS_AGGREGATIONS)
    assert set(estimators._ESTIMATORS) == set(registry.ESTIMATORS)
    from fastpo.kernels import POLICY_LOSSES

    assert config.AlgorithmConfig.__dataclass_fields__["policy_loss"].metadata["choices"]() == tuple(POLICY_LOSSES)
    assert not any(m.split(".")[0] == "torch" for m in _imports(ROOT / "fastpo" / "registry.py"))
    import subprocess
    import sys

    loaded = subprocess.run([sys.executable, "-c", "import sys, fastpo.config; print('torch' in sys.modules)"],
                            capture_output=True, text=True, cwd=ROOT)
    assert loaded.stdout.strip() == "False", loaded.stdout + loaded.stderr


def test_no_estimator_name_is_compared_outside_the_registry():
    """The trainer asks an estimator's facts (fastpo.registry), it does not compare its name."""
    for p in [ROOT / "fastpo" / "trainer.py", *(ROOT / "fastpo" / "trainer").glob("*.py")]:
        if p.exists():
            text = p.read_text()
            assert "adv_estimator ==" not in text and "adv_estimator in" not in text, p.name


def test_a_policy_loss_is_named_only_where_it_is_registered():
    """Issue 57 item 3: a policy loss is one registered function with its facts
    (fastpo/kernels/losses.py); nothing else in fastpo/ or bench/ compares a loss's name or
    lists loss names (a tuple, list, set or dict of two or more): they read the facts."""
    from fastpo.kernels import POLICY_LOSSES

    names = set(POLICY_LOSSES)
    found = []
    for p in [*_sources(), *(ROOT / "bench").glob("*.py")]:
        if p == ROOT / "fastpo" / "kernels" / "losses.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                consts = [c for c in items if isinstance(c, ast.Constant) and c.value in names]
                consts = consts if len(consts) >= 2 else []
            else:
                continue
            found += [f"{p.relative_to(ROOT)}:{c.lineno} {c.value!r}" for c in consts]
    assert found == []


def _module_name(p: pathlib.Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: pathlib.Path) -> str:
    """The package a module belongs to (an __init__.py: its own)."""
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _from_module(path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module of `from ... import` in `path` (a relative one resolved)."""
    if not node.level:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_imports(path: pathlib.Path, modules: frozenset = frozenset(), annotations: bool = False) -> set[str]:
    """Every module `path` imports, relative imports resolved, without those under `if
    TYPE_CHECKING:` (annotations only, never run) unless `annotations`. A module of package PKG
    doing `from PKG import name` where PKG.name is one of `modules` (a sibling, e.g. `from . import
    chunked` inside fastpo/kernels/) imports that submodule, not PKG's __init__ (already
    initialising whenever one of its modules runs)."""
    package = _package(path)
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING" and not annotations:
            node.body = []
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(path, node)
            names = {f"{module}.{a.name}" for a in node.names}
            out |= names if module == package and names <= modules else {module} | names
    return out


def _import_cycles(paths: list[pathlib.Path], annotations: bool = False) -> list[list[str]]:
    """The import cycles among the modules at `paths` (imports inside functions count; those
    under `if TYPE_CHECKING:` only with `annotations`): the strongly connected components of
    more than one module of the import graph, each as sorted module names."""
    mods = {_module_name(p): p for p in paths}
    graph = {m: {n for n in _runtime_imports(p, frozenset(mods), annotations) if n in mods and n != m}
             for m, p in mods.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in mods:
        if m not in index:
            visit(m)
    return cycles


def test_no_import_cycle_in_fastpo():
    """No two fastpo modules import each other, directly or through others (imports inside
    functions count: a cycle hidden in a function is still one; those under `if
    TYPE_CHECKING:` do not run), found as the strongly connected components of the graph."""
    assert _import_cycles(_sources()) == []


def test_no_import_cycle_in_the_config_not_even_for_annotations():
    """Issue 57: fastpo.config's modules import one another in one direction (each only those
    before it in: fields, imitation, algorithm, schema, files, presets, members, usercode,
    validation, loading), even counting the imports under `if TYPE_CHECKING:` that a type
    checker follows (config.files <-> presets <-> schema was such a cycle)."""
    config = sorted((ROOT / "fastpo" / "config").glob("*.py"))
    assert len(config) >= 8
    assert _import_cycles(config, annotations=True) == []


def test_a_type_only_import_cycle_is_found(tmp_path, monkeypatch):
    """The check above sees a cycle made only by an import for annotations."""
    import sys

    pkg = tmp_path / "fastpo" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from fastpo.demo.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fastpo.demo.a import A\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    paths = sorted(pkg.glob("*.py"))
    assert _import_cycles(paths) == []
    assert _import_cycles(paths, annotations=True) == [["fastpo.demo.a", "fastpo.demo.b"]]


def test_no_file_in_the_config_is_over_600_lines():
    """Issue 57: the configuration's modules stay short (config/schema.py was 1,053 lines of
    schema, field documentation, validation, loading and user-code import)."""
    long = [f"{p.name} ({n} lines)" for p in sorted((ROOT / "fastpo" / "config").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600]
    assert long == []


def test_no_private_name_is_imported_from_another_module():
    """A name with a leading underscore is its module's own: another fastpo module that needs
    it gets a public name (or the rule moves where both can read it). A private module is its
    package's own: its siblings may import it (`from . import _triton` in fastpo/kernels/)."""
    found = []
    mods = {_module_name(p) for p in _sources()}
    for p in _sources():
        package = _package(p)
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and _from_module(p, node).startswith("fastpo"):
                module = _from_module(p, node)
                found += [f"{_module_name(p)} <- {module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")
                          and not (module == package and f"{module}.{a.name}" in mods)]
    assert found == []


def test_the_trainer_is_composed_not_mixed():
    """The StarPO trainer and the SFT trainer each derive from the run trainer alone (no
    mixins; SFT is not a StarPO trainer), and hold their parts as attributes."""
    from fastpo.sft import SFTTrainer
    from fastpo.trainer.loop import RunTrainer
    from fastpo.trainer.step import Trainer

    assert Trainer.__bases__ == (RunTrainer,) and SFTTrainer.__bases__ == (RunTrainer,)
    assert RunTrainer.__bases__ == (object,)
    assert not issubclass(SFTTrainer, Trainer)


def test_functions_in_the_trainer_are_short():
    """Every function in fastpo/trainer/ fits on a screen (at most 60 lines with its docstring),
    so one iteration reads as named steps."""
    long = []
    for p in (ROOT / "fastpo" / "trainer").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{p.name}:{node.name} ({n} lines)")
    assert long == []


def test_no_module_re_exports_another_modules_names():
    """A name is imported from the module that defines it: no module outside the packages'
    __init__.py files keeps imports it does not use for others to import (`noqa: F401`); the
    one such import left is the probe that SGLang is installed."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in _sources() if p.name != "__init__.py"
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "noqa: F401" in line and line.strip() != "import sglang  # noqa: F401"]
    assert found == []


def test_sft_is_a_package_of_short_modules_that_names_no_game():
    """Issue 57: fastpo/sft.py (895 lines of five concerns: a config system of its own, a data
    reader, experts with branches on game names, the metric, the trainer) and fastpo/dagger.py
    (731) are the package fastpo/sft/, each module at most 600 lines; no module of it names a
    built-in game (each game's expert is its own `expert`, asked as a user game's is)."""
    from fastpo.envs import BUILTIN

    assert not (ROOT / "fastpo" / "sft.py").exists() and not (ROOT / "fastpo" / "dagger.py").exists()
    files = sorted((ROOT / "fastpo" / "sft").glob("*.py"))
    assert {p.stem for p in files} >= {"config", "data", "experts", "trainer", "labels", "dagger"}
    long = [f"{p.name} ({n} lines)" for p in files if (n := len(p.read_text().splitlines())) > 600]
    assert long == []
    named = [f"{p.name}:{node.lineno} {node.value!r}" for p in files for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Constant) and node.value in BUILTIN]
    assert named == []
