"""The user docs stay apart from the experiment log (issue 57, item 7): a README short enough to
read, a results table of headline rows that link to their pages, user pages (docs/*.md) without
dated experiment entries, and every study of the log (docs/experiments/) in its index."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LOG = ROOT / "docs" / "experiments"
README_MAX_LINES = 125
RESULT_ROWS_MAX = 12
RESULT_ROW_MAX_CHARS = 220
# a dated entry: "(2026-12-03, issue 33)", "(2026-12-05, later)", "(issue 28, item 2)" and the like
_DATED = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\bissue \d+")


def _without_code(text):
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _headings(path):
    return re.findall(r"^#{1,6} (.*)$", _without_code(path.read_text(encoding="utf-8")), flags=re.M)


def _results_rows():
    """The body rows of the README's results table (the first table under "## Results")."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Results\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert section, "README.md has no '## Results' section"
    table = [line for line in section.group(1).splitlines() if line.startswith("|")]
    return table[2:]  # header and separator


def test_the_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n < README_MAX_LINES, f"README.md has {n} lines (keep it under {README_MAX_LINES}: details go to docs/)"


def test_the_readme_results_are_a_few_short_rows_with_links():
    rows = _results_rows()
    assert 1 <= len(rows) <= RESULT_ROWS_MAX, f"{len(rows)} results rows (at most {RESULT_ROWS_MAX}: docs/results.md has the rest)"
    long = [f"{len(r)} characters: {r[:80]}..." for r in rows if len(r) > RESULT_ROW_MAX_CHARS]
    assert not long, "results rows over %d characters:\n%s" % (RESULT_ROW_MAX_CHARS, "\n".join(long))
    unlinked = [r[:80] for r in rows if not re.search(r"\]\((docs/[^)]+)\)", r)]
    assert not unlinked, "results rows without a link to their page:\n" + "\n".join(unlinked)


def test_no_dated_experiment_headings_in_the_user_pages():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    dated = [f"{p.relative_to(ROOT)}: {h}" for p in pages for h in _headings(p) if _DATED.search(h)]
    assert not dated, "dated experiment entries belong in docs/experiments/:\n" + "\n".join(dated)


def test_every_study_is_listed_in_the_index():
    index = LOG / "README.md"
    assert index.is_file(), "docs/experiments/README.md (the experiment log's index) is missing"
    text = index.read_text(encoding="utf-8")
    studies = sorted(p.name for p in LOG.glob("*.md") if p.name != "README.md")
    assert studies, "the experiment log holds no study"
    listed = set(re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text))
    missing = [s for s in studies if s not in listed]
    assert not missing, f"studies not listed in docs/experiments/README.md: {missing}"
    gone = sorted(s for s in listed if not (LOG / s).is_file())
    assert not gone, f"docs/experiments/README.md lists studies that do not exist: {gone}"


def test_the_dated_pattern_catches_the_old_headings():
    """The check above can fail: the headings the log took over are what it refuses."""
    for h in ("1,536 levels: 0.52 and 0.58 on Sokoban from SFT alone (2026-12-03, issue 33)",
              "The largest gap closed: page faults in the update (issue 28, item 2)",
              "The elementwise stages as compiled C (2026-12-03, later)"):
        assert _DATED.search(h), h
    assert not _DATED.search("DAgger: the states the model reaches (`fastpo dagger`)")
