"""Links between the README and docs/ point at files and headings that exist.

Result rows link to the docs section that holds their table; renaming a heading (its
figures change) silently breaks the link unless this checks it.
"""
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_LINK = re.compile(r"\]\(([^)\s]*)\)")


def _markdown_files():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # the experiment log too


def _slug(heading):
    # GitHub's rule: lower case, drop punctuation except '-' and '_', spaces become '-'.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, flags=re.M)}


def _local_links(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        yield file_part, anchor


def test_slug_follows_github_for_a_results_heading():
    assert _slug("1,536 levels: 0.52 and 0.58 on Sokoban (2026-12-03, issue 33)") == (
        "1536-levels-052-and-058-on-sokoban-2026-12-03-issue-33")


def test_every_local_link_names_an_existing_file_and_heading():
    broken = []
    for md in _markdown_files():
        for file_part, anchor in _local_links(md):
            target = md if not file_part else Path(os.path.normpath(md.parent / file_part))
            if not target.exists():
                broken.append(f"{md.relative_to(ROOT)}: {file_part} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{md.relative_to(ROOT)}: {file_part}#{anchor} (no such heading)")
    assert not broken, "\n".join(broken)
