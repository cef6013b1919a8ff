"""``docs/request_path.md`` names only code that exists (issue 40): every ``path:function`` or ``path:Class.method``
in it, and the bare names listed right after one (``path:f``, ``g``, ``h``: a comma between them), is defined in
that file, found with ``ast`` (no import). A path is taken from the repository root, else from ``platform/``, as
the document says. A renamed or moved function fails here until the document follows it.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "request_path.md"

CODE = re.compile(r"`([^`]+)`")
PATH_REF = re.compile(r"^(?P<path>[\w./-]+\.py):(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")
BARE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?$")
LISTED = ", "  # what separates a bare name from the reference (or bare name) before it


def _units(text: str) -> list[str]:
    """The document cut where a listed name cannot continue: table cells and paragraphs."""
    units: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("|"):
            for row in block.splitlines():
                units.extend(cell for cell in row.strip().strip("|").split("|"))
        else:
            units.append(" ".join(block.split()))
    return units


def references(text: str) -> list[tuple[str, str]]:
    """``(path, qualified name)`` for every reference of ``text``; a bare name gets the path (and, for a method after
    ``Class.method``, the class: ``Class.name`` is tried before ``name``) of the reference it follows."""
    found: list[tuple[str, str]] = []
    for unit in _units(text):
        path: str | None = None
        owner: str | None = None
        end = -1  # where the last reference or listed name ended (-1: none can be listed now)
        for m in CODE.finditer(unit):
            span = m.group(1)
            ref = PATH_REF.match(span)
            if ref:
                path, name = ref.group("path"), ref.group("name")
                owner = name.rsplit(".", 1)[0] if "." in name else None
                found.append((path, name))
                end = m.end()
            elif path is not None and end >= 0 and unit[end:m.start()] == LISTED and BARE.match(span):
                found.append((path, f"{owner}.{span}|{span}" if owner and "." not in span else span))
                end = m.end()
            else:
                end = -1
    return found


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _source(path: str) -> Path | None:
    for base in (ROOT, ROOT / "platform"):
        if (base / path).is_file():
            return base / path
    return None


def _defines(tree: ast.Module, qualname: str) -> bool:
    scope: list[ast.stmt] = tree.body
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return False
        scope = node.body
    return True


def missing(refs: list[tuple[str, str]]) -> list[str]:
    """The references of ``refs`` whose file or definition does not exist (``name`` may list alternatives,
    ``Class.f|f``: one of them must exist)."""
    bad: list[str] = []
    for path, names in refs:
        source = _source(path)
        if source is None:
            bad.append(f"{path}: no such file (from the repository root or platform/)")
        elif not any(_defines(_tree(source), name) for name in names.split("|")):
            bad.append(f"{path}:{names.split('|')[-1]}: not defined there")
    return bad


def test_every_function_the_request_path_names_exists() -> None:
    refs = references(DOC.read_text(encoding="utf-8"))
    assert len(refs) >= 40, f"only {len(refs)} references found in {DOC}: is the parser still reading the table?"
    bad = missing(refs)
    assert not bad, "docs/request_path.md names code that does not exist:\n" + "\n".join(bad)


def test_a_wrong_name_is_caught() -> None:
    text = ("| 1 | step | `gateway/pipeline/scope.py:RequestScope.release`, `holds_nothing`, `no_such_method` | — |\n"
            "| 2 | step | `gateway/pipeline/flow.py:no_such_function` (`not_listed`) | — |\n\n"
            "A paragraph: `gateway/no_such_file.py:f` and `inference/api/router.py:choose_replica`, `ReplicaView`.\n")
    refs = references(text)
    assert ("gateway/pipeline/flow.py", "no_such_function") in refs
    assert not any("not_listed" in name for _path, name in refs), "a name in parentheses is not a listed one"
    assert missing(refs) == ["gateway/pipeline/scope.py:no_such_method: not defined there",
                             "gateway/pipeline/flow.py:no_such_function: not defined there",
                             "gateway/no_such_file.py: no such file (from the repository root or platform/)"]
