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
    """The CLI imports the trainer; the public API (fastpo/__init__.py) reaches it only on
    first use of `fastpo.train`, through its table of lazy exports; nothing else does."""
    users = [p.relative_to(ROOT).as_posix() for p in _sources()
             if p.name != "trainer.py" and any(m == "fastpo.trainer" or m.startswith("fastpo.trainer.")
                                                 for m in _imports(p))]
    assert users == ["fastpo/cli.py"]
    init = ast.parse((ROOT / "fastpo" / "__init__.py").read_text())
    table = next(n.value for n in init.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "_EXPORTS")
    exports = ast.literal_eval(table)
    assert {name for name, (module, _) in exports.items() if module.startswith("fastpo.trainer")} == {"train"}


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
