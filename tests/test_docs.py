"""``docs/DECISIONS.md`` stays a register of current decisions that code can cite (issue 40), not a work log.

Checked on the file as committed, no process started:

* it is under 600 lines;
* no heading is a dated log ("Session of ...", a date, a clock time): entries are grouped by topic;
* every bullet of a topic section is an entry ``- **D-nnn** (YYYY-MM-DD) ...``, an entry that absorbed others
  listing all their ids (``- **D-190/D-193** (...)``), and no id heads two entries;
* every ``D-nnn`` cited anywhere in the repository (code, tests, docs, deploy files, DECISIONS itself: ``git grep``
  over tracked and untracked, not ignored, files) heads an entry, so a citation never dangles.

And the repository's documents are its own: no tracked file cites a document that lives outside it (the design
brief and reference notes beside a checkout), so a reader can follow every citation (issue 40). Architecture is
``docs/ARCHITECTURE.md``; vLLM is cited by its source paths.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DECISIONS = ROOT / "docs" / "DECISIONS.md"
MAX_LINES = 600

DECISION_ID = re.compile(r"\bD-\d{3}\b")
ENTRY = re.compile(r"^- \*\*(D-\d{3}(?:/D-\d{3})*)\*\* \(\d{4}-\d{2}-\d{2}\) ")
# what makes a heading a dated log: the words of the old session headings, an ISO date, a clock time, a month name
DATED = re.compile(r"\bsession\b|\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}:\d{2}\b|\bUTC\b|"
                   r"\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.? \d", re.IGNORECASE)


def _lines() -> list[str]:
    return DECISIONS.read_text(encoding="utf-8").splitlines()


def _entry_ids(lines: list[str]) -> list[str]:
    """The ids heading entries, in file order (an id of a merged entry once per entry it heads)."""
    ids: list[str] = []
    for line in lines:
        m = ENTRY.match(line)
        if m:
            ids.extend(m.group(1).split("/"))
    return ids


def test_decisions_is_under_600_lines() -> None:
    n = len(_lines())
    assert n < MAX_LINES, f"docs/DECISIONS.md has {n} lines (limit {MAX_LINES}): shorten or merge entries, move runs " \
                          "to docs/bench-results.md"


def test_no_heading_is_a_dated_log() -> None:
    dated = [f"docs/DECISIONS.md:{i}: {line}" for i, line in enumerate(_lines(), 1)
             if line.startswith("#") and DATED.search(line)]
    assert not dated, "headings name topics, not sessions or dates:\n" + "\n".join(dated)


def test_every_bullet_is_a_dated_entry_and_no_id_heads_two() -> None:
    lines = _lines()
    first_section = next(i for i, line in enumerate(lines) if line.startswith("## "))
    loose = [f"docs/DECISIONS.md:{i + 1}: {line[:100]}" for i, line in enumerate(lines)
             if i > first_section and line.startswith("- ") and not ENTRY.match(line)]
    assert not loose, "bullets without `- **D-nnn** (YYYY-MM-DD) `:\n" + "\n".join(loose)
    ids = _entry_ids(lines)
    twice = sorted({i for i in ids if ids.count(i) > 1})
    assert not twice, f"ids heading more than one entry: {twice}"
    assert ids, "no entries found in docs/DECISIONS.md"


def _citations() -> list[tuple[str, str]]:
    """``(where, id)`` for every ``D-nnn`` in the repository's text files, ``where`` being ``path:line``."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the citations are found with git grep")
    result = subprocess.run(
        ["git", "grep", "-n", "-I", "--untracked", "-E", r"D-[0-9]{3}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode in (0, 1), result.stderr  # 1: no match at all
    found: list[tuple[str, str]] = []
    for hit in result.stdout.splitlines():
        path, line_no, text = hit.split(":", 2)
        found.extend((f"{path}:{line_no}", cited) for cited in DECISION_ID.findall(text))
    return found


def test_every_cited_decision_has_an_entry() -> None:
    known = set(_entry_ids(_lines()))
    dangling = [f"{where}: {cited}" for where, cited in _citations() if cited not in known]
    assert not dangling, "D-ids cited but heading no entry of docs/DECISIONS.md (merged entries list every id " \
                         "they hold):\n" + "\n".join(dangling)


# Citations of documents outside the repository: the design brief, the reference notes beside a checkout (by path or
# by name), and the reference notes' section numbers ("vLLM's frontend, §3.3", "vLLM's processor cache, §5.2").
OUTSIDE_NOTES = ("feature_anchors", "structure_review", "platform_anchors", "next_surface", "peer_vllm", "vllm_frontend")
OUTSIDE_DOCS = re.compile(r"DESIGN\.md|\.\./shared/|/work/shared\b|\breference/\w+\.md|"
                          r"\b(?:" + "|".join(OUTSIDE_NOTES) + r")\b|\bvLLM's [\w ]+, §\d")
# What may still point outside, with its reason: the shared conformance cases are test data, not a document (their
# tests skip when the file is not beside the checkout).
OUTSIDE_ALLOWED = re.compile(r"\.\./shared/conformance/cases\.jsonl")


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the files are listed with git ls-files")
    result = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [p for p in result.stdout.decode().split("\0") if p]


def test_no_file_cites_a_document_outside_the_repository() -> None:
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    found: list[str] = []
    for rel in _tracked_files():
        if rel == this:
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or deleted in the working tree
        for no, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_DOCS.search(OUTSIDE_ALLOWED.sub("", line)):
                found.append(f"{rel}:{no}: {line.strip()[:120]}")
    assert not found, "citations of documents outside the repository (cite docs/ARCHITECTURE.md §N, another file " \
                      "under docs/, or a public source such as a vLLM source path):\n" + "\n".join(found)
