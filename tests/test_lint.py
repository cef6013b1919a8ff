"""The linters run with the tests: ``ruff check .`` over the whole tree and ``mypy`` (strict on ``inference`` and
the gateway), both configured in ``pyproject.toml``. A failure shows the tool's own report."""

from __future__ import annotations

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
