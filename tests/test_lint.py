"""The linters run with the tests: ``ruff check .`` over the whole tree and ``mypy`` (strict on ``inference`` and
the gateway), both configured in ``pyproject.toml``. A failure shows the tool's own report."""

from __future__ import annotations

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


@pytest.mark.timeout(600)
def test_mypy_is_clean() -> None:
    # first run on a fresh clone reads torch's and transformers' annotations: minutes; later runs use its cache
    result = _run("mypy", timeout=590)
    assert result.returncode == 0, result.stdout + result.stderr
