"""Module boundaries (issue 17): who may import whom, and where one rule lives. Read with ast,
nothing imported."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    """The CLI and `fastpo sft` (the SFT trainer is the trainer with SFT iterations) import
    the trainer; the public API (fastpo/__init__.py) reaches it only on first use of
    `fastpo.train`, through its table of lazy exports; nothing else does."""
    users = [p.relative_to(ROOT).as_posix() for p in _sources()
             if p.parent.name != "trainer" and any(m == "fastpo.trainer" or m.startswith("fastpo.trainer.")
                                                   for m in _imports(p))]
    assert users == ["fastpo/cli.py", "fastpo/sft.py"]
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
    """Config files are read in one place (fastpo.config_files); the other YAML reader is the
    value of one dotted override (fastpo.config_fields.parse_override)."""
    readers = [p.relative_to(ROOT).as_posix() for p in _sources() if "yaml.safe_load" in p.read_text()]
    assert readers == ["fastpo/config_fields.py", "fastpo/config_files.py"]
    assert "yaml.safe_load(raw)" in (ROOT / "fastpo" / "config_fields.py").read_text()
    assert "open(" not in (ROOT / "fastpo" / "config_fields.py").read_text()


def test_one_lm_head_lookup():
    for p in [*_sources(), *(ROOT / "bench").glob("*.py")]:
        text = p.read_text()
        assert "get_output_embeddings().weight" not in text, p.name


def test_registry_names_are_the_configs_allowed_values():
    """The config's allowed estimators and loss aggregations are the registry's names, each
    estimator has one implementation, and the registry module imports no torch."""
    import typing

    from fastpo import config, registry
    from fastpo.algorithms import estimators

    hints = typing.get_type_hints(config.AlgorithmConfig)
    assert typing.get_args(hints["adv_estimator"]) == tuple(registry.ESTIMATORS)
    assert typing.get_args(hints["loss_agg"]) == tuple(registry.LOSS_AGGREGATIONS)
    assert typing.get_args(hints["value_loss_agg"]) == tuple(registry.LOSS_AGGREGATIONS)
    assert set(estimators._ESTIMATORS) == set(registry.ESTIMATORS)
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
