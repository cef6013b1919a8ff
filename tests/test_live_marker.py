"""The ``live`` marker's rule and guard (``tests/support/live_marker.py``), on a small suite run by an inner pytest:
a start reached through a fixture and a helper is marked live (and deselected by ``-m "not live"``), a tool run to
its end is not, and a start the rule cannot see fails its test, naming the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SUITE = '''
import subprocess
import sys

import pytest


def _start_server():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])


@pytest.fixture
def server():
    proc = _start_server()
    yield proc
    proc.wait()


@pytest.fixture
def uses_server(server):
    return server


def test_through_fixtures_and_a_helper(uses_server):
    assert uses_server.pid


def test_a_tool_run_to_its_end():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_start_the_rule_cannot_see():
    start = getattr(subprocess, "Po" + "pen")
    start([sys.executable, "-c", "pass"]).wait()
'''


def _inner_pytest(tmp_path: Path, *args: str) -> str:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:django",
                           "-p", "tests.support.live_marker", "-q", "-rA", *args, str(tmp_path / "test_suite.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.stdout + proc.stderr


def test_not_live_deselects_what_starts_processes_and_fails_what_escapes(tmp_path):
    out = _inner_pytest(tmp_path, "-m", "not live")
    assert "1 deselected" in out, out
    assert "PASSED test_suite.py::test_a_tool_run_to_its_end" in out, out
    assert "FAILED test_suite.py::test_a_start_the_rule_cannot_see" in out, out
    assert "started processes during its run (subprocess.Popen(" in out and "not marked live" in out, out


def test_live_selects_what_the_rule_marks(tmp_path):
    out = _inner_pytest(tmp_path, "-m", "live")
    assert "PASSED test_suite.py::test_through_fixtures_and_a_helper" in out, out
    assert "1 passed, 2 deselected" in out, out
