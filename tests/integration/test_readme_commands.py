"""Every command block of README.md runs as written (issue 58): the quick start, the smoke run,
the own-game commands, the SFT commands and the Python example, in the order a reader meets
them, in one fresh folder, each exiting 0. A command too long for the suite is listed in LONG
with the time it was measured to take, and the README states that time beside it; a README
command that is neither run here nor listed fails the test.

The commands run in this process (`fastpo.cli.main`, the Python block with `exec`) from an
empty working folder, so `runs/...` lands there; the repository root is importable for
`examples.guess_number`, as it is for a reader in a checkout. The SFT data command's
`my_chats.jsonl` (the README's placeholder for your file) is written first: 8 conversations.
"""
from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Commands not run here: what each was measured to take, and the README's words for it.
LONG = {
    "make train": ("16.7 min at one thread beside three other runs (README results row); about 9 min on 2 quiet "
                   "cores", "about 9 minutes on 2 cores"),
    "make test": ("the whole suite, 2 workers: 19 min 22 s on the quiet 2-core development machine (28 min 28 s "
                  "beside a make-train run and the golden runs), 2026-12-06", "about 19 minutes on 2 cores"),
    "fastpo dagger --env frozenlake": ("its parts on 2 threads: SFT 1 h 36 min, then per round a 7-minute rollout and 25 "
                                       "to 31 min of training (docs/sft.md)", "about 3 h 20 min on 2 threads"),
    "fastpo sft --env sokoban": ("55 min on 2 quiet cores, 1 h 53 min on a host twice as slow per step",
                                 "about 55 minutes on 2"),
}


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of README.md, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def commands(block: str) -> list[str]:
    """The command lines of a bash block, comments cut."""
    out = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def test_every_readme_block_is_run_here_or_listed_as_long():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    langs = [lang for lang, _ in readme_blocks()]
    assert set(langs) <= {"bash", "python"} and langs.count("python") == 1, langs
    every = [c for lang, b in readme_blocks() if lang == "bash" for c in commands(b)]
    for cmd in every:
        assert cmd in LONG or cmd.startswith("fastpo "), f"a README command neither run nor listed as long: {cmd}"
    for cmd, (_, words) in LONG.items():
        assert cmd in every, f"LONG lists {cmd!r}, which the README no longer has"
        assert words in readme, f"the README does not state {cmd!r}'s time ({words!r})"


@pytest.mark.slow
def test_the_readme_commands_run_as_written(tmp_path, monkeypatch, capsys):
    from fastpo.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # `examples.guess_number`, as from a checkout
    chats = [{"messages": [{"role": "user", "content": f"Which way from cell {i}?"},
                           {"role": "assistant", "content": "Right</answer>"}]} for i in range(8)]
    (tmp_path / "my_chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    ran = []
    for lang, block in readme_blocks():
        if lang == "python":
            exec(compile(block, "README.md (Python block)", "exec"), {})
            ran.append("python block")
            continue
        for cmd in commands(block):
            if cmd in LONG:
                continue
            argv = shlex.split(cmd)
            assert argv[0] == "fastpo"
            start = time.perf_counter()
            status = main(argv[1:])
            said = capsys.readouterr()
            assert status == 0, f"{cmd}: exit {status}\n{said.err[-3000:]}\n{said.out[-3000:]}"
            ran.append(cmd)
            with capsys.disabled():  # with -s: what each command costs the suite
                print(f"{time.perf_counter() - start:6.1f} s  {cmd}")
    assert len(ran) >= 6, ran
    # what they wrote is where the README says
    for folder in ("runs/smoke", "runs/guess", "runs/ta", "runs/sft-guess", "runs/sft-chats", "runs/api"):
        assert (tmp_path / folder / "checkpoints").is_dir(), folder
