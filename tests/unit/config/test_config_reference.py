"""docs/configuration.md's key table is generated from the config's field documentation
(tools/config_reference.py): every field is documented, and a stale page fails here."""
import dataclasses
import importlib.util
import pathlib

import pytest

from fastpo.config import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _tool():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_config_field_has_its_documentation_beside_it():
    """Issue 57: each field of every section carries its own `doc` (no `Attributes:` block in a
    class docstring, far from the fields, to keep in step with them)."""
    tool = _tool()
    assert set(tool.SECTIONS) == {f.name for f in dataclasses.fields(TrainConfig)} - {"preset"}  # every section
    for section in ("root", *tool.SECTIONS):
        cls = TrainConfig if section == "root" else tool.section_class(section)
        docs = tool.field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, section
        short = [name for name, text in docs.items() if len(text) <= 10]
        assert short == [], (section, short)
        for klass in cls.__mro__[:-1]:
            assert "Attributes:" not in (klass.__doc__ or ""), klass.__name__


def test_a_field_without_documentation_is_refused(monkeypatch):
    """The generator names a field that has no `doc` instead of writing an empty meaning."""
    from fastpo.config.fields import checked, key

    @dataclasses.dataclass
    class Section:
        told: int = checked(1, doc="a documented key, for this test.")
        untold: int = key(2, doc="")

    tool = _tool()
    monkeypatch.setattr(tool, "section_class", lambda section: Section)
    with pytest.raises(SystemExit, match=r"Section.untold has no documentation"):
        tool.table()


def test_configuration_page_is_not_stale():
    assert _tool().main(["--check"]) == 0, "docs/configuration.md is stale: run python tools/config_reference.py"


def test_a_stale_page_is_caught_and_regenerated(tmp_path, capsys):
    tool = _tool()
    page = tmp_path / "configuration.md"
    text = (ROOT / "docs" / "configuration.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `rollout.group_size`"))
    page.write_text(text.replace(row, row.replace("| `16` |", "| `8` |")))
    assert tool.main(["--page", str(page), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert tool.main(["--page", str(page)]) == 0
    assert page.read_text() == text
    page.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="markers not found"):
        tool.main(["--page", str(page), "--check"])


def test_the_table_shows_defaults_allowed_values_and_rules():
    table = _tool().table()
    assert "| `algorithm.adv_estimator` | `gae` | `gae` \\| `grpo` \\|" in table
    assert "| `rollout.group_size` | `16` | int; must be >= 1 |" in table
    assert "| `algorithm.kl_in_reward` | `null` | bool or null |" in table
    # the sections of `fastpo sft` and `fastpo dagger` are keys like the others (issue 57)
    assert "| `sft.trajectories` | `128` | int; must be >= 1 |" in table
    assert "| `dagger.history` | `own` | str; must be 'own' or 'expert' |" in table
