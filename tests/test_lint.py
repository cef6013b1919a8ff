"""The linters run with the tests: ``ruff check .`` over the whole tree and ``mypy`` (strict on ``inference`` and
the gateway), both configured in ``pyproject.toml``. A failure shows the tool's own report."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(tool: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    exe = BIN / tool
    if not exe.exists():
        pytest.fail(f"{tool} is not installed next to {sys.executable}: pip install -e '.[test]'")
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_is_clean() -> None:
    result = _run("ruff", "check", ".", "--output-format", "concise", "--no-cache", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# mypy's cache is kept for the machine, beside vLLM's environment (scripts/setup.sh), not in the checkout: a first run
# reads torch's and transformers' annotations (~85 s on 2 cores), which a fresh clone would otherwise do again. mypy
# keys its cache on module names and content hashes, so checkouts at other paths and commits share it soundly.
MYPY_CACHE = Path(os.environ.get("LLMP_MYPY_CACHE") or Path.home() / ".cache" / "llm-serving-platform" / "mypy")


@pytest.mark.timeout(600)
def test_mypy_is_clean() -> None:
    result = _run("mypy", "--cache-dir", str(MYPY_CACHE), timeout=590)
    assert result.returncode == 0, result.stdout + result.stderr


# -- sizes ------------------------------------------------------------------------------------------------------------
# Issue 40: a reader takes in a function or a class whole. Lines are counted from the `def`/`class` line to the last
# line of the body, docstring included, decorators not; Django's generated migrations are left out.
SIZE_ROOTS = ("inference", "platform")
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400


def _python_files(*roots: str) -> list[Path]:
    """The ``.py`` files under ``roots`` (paths relative to the repository), migrations left out, sorted."""
    return sorted(p for root in roots for p in (ROOT / root).rglob("*.py") if "migrations" not in p.parts)


def _oversized_definitions(path: Path) -> list[str]:
    """``path:line Qualified.name: N lines (limit L)`` for each function over ``MAX_FUNCTION_LINES`` and each class
    over ``MAX_CLASS_LINES`` in ``path`` (nested definitions included, named through their parents)."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(ROOT)}:{child.lineno} {name}: {lines} lines (limit {limit})")
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def test_no_function_or_class_is_oversized() -> None:
    """No function over 80 lines and no class over 400 in ``inference/`` and ``platform/`` (migrations excluded)."""
    oversized = [line for path in _python_files(*SIZE_ROOTS) for line in _oversized_definitions(path)]
    assert not oversized, "split these by job:\n" + "\n".join(oversized)
