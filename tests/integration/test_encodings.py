"""Text files and the console under a locale whose encoding is not UTF-8 (issue 25 item 11).

Game grids hold characters outside ASCII (`√`): every text file fastpo writes or reads names
its encoding, and the console degrades instead of crashing. A static check (every text-mode
`open`, `read_text`, `write_text`, text temporary file, `os.fdopen` and `subprocess` call with
`text=True` in the shipped code says `encoding=`) and a whole tiny FrozenLake run plus
`fastpo eval` under `LC_ALL=C` with Python's UTF-8 mode and locale coercion off.
"""
import pathlib
import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
#: The shipped code: the package, its mapped subpackages, the scripts users run and the experiment log's.
FOLDERS = ("fastpo", "envs_native", "tools", "experiments", "bench", "examples")
_SUBPROCESS = {"run", "Popen", "check_output", "check_call", "call"}
_TEMPFILES = {"NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile"}


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _text_mode(call: ast.Call, pos: int, default: str) -> bool:
    """Whether the call opens in text mode: its mode (positional `pos` or `mode=`) has no "b";
    a mode that is not a literal counts as text (it may be)."""
    mode = _kw(call, "mode")
    if mode is None and len(call.args) > pos:
        mode = call.args[pos]
    if mode is None:
        return "b" not in default
    return not (isinstance(mode, ast.Constant) and isinstance(mode.value, str) and "b" in mode.value)


def text_io_without_encoding(source: str) -> list[int]:
    """Line numbers of the calls in `source` that read or write text in the locale's encoding:
    text-mode `open(...)` / `io.open` / `x.open(...)` (pathlib) / `os.fdopen`, `x.read_text()`,
    `x.write_text()`, text temporary files, and subprocess calls with `text=True` or
    `universal_newlines=True`, none of them passing `encoding=`. `**kwargs` counts as passing it."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        if _kw(node, "encoding") is not None or any(k.arg is None for k in node.keywords):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        if name == "open" and owner not in ("os", "Image", "gzip", "tarfile", "zipfile", "shelve", "dbm"):
            # builtins.open(file, mode), io.open, pathlib's Path.open(mode)
            if _text_mode(node, 0 if isinstance(f, ast.Attribute) and owner not in ("io", "builtins") else 1, "r"):
                bad.append(node.lineno)
        elif name == "fdopen" and owner == "os":
            if _text_mode(node, 1, "r"):
                bad.append(node.lineno)
        elif name in ("read_text", "write_text"):
            bad.append(node.lineno)
        elif name in _TEMPFILES:
            if _text_mode(node, 0, "w+b"):
                bad.append(node.lineno)
        elif name in _SUBPROCESS and owner == "subprocess":
            flag = _kw(node, "text") or _kw(node, "universal_newlines")
            if isinstance(flag, ast.Constant) and flag.value:
                bad.append(node.lineno)
    return sorted(bad)


def test_the_checker_flags_locale_text_io_and_passes_the_rest():
    src = ("open(p)\nopen(p, 'w')\nopen(p, mode=m)\npath.read_text()\nos.fdopen(fd, 'w')\n"
           "tempfile.NamedTemporaryFile('w')\nsubprocess.run(c, text=True)\n"
           "open(p, 'rb')\nopen(p, encoding='utf-8')\nos.open(p, os.O_RDONLY)\npath.open('wb')\n"
           "tempfile.NamedTemporaryFile()\nsubprocess.run(c, capture_output=True)\nopen(p, **kw)\n"
           "subprocess.run(c, text=True, encoding='utf-8')\n")
    assert text_io_without_encoding(src) == [1, 2, 3, 4, 5, 6, 7]


def test_shipped_code_names_the_encoding_of_every_text_file():
    found = []
    for folder in FOLDERS:
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(base, name)
                    with open(path, encoding="utf-8") as f:
                        found += [f"{os.path.relpath(path, ROOT)}:{n}" for n in text_io_without_encoding(f.read())]
    assert not found, "text read or written in the locale's encoding (pass encoding='utf-8'): " + ", ".join(found)


#: A locale whose encoding is ASCII, with Python's own switch to UTF-8 under the C locale off
#: (as on a container that sets them, or Windows' code pages for characters outside them).
ASCII_LOCALE = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "LC_CTYPE", "LC_ALL", "LANG")},
                "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "OMP_NUM_THREADS": "1"}


def _fastpo(*args):
    p = subprocess.run([sys.executable, "-m", "fastpo", *args], env=ASCII_LOCALE, stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=600)
    said = (p.stdout + p.stderr).decode("utf-8", "replace")
    assert p.returncode == 0 and "Traceback" not in said, said[-4000:]
    return said


def test_a_frozenlake_run_and_its_eval_under_an_ascii_locale(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "import locale; print(locale.getpreferredencoding(False))"],
                           env=ASCII_LOCALE, capture_output=True, encoding="utf-8")
    assert "utf" not in probe.stdout.lower(), probe.stdout  # the locale really is not UTF-8
    out = tmp_path / "run"
    _fastpo("train", "--env", "frozenlake", "--model", "random:tiny-llama", "--preset", "tiny", "--out", str(out),
            "--iterations", "1", "trainer.eval_every=1", "trainer.num_samples=2", "trainer.plots=false")
    samples = [p for p in (out / "samples").iterdir()]
    assert samples and all("√" in p.read_text(encoding="utf-8") for p in samples)  # the grid's symbols
    json.loads((out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()[-1])
    said = _fastpo("eval", "--model", str(out), "--seeds", "2", "--samples", str(tmp_path / "eval_samples"),
                   "--json", str(tmp_path / "eval.json"))
    assert "success_rate" in said
    assert "√" in next((tmp_path / "eval_samples").iterdir()).read_text(encoding="utf-8")
    assert json.loads((tmp_path / "eval.json").read_text(encoding="utf-8"))


def test_the_cli_console_writes_escapes_where_the_locale_cannot_encode():
    code = ("import sys; from fastpo.cli.processes import degrade_console; degrade_console(); "
            "from rich.console import Console; Console().print('P \\u221a _'); print('grid: \\u221a', file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], env=ASCII_LOCALE, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode("utf-8", "replace")
    assert b"P \\u221a _" in p.stdout and b"grid: \\u221a" in p.stderr
