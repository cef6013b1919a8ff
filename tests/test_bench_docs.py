"""``bench/README.md`` lists every benchmark and ``docs/bench-results.md`` holds a section for each (issue 40): a new
script is described where a reader looks, and a removed one leaves no entry behind (its figures stay in the results
under "Retired one-offs", one heading level down). Checked on the files, no process started."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "bench" / "README.md"
RESULTS = ROOT / "docs" / "bench-results.md"


def _benchmarks() -> set[str]:
    """The benchmark scripts: ``bench/*.py`` and ``bench/*.sh`` (``bench/lib/`` holds helpers, not benchmarks)."""
    return {f"bench/{p.name}" for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"}


def _named(text: str) -> set[str]:
    """Every ``bench/<name>.py`` or ``.sh`` a text names."""
    return set(re.findall(r"\bbench/[a-z_]+\.(?:py|sh)\b", text))


def test_the_readme_lists_every_benchmark_and_no_other() -> None:
    named = _named(README.read_text(encoding="utf-8"))
    assert _benchmarks() - named == set(), "benchmarks bench/README.md does not describe"
    assert named - _benchmarks() == set(), "bench/README.md names scripts that do not exist"


def test_every_benchmark_has_a_results_section_the_readme_links_to() -> None:
    results = RESULTS.read_text(encoding="utf-8")
    headed = {name for line in results.splitlines() if line.startswith("## ") for name in _named(line)}
    assert _benchmarks() - headed == set(), "benchmarks without a '## bench/...' section in docs/bench-results.md"
    assert headed - _benchmarks() == set(), "'## bench/...' sections of removed scripts (retire them under '###')"
    anchors = {re.sub(r"[^a-z0-9_ -]", "", line[3:].strip().lower()).replace(" ", "-")
               for line in results.splitlines() if line.startswith("## ")}
    links = set(re.findall(r"\(\.\./docs/bench-results\.md#([^)]+)\)", README.read_text(encoding="utf-8")))
    assert links, "bench/README.md links to no section of docs/bench-results.md"
    assert links - anchors == set(), "bench/README.md links to sections docs/bench-results.md does not have"
